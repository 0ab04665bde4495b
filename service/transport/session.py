"""One Decode RPC's stream session: read-ahead, back-pressure, forced close. No protobuf.

A reader task moves requests from the transport into a queue while earlier ones are handled,
up to ``max_queued_steps`` requests and ``max_queued_bytes`` bytes (it stops reading while
either is reached, so one stream holds at most ``max_queued_bytes`` plus one message; HTTP/2
flow control then holds the client back). The handler takes requests with ``next``, in order.

Forced close (idle reaper, drain) is signalled, not done by cancelling the handler: the
engine calls ``stream.on_forced_close`` from any thread; the session records the error and
wakes the handler, whose next ``next`` raises ``StreamClosed`` (a step being computed finishes
and its reply goes out first). One case cannot be woken: a handler blocked writing a reply to
a client that does not read. After a forced close the session looks every ``write_grace_s``:
a handler found in the same write as at the previous look is cancelled, so the RPC ends and
everything it holds is freed whatever the client does.

Every request byte buffered is also counted on the engine (``read_ahead_bytes``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from ..engine.engine import Engine, Stream
from ..errors import ServiceError

__all__ = ["StreamSession", "StreamClosed", "EOF"]

WRITE_GRACE_S = 2.0


class StreamClosed(Exception):
    """The server closed the stream under its handler (idle timeout, shutdown)."""

    def __init__(self, error: ServiceError):
        super().__init__(error.message)
        self.error = error


class _Eof:
    def __repr__(self) -> str:  # pragma: no cover
        return "EOF"


EOF = _Eof()


class StreamSession:
    """``read`` is an async callable returning the next request or ``end`` (the transport's
    end-of-stream marker); ``size`` gives a request's bytes."""

    def __init__(
        self,
        engine: Engine,
        stream: Stream,
        read,
        end: Any,
        size,
        *,
        max_steps: int,
        max_bytes: int,
        write_grace_s: float = WRITE_GRACE_S,
    ):
        self.engine = engine
        self.stream = stream
        self._read = read
        self._end = end
        self._size = size
        self._max_steps = max_steps
        self._max_bytes = max_bytes
        self._write_grace_s = write_grace_s
        self._queue: deque = deque()  # (request, size)
        self.queued_bytes = 0
        self._wake = asyncio.Event()  # the handler: a request arrived, or a forced close
        self._room = asyncio.Event()  # the reader: room in the read-ahead
        self.forced: ServiceError | None = None
        self._writes = 0  # writes started; the watchdog cuts only the write it saw
        self.writing = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._reader: asyncio.Task | None = None
        self._closed = False

    def start(self) -> None:
        self.stream.on_forced_close = self._on_forced_close
        self._reader = self._loop.create_task(self._read_ahead())

    # -- the handler's side -------------------------------------------------------------------
    async def next(self):
        """The next request in order, ``EOF`` at the client's end; raises ``StreamClosed`` after a
        forced close, or what reading the transport raised."""
        while True:
            if self.forced is not None:
                raise StreamClosed(self.forced)
            if self._queue:
                request, size = self._queue.popleft()
                if size:
                    self.queued_bytes -= size
                    self.engine.read_ahead_bytes -= size
                self._room.set()
                if isinstance(request, BaseException):
                    raise request
                return EOF if request is self._end else request
            self._wake.clear()
            await self._wake.wait()

    def begin_write(self) -> None:
        self._writes += 1
        self.writing = True

    def end_write(self) -> None:
        self.writing = False

    def close(self) -> None:
        """Stops reading and releases every buffered byte; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        self.engine.read_ahead_bytes -= self.queued_bytes
        self.queued_bytes = 0
        self._queue.clear()
        self.stream.on_forced_close = None

    # -- forced close -----------------------------------------------------------------------------
    def _on_forced_close(self, error: ServiceError) -> None:
        """Any thread."""
        try:
            self._loop.call_soon_threadsafe(self._force, error)
        except RuntimeError:  # the loop is gone; so is the RPC
            pass

    def _force(self, error: ServiceError) -> None:
        first = self.forced is None
        if first:
            self.forced = error
        self._wake.set()
        if first and not self._closed:
            self._loop.call_later(self._write_grace_s, self._watch, self._writes)

    def _watch(self, writes: int) -> None:
        """After a forced close: a handler in the same write as ``write_grace_s`` ago is stuck
        (its client does not read); cut it. A handler still finishing a step is looked at again."""
        if self._closed or self._task is None:
            return
        if self.writing and self._writes == writes:
            self._task.cancel()
            return
        self._loop.call_later(self._write_grace_s, self._watch, self._writes)

    # -- the reader ----------------------------------------------------------------------------------
    async def _read_ahead(self) -> None:
        try:
            while True:
                while len(self._queue) >= self._max_steps or self.queued_bytes >= self._max_bytes:
                    self._room.clear()
                    await self._room.wait()
                request = await self._read()
                self.stream.touch(self.engine.clock())
                if request is self._end:
                    self._queue.append((request, 0))
                    self._wake.set()
                    return
                size = self._size(request)
                self.queued_bytes += size
                self.engine.read_ahead_bytes += size
                self._queue.append((request, size))
                self._wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.append((exc, 0))
            self._wake.set()
