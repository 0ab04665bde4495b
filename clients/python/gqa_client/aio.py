"""``AsyncClient`` and ``AsyncDecodeStream``: the asyncio client (``grpc.aio``), with the
methods of ``Client`` and ``DecodeStream``, awaited.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from .api import gqa_pb2
from .channel import _Channel
from .errors import CallFailed, GqaError
from .messages import (
    DEFAULT_CHUNK_BYTES,
    DecodeStepResult,
    RollbackResult,
    StepResult,
    _decode_step_request,
    _decode_step_result,
    _health_request,
    _health_status,
    _rollback_request,
    _rollback_result,
    _snapshot_chunk,
    _snapshot_request,
    _step_request,
    _step_result,
    open_message,
)
from .snapshot import Snapshot, as_snapshot
from .tensors import dtype_name

__all__ = ["AsyncClient", "AsyncDecodeStream"]


class AsyncDecodeStream:
    """``DecodeStream`` for asyncio: the same methods, awaited."""

    def __init__(self, call):
        self._call = call
        self._rid = 0
        self._closed = False
        self.opened: gqa_pb2.StreamOpened | None = None
        self.dtype: str | None = None

    async def _start(self, first: Sequence[gqa_pb2.DecodeRequest]) -> "AsyncDecodeStream":
        try:
            for request in first:
                await self._call.write(request)
            self.opened = (await self._next()).opened
        except grpc.RpcError as exc:
            self._call.cancel()
            raise CallFailed.from_rpc(exc) from None
        except BaseException:
            self._call.cancel()
            raise
        self.dtype = dtype_name(self.opened.dtype)
        return self

    async def _next(self) -> gqa_pb2.DecodeResponse:
        try:
            response = await self._call.read()
        except grpc.RpcError as exc:
            self._closed = True
            raise CallFailed.from_rpc(exc) from None
        if response is grpc.aio.EOF:
            self._closed = True
            code = await self._call.code()
            raise CallFailed(
                code if code != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN,
                await self._call.details() or "the server ended the stream",
            )
        return response

    async def _send(self, request: gqa_pb2.DecodeRequest) -> None:
        if self._closed:
            raise CallFailed(grpc.StatusCode.CANCELLED, "the stream is closed")
        try:
            await self._call.write(request)
        except grpc.RpcError as exc:
            self._closed = True
            raise CallFailed.from_rpc(exc) from None
        except grpc.aio.UsageError:  # the RPC already ended; its status tells why
            self._closed = True
            raise CallFailed(await self._call.code(), await self._call.details() or "the stream ended") from None

    async def _reply(self, rid: int) -> gqa_pb2.DecodeResponse:
        response = await self._next()
        if response.request_id != rid:
            raise GqaError(grpc.StatusCode.INTERNAL, f"reply to request {response.request_id}, expected {rid}")
        return response

    async def step(self, layer: int, query, new_key, new_value) -> StepResult:
        rid = self._rid + 1
        request = _step_request(rid, layer, query, new_key, new_value, self.dtype)
        await self._send(request)
        self._rid = rid
        return _step_result(await self._reply(rid), query)

    async def rollback(self, count: int, layer: int | None = None) -> RollbackResult:
        self._rid += 1
        await self._send(_rollback_request(self._rid, count, layer))
        return _rollback_result(await self._reply(self._rid))

    async def snapshot(self, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Snapshot:
        self._rid += 1
        rid = self._rid
        await self._send(_snapshot_request(rid, max_chunk_bytes))
        chunks = [_snapshot_chunk(await self._reply(rid))]
        while not chunks[-1].last:
            chunks.append(_snapshot_chunk(await self._reply(rid)))
        return Snapshot(chunks)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._call.done_writing()
            while await self._call.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise CallFailed.from_rpc(exc) from None

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> "AsyncDecodeStream":
        return self

    async def __aexit__(self, *exc) -> None:
        if exc[0] is None:
            await self.close()
        else:
            self.cancel()


class AsyncClient(_Channel):
    """``Client`` for asyncio (``grpc.aio``); the same arguments. Create it inside the loop."""

    _grpc = grpc.aio

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise CallFailed.from_rpc(exc) from None

    async def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"no server at {self.address} after {timeout:g} s") from None

    async def server_info(self) -> gqa_pb2.GetServerInfoResponse:
        return await self._unary(self.stub.GetServerInfo, gqa_pb2.GetServerInfoRequest())

    async def health(self, service: str = "") -> str:
        return _health_status(await self._unary(self._health, _health_request(service)))

    async def decode_step(
        self,
        query,
        new_key,
        new_value,
        key_cache,
        value_cache,
        *,
        num_query_heads: int = 0,
        num_kv_heads: int = 0,
        dtype=None,
    ) -> DecodeStepResult:
        request = _decode_step_request(
            query, new_key, new_value, key_cache, value_cache, num_query_heads, num_kv_heads, dtype
        )
        return _decode_step_result(await self._unary(self.stub.DecodeStep, request), query)

    async def open(
        self,
        *,
        num_query_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        batch_size: int = 1,
        dtype="float32",
        policy: str = "none",
        window: int = 0,
        capacity: int | None = None,
        sink_tokens: int = 0,
        backend: str = "",
        prefill: Mapping[int, tuple[Any, Any]] | None = None,
    ) -> AsyncDecodeStream:
        """As ``Client.open``."""
        message = open_message(
            num_query_heads=num_query_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_layers=num_layers,
            batch_size=batch_size,
            dtype=dtype,
            policy=policy,
            window=window,
            capacity=capacity,
            sink_tokens=sink_tokens,
            backend=backend,
            prefill=prefill,
        )
        return await self.open_message(message)

    async def open_message(self, message: gqa_pb2.OpenStream) -> AsyncDecodeStream:
        call = self.stub.Decode(metadata=self.metadata)
        return await AsyncDecodeStream(call)._start([gqa_pb2.DecodeRequest(request_id=0, open=message)])

    async def restore(self, snapshot: Snapshot | bytes | str | os.PathLike) -> AsyncDecodeStream:
        chunks = as_snapshot(snapshot).chunks
        call = self.stub.Decode(metadata=self.metadata)
        return await AsyncDecodeStream(call)._start([gqa_pb2.DecodeRequest(request_id=0, restore=c) for c in chunks])

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
