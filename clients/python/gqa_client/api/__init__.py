"""Generated gqa.v1 stubs (by `make proto`, from proto/gqa/v1; never edited by hand)."""

from . import gqa_pb2, gqa_pb2_grpc

__all__ = ["gqa_pb2", "gqa_pb2_grpc"]
