"""Stream snapshots to ``SnapshotChunk`` messages and back (checked, bit-exact).

A snapshot is the stream's configuration, T per layer and each layer's resident tokens in
position order: dense tensors for float caches, int8 codes plus scales for int8 caches (as
``LayerCache.export_state`` gives them). Layer data is split along the position axis so that
each message stays under half the server's message limit. A CRC-32 over all data guards
against tampering in transit; consistency (shapes, T against the policy) is checked by the
caches when they load.
"""

from __future__ import annotations

import zlib

import torch

from .api import gqa_pb2
from .engine import StreamConfig
from .errors import InvalidArgument
from .tensors import from_proto, to_proto

__all__ = ["encode", "decode", "MAX_CHUNKS"]

MAX_CHUNKS = 1 << 16
_OVERHEAD = 4096  # bytes of a chunk that are not tensor data (fields, shapes)
_TENSORS = ("key", "value", "key_scale", "value_scale")


def _checksum(chunks) -> int:
    crc = 0
    for chunk in chunks:
        for name in _TENSORS:
            crc = zlib.crc32(getattr(chunk, name).data, crc)
    return crc


def encode(stream, config: gqa_pb2.OpenStream, max_message_bytes: int) -> list[gqa_pb2.SnapshotChunk]:
    """The stream's state as chunks; the last one has ``last`` and the checksum set."""
    caches = list(stream.caches)
    chunks = [gqa_pb2.SnapshotChunk(config=config, tokens_seen=[c.tokens_seen for c in caches])]
    budget = max(1, max_message_bytes // 2 - _OVERHEAD)
    for layer, cache in enumerate(caches):
        state = cache.export_state()
        tensors = {name: state[name] for name in _TENSORS if name in state}
        resident = tensors["key"].shape[2]
        per_position = sum(t[:, :, :1].numel() * t.element_size() for t in tensors.values())
        step = max(1, budget // max(1, per_position))
        for offset in range(0, resident, step):
            chunk = gqa_pb2.SnapshotChunk(layer=layer, offset=offset, encoding=state["encoding"])
            for name, tensor in tensors.items():
                getattr(chunk, name).CopyFrom(to_proto(tensor[:, :, offset : offset + step]))
            chunks.append(chunk)
    chunks[-1].last = True
    chunks[-1].checksum = _checksum(chunks)
    return chunks


def decode(chunks: list[gqa_pb2.SnapshotChunk], config: StreamConfig) -> list[tuple[int, dict]]:
    """Per layer ``(tokens_seen, state)``; ``InvalidArgument`` for anything inconsistent."""
    if _checksum(chunks) != chunks[-1].checksum:
        raise InvalidArgument("restore: the snapshot's checksum does not match its data (tampered or truncated)")
    tokens = list(chunks[0].tokens_seen)
    if len(tokens) != config.num_layers:
        raise InvalidArgument(
            f"restore: tokens_seen has {len(tokens)} entries but the configuration has {config.num_layers} layers")
    pieces: dict[int, list[gqa_pb2.SnapshotChunk]] = {}
    for i, chunk in enumerate(chunks[1:], start=1):
        if chunk.HasField("config") or chunk.tokens_seen:
            raise InvalidArgument(f"restore: chunk {i} repeats the configuration")
        if chunk.layer >= config.num_layers:
            raise InvalidArgument(f"restore: chunk {i} names layer {chunk.layer}; the stream has {config.num_layers}")
        pieces.setdefault(chunk.layer, []).append(chunk)
    layers = []
    for layer in range(config.num_layers):
        parts = pieces.get(layer, [])
        if not parts:
            layers.append((tokens[layer], {"encoding": "empty"}))
            continue
        encoding = parts[0].encoding
        state: dict = {"encoding": encoding}
        expected_offset = 0
        columns: dict[str, list[torch.Tensor]] = {}
        for part in parts:
            if part.encoding != encoding:
                raise InvalidArgument(f"restore: layer {layer} mixes encodings {encoding!r} and {part.encoding!r}")
            if part.offset != expected_offset:
                raise InvalidArgument(
                    f"restore: layer {layer} chunk at offset {part.offset}, expected {expected_offset}")
            for name in _TENSORS:
                if not part.HasField(name):
                    continue
                rank = 4 if name in ("key", "value") else 3
                tensor = from_proto(getattr(part, name), f"restore.layer{layer}.{name}", rank=rank,
                                    allow_int8=encoding == "int8" and rank == 4)
                columns.setdefault(name, []).append(tensor)
            if "key" not in columns or len(columns["key"]) != len(columns.get("value", [])):
                raise InvalidArgument(f"restore: layer {layer} chunk at offset {part.offset} lacks keys or values")
            expected_offset += columns["key"][-1].shape[2]
        try:
            for name, tensors in columns.items():
                state[name] = torch.cat(tensors, dim=2)
        except RuntimeError:
            raise InvalidArgument(f"restore: layer {layer} chunks have inconsistent shapes") from None
        layers.append((tokens[layer], state))
    return layers
