"""Stream snapshots to ``SnapshotChunk`` messages and back (checked, bit-exact).

A snapshot is the stream's configuration, T per layer and each layer's resident tokens in
position order: dense tensors for float caches; for int8 caches the codes, scales and float16
key outlier channels, plus on each layer's first chunk the key channel order and, while the
outlier channels are still being chosen (T < 16), the first keys (as ``export_state`` gives
them). Layer data is split along the position axis so that each message stays under half the
server's message limit.

Integrity, two levels:

- a CRC-32 over all data (always): detects truncation and corruption in transit, not a
  deliberate change (anyone can recompute it);
- with a server snapshot key (``--snapshot-key-file`` / ``GQA_SNAPSHOT_KEY``, read by
  ``config.load_snapshot_key`` into ``Engine.snapshot_key``), an HMAC-SHA256
  over every chunk (``signature``): a restore must carry a valid one, so a client can neither
  forge a stream's state nor alter one (its T, its rows).

Whatever the key, every field is checked for consistency: T per layer within ``MAX_TOKENS``
here, and against the resident rows and the policy by the caches when they load.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from typing import TYPE_CHECKING

import torch

from ..api import gqa_pb2

if TYPE_CHECKING:  # pragma: no cover
    from .engine import StreamConfig
from ..errors import InvalidArgument
from .tensors import from_proto, to_proto

__all__ = ["encode", "decode", "signature", "check_size", "MAX_CHUNKS", "MAX_TOKENS", "DEFAULT_CHUNK_BYTES"]

MAX_CHUNKS = 1 << 16
# A layer's T in a snapshot: a stream at a million tokens a second takes 146,000 years to get
# here, and T + 1 still fits every integer the server and its replies use.
MAX_TOKENS = 1 << 62
# gRPC's default receive limit in every language: chunks a client did not size stay under it.
DEFAULT_CHUNK_BYTES = 4 << 20
_OVERHEAD = 4096  # bytes of a chunk that are not tensor data (fields, shapes)
# tensors split along the position axis, and their ranks
_TENSORS = {"key": 4, "value": 4, "key_scale": 3, "value_scale": 3, "key_outliers": 4}
# checksummed, in this order (the proto says so)
_CHECKED = ("key", "value", "key_scale", "value_scale", "key_outliers", "key_calibration")


def _checksum(chunks) -> int:
    crc = 0
    for chunk in chunks:
        for name in _CHECKED:
            crc = zlib.crc32(getattr(chunk, name).data, crc)
        crc = zlib.crc32(struct.pack(f"<{len(chunk.key_channels)}I", *chunk.key_channels), crc)
    return crc


def signature(chunks, key: bytes) -> bytes:
    """HMAC-SHA256 of the chunks as the proto's ``signature`` field describes; the last chunk's
    signature is left empty while it is computed."""
    last = chunks[-1]
    saved = last.signature
    last.ClearField("signature")
    try:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for chunk in chunks:
            data = chunk.SerializeToString(deterministic=True)
            mac.update(struct.pack("<Q", len(data)))
            mac.update(data)
        return mac.digest()
    finally:
        last.signature = saved


def check_size(need: int, chunks: int, received: int, what: str = "restore") -> None:
    """The one limit on a snapshot being received, for a stream or sequence admitted with
    ``need`` reserved bytes (``Engine.admit``), after ``chunks`` chunks of ``received`` bytes:
    a snapshot holds at most the resident rows (and the int8 calibration rows), so at most
    about the reservation, each chunk's fields up to ``_OVERHEAD`` more. ``InvalidArgument``
    past it: the receiver stops buffering at once (Decode and Batch alike)."""
    limit = 2 * need + (1 << 20)
    if chunks > MAX_CHUNKS or received > limit + chunks * _OVERHEAD:
        raise InvalidArgument(f"{what}: the snapshot is larger than the stream it restores could hold")


def encode(
    stream, config: gqa_pb2.OpenStream, max_message_bytes: int, max_chunk_bytes: int = 0, key: bytes | None = None
) -> list[gqa_pb2.SnapshotChunk]:
    """The stream's state as chunks; the last one has ``last``, the checksum and, with ``key``,
    the signature set.

    Each chunk's response message stays under ``max_chunk_bytes`` (0: ``DEFAULT_CHUNK_BYTES``)
    and under half of ``max_message_bytes``, except that a chunk always carries at least one
    position.
    """
    caches = list(stream.caches)
    chunks = [gqa_pb2.SnapshotChunk(config=config, tokens_seen=[c.tokens_seen for c in caches])]
    limit = min(max_chunk_bytes or DEFAULT_CHUNK_BYTES, max_message_bytes // 2)
    budget = max(1, limit - _OVERHEAD)
    for layer, cache in enumerate(caches):
        state = cache.export_state()
        tensors = {name: state[name] for name in _TENSORS if name in state}
        resident = tensors["key"].shape[2]
        per_position = sum(t[:, :, :1].numel() * t.element_size() for t in tensors.values())
        # what only a layer's first chunk carries, and the room it takes there
        head = {}
        if "key_calibration" in state:
            head["key_calibration"] = state["key_calibration"]
        head_bytes = sum(t.numel() * t.element_size() for t in head.values())
        channels = state["key_channels"].reshape(-1).tolist() if "key_channels" in state else []
        head_bytes += 4 * len(channels)
        offset, first = 0, True
        while offset < resident:
            room = budget - head_bytes if first else budget
            step = max(1, room // max(1, per_position))
            chunk = gqa_pb2.SnapshotChunk(layer=layer, offset=offset, encoding=state["encoding"])
            for name, tensor in tensors.items():
                getattr(chunk, name).CopyFrom(to_proto(tensor[:, :, offset : offset + step]))
            if first:
                for name, tensor in head.items():
                    getattr(chunk, name).CopyFrom(to_proto(tensor))
                chunk.key_channels.extend(channels)
            chunks.append(chunk)
            offset += step
            first = False
    chunks[-1].last = True
    chunks[-1].checksum = _checksum(chunks)
    if key is not None:
        chunks[-1].signature = signature(chunks, key)
    return chunks


def decode(
    chunks: list[gqa_pb2.SnapshotChunk], config: StreamConfig, key: bytes | None = None
) -> list[tuple[int, dict]]:
    """Per layer ``(tokens_seen, state)``; ``InvalidArgument`` for anything inconsistent, and,
    with ``key``, for a missing or wrong signature."""
    _check_integrity(chunks, key)
    tokens = _tokens_seen(chunks[0], config)
    pieces = _layer_chunks(chunks, config)
    return [
        (tokens[layer], _layer_state(layer, pieces[layer], config) if pieces.get(layer) else {"encoding": "empty"})
        for layer in range(config.num_layers)
    ]


def _check_integrity(chunks: list[gqa_pb2.SnapshotChunk], key: bytes | None) -> None:
    """The signature (with ``key``) and the checksum, before anything else is read."""
    if key is not None:
        if not chunks[-1].signature:
            raise InvalidArgument(
                "restore: this server requires signed snapshots and the snapshot carries no signature"
            )
        if not hmac.compare_digest(signature(chunks, key), chunks[-1].signature):
            raise InvalidArgument(
                "restore: the snapshot's signature does not match (altered, or signed with another key)"
            )
    if _checksum(chunks) != chunks[-1].checksum:
        raise InvalidArgument("restore: the snapshot's checksum does not match its data (corrupted or truncated)")


def _tokens_seen(head: gqa_pb2.SnapshotChunk, config: StreamConfig) -> list[int]:
    tokens = list(head.tokens_seen)
    if len(tokens) != config.num_layers:
        raise InvalidArgument(
            f"restore: tokens_seen has {len(tokens)} entries but the configuration has {config.num_layers} layers"
        )
    for layer, t in enumerate(tokens):
        if t >= MAX_TOKENS:
            raise InvalidArgument(
                f"restore: tokens_seen[{layer}] = {t} is beyond any stream (at most {MAX_TOKENS - 1})"
            )
    return tokens


def _layer_chunks(chunks: list[gqa_pb2.SnapshotChunk], config: StreamConfig) -> dict[int, list]:
    """The data chunks (all but the first) by layer, in order."""
    pieces: dict[int, list[gqa_pb2.SnapshotChunk]] = {}
    for i, chunk in enumerate(chunks[1:], start=1):
        if chunk.HasField("config") or chunk.tokens_seen:
            raise InvalidArgument(f"restore: chunk {i} repeats the configuration")
        if chunk.layer >= config.num_layers:
            raise InvalidArgument(f"restore: chunk {i} names layer {chunk.layer}; the stream has {config.num_layers}")
        pieces.setdefault(chunk.layer, []).append(chunk)
    return pieces


def _layer_state(layer: int, parts: list[gqa_pb2.SnapshotChunk], config: StreamConfig) -> dict:
    """One layer's state (``LayerCache.load_state``'s argument) from its chunks, in order."""
    encoding = parts[0].encoding
    state: dict = {"encoding": encoding}
    expected_offset = 0
    columns: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        if part.encoding != encoding:
            raise InvalidArgument(f"restore: layer {layer} mixes encodings {encoding!r} and {part.encoding!r}")
        if part.offset != expected_offset:
            raise InvalidArgument(f"restore: layer {layer} chunk at offset {part.offset}, expected {expected_offset}")
        for name, rank in _TENSORS.items():
            if not part.HasField(name):
                continue
            tensor = from_proto(
                getattr(part, name),
                f"restore.layer{layer}.{name}",
                rank=rank,
                allow_int8=encoding == "int8" and name in ("key", "value"),
            )
            columns.setdefault(name, []).append(tensor)
        if part.key_channels or part.HasField("key_calibration"):
            if part is not parts[0] or encoding != "int8":
                raise InvalidArgument(
                    f"restore: layer {layer} carries key_channels or key_calibration outside an int8 layer's first chunk"
                )
            state.update(_int8_extras(layer, part, config))
        if "key" not in columns or len(columns["key"]) != len(columns.get("value", [])):
            raise InvalidArgument(f"restore: layer {layer} chunk at offset {part.offset} lacks keys or values")
        expected_offset += columns["key"][-1].shape[2]
    try:
        for name, tensors in columns.items():
            state[name] = torch.cat(tensors, dim=2)
    except RuntimeError:
        raise InvalidArgument(f"restore: layer {layer} chunks have inconsistent shapes") from None
    return state


def _int8_extras(layer: int, head: gqa_pb2.SnapshotChunk, config: StreamConfig) -> dict:
    """An int8 layer's outlier channels and calibration rows, from its first chunk."""
    extras: dict = {}
    if head.key_channels:
        b, h, d = config.batch_size, config.num_kv_heads, config.head_dim
        if len(head.key_channels) != b * h * d:
            raise InvalidArgument(
                f"restore: layer {layer} key_channels has {len(head.key_channels)} entries, expected B*Hkv*D = {b * h * d}"
            )
        extras["key_channels"] = torch.tensor(list(head.key_channels), dtype=torch.int64).view(b, h, d)
    if head.HasField("key_calibration"):
        extras["key_calibration"] = from_proto(head.key_calibration, f"restore.layer{layer}.key_calibration", rank=4)
    return extras
