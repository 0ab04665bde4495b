"""One streaming RPC's session (a Decode stream, a Batch session): reads, read-ahead while a step
computes elsewhere, forced close. No protobuf.

The handler reads its requests itself (``next``): a request goes from the transport to the handler
with no task between them. While one of its steps computes on the compute workers
(``computing``), a reader task reads ahead for it into a queue, up to ``max_steps`` requests and
``max_bytes`` bytes (it stops reading while either is reached, so one stream holds at most
``max_bytes`` plus one message; HTTP/2 flow control then holds the client back); ``next`` takes
the queued requests first, in order. A step computed on the event loop (at once, or in the
loop's batch at its next turn) leaves nothing to overlap, so nothing reads ahead of it.

Forced close (idle reaper, drain) is signalled, not done by cancelling the handler at an
arbitrary point: the engine calls ``on_forced_close`` from any thread; the session records the
error, and the handler's next ``next`` raises ``StreamClosed`` (a step being computed finishes
and its reply goes out first). A handler waiting in its own read is cancelled out of that read
only, and the read raises ``StreamClosed`` too. One case cannot be woken: a handler blocked
writing a reply to a client that does not read. After a forced close the session looks every
``write_grace_s``: a handler found in the same write as at the previous look is cancelled, so the
RPC ends and everything it holds is freed whatever the client does.

Every request byte read ahead is also counted on the engine (``read_ahead_bytes``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from ..engine.engine import Engine
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
    end-of-stream marker); ``size`` gives a request's bytes; ``touch`` is called after every
    request read (the idle timeout). Create on the handler's task."""

    def __init__(
        self,
        engine: Engine,
        read,
        end: Any,
        size,
        touch: Callable[[], None],
        *,
        max_steps: int,
        max_bytes: int,
        write_grace_s: float = WRITE_GRACE_S,
    ):
        self.engine = engine
        self._read = read
        self._end = end
        self._size = size
        self._touch = touch
        self._max_steps = max_steps
        self._max_bytes = max_bytes
        self._write_grace_s = write_grace_s
        self._queue: deque = deque()  # requests read ahead: (request, size)
        self.queued_bytes = 0
        self._wake = asyncio.Event()  # the handler: a request was read ahead, or a forced close
        self._room = asyncio.Event()  # the reader: room in the read-ahead
        self.forced: ServiceError | None = None
        self._writes = 0  # writes started; the watchdog cuts only the write it saw
        self.writing = False
        self._reading = False  # the handler waits in its own read
        self._cut_read = False  # ... and a forced close cancelled it out of that read
        self._computing = False  # the handler waits for a step computing on the workers
        self._ahead = False  # ... and the step it is about to wait for went to them
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._reader: asyncio.Task | None = None  # reading ahead; None when no read is in flight
        self._closed = False

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
            if self._reader is None:
                return await self._read_here()
            self._wake.clear()  # the reader has a read in flight: its request comes next
            await self._wake.wait()

    async def _read_here(self):
        self._reading = True
        try:
            request = await self._read()
        except asyncio.CancelledError:
            if not self._cut_read:
                raise
            self._cut_read = False
            self._task.uncancel()
            raise StreamClosed(self.forced) from None
        finally:
            self._reading = False
        self._touch()
        return EOF if request is self._end else request

    def step_queued(self) -> None:
        """The step about to be awaited went to the compute workers (``Engine.submit_step``'s
        ``queued``): ``computing`` reads ahead while it waits for it."""
        self._ahead = True

    async def computing(self, future: asyncio.Future):
        """``await future`` (a step's answer), reading ahead meanwhile if the step computes on
        the workers (``step_queued``; a step in the loop's batch is answered at the loop's
        next turn, with nothing to overlap): one turn later, if it is still computing."""
        if future.done():
            self._ahead = False
            return future.result()
        if not self._ahead:
            return await future
        self._ahead = False
        self._computing = True
        self._loop.call_soon(self._read_ahead_for, future)
        try:
            return await future
        finally:
            self._computing = False

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

    # -- forced close -----------------------------------------------------------------------------
    def on_forced_close(self, error: ServiceError) -> None:
        """Any thread (``Stream.on_forced_close``)."""
        try:
            self._loop.call_soon_threadsafe(self._force, error)
        except RuntimeError:  # the loop is gone; so is the RPC
            pass

    def _force(self, error: ServiceError) -> None:
        first = self.forced is None
        if first:
            self.forced = error
        self._wake.set()
        if self._reading and not self._cut_read and self._task is not None:
            self._cut_read = True
            self._task.cancel()
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
    def _read_ahead_for(self, future: asyncio.Future) -> None:
        if future.done() or not self._computing or self._reader is not None or self._closed:
            return
        if self.forced is None:
            self._reader = self._loop.create_task(self._read_ahead())

    async def _read_ahead(self) -> None:
        """Reads while the handler waits for a step on the workers (and the read in flight when
        it stops waiting), then ends."""
        try:
            while self._computing and self.forced is None:
                if len(self._queue) >= self._max_steps or self.queued_bytes >= self._max_bytes:
                    self._room.clear()
                    await self._room.wait()
                    continue
                request = await self._read()
                self._touch()
                if request is self._end:
                    self._queue.append((request, 0))
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
        finally:
            self._reader = None
            self._wake.set()
