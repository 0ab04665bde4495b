"""``Snapshot``: a stream's or ``Batch`` sequence's complete state, in memory or in a file."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Iterator, Sequence

from .api import gqa_pb2

__all__ = ["Snapshot", "as_snapshot"]

_MAGIC = b"GQASNAP1"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Snapshot:
    """The ``SnapshotChunk`` messages of one state, in order, up to the one with ``last`` set.

    A ``Decode`` stream's snapshot restores as a stream (``Client.restore``) and, for a batch
    size of 1, as a ``Batch`` sequence (``BatchSession.restore``); a sequence's snapshot restores
    either way too. ``to_bytes`` / ``save`` write the 8 bytes ``GQASNAP1`` and then every chunk
    as a length-delimited message (a varint length, then the bytes: Java's ``writeDelimitedTo``,
    Go's ``protodelim``), so any language can read it back. Restoring sends the chunks as they
    are; the server checks their CRC-32.
    """

    def __init__(self, chunks: Sequence[gqa_pb2.SnapshotChunk]):
        if not chunks or not chunks[-1].last:
            raise ValueError("a snapshot needs its chunks up to the one with `last` set")
        self.chunks = list(chunks)

    @property
    def config(self) -> gqa_pb2.OpenStream:
        return self.chunks[0].config

    @property
    def tokens_seen(self) -> list[int]:
        """Tokens each layer had seen, layer by layer."""
        return list(self.chunks[0].tokens_seen)

    def to_bytes(self) -> bytes:
        parts = [_MAGIC]
        for chunk in self.chunks:
            data = chunk.SerializeToString()
            parts += [_varint(len(data)), data]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Snapshot":
        """``ValueError`` for bytes that are not a whole snapshot."""
        view = memoryview(data)
        if bytes(view[:8]) != _MAGIC:
            raise ValueError("not a gqa-serve snapshot (it does not start with GQASNAP1)")
        chunks, pos = [], 8
        while pos < len(view):
            size = shift = 0
            while True:
                if pos >= len(view):
                    raise ValueError("truncated snapshot")
                byte = view[pos]
                pos += 1
                size |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            if pos + size > len(view):
                raise ValueError("truncated snapshot")
            chunks.append(gqa_pb2.SnapshotChunk.FromString(bytes(view[pos : pos + size])))
            pos += size
        return cls(chunks)

    def save(self, path: str | os.PathLike) -> None:
        pathlib.Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Snapshot":
        return cls.from_bytes(pathlib.Path(path).read_bytes())

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[gqa_pb2.SnapshotChunk]:
        return iter(self.chunks)


def as_snapshot(snapshot: Snapshot | bytes | str | os.PathLike | Iterable[gqa_pb2.SnapshotChunk]) -> Snapshot:
    """A ``Snapshot`` from itself, its bytes, a file written by ``save``, or its chunks."""
    if isinstance(snapshot, Snapshot):
        return snapshot
    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        return Snapshot.from_bytes(bytes(snapshot))
    if isinstance(snapshot, (str, os.PathLike)):
        return Snapshot.load(snapshot)
    return Snapshot(list(snapshot))
