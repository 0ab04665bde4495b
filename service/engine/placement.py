"""Where a step computes: on the event loop at once, in the loop's batch at its next turn, or on
the compute workers. One decision for a Decode stream's step and a Batch session's message, so
both front ends weigh the thread hops the same way (docs/design.md, "The Decode path, per step"
and "A Batch message's per-message cost, round three")."""

from __future__ import annotations

from ..config import ServerConfig
from .batcher import Batcher, PendingJob, PendingStep

__all__ = ["Placement", "HERE", "SOON", "QUEUED"]

# Where Placement.step sent a step: computed already, in the loop's batch at its next turn, or
# queued for the compute workers (the only place worth reading a stream's next request ahead).
HERE, SOON, QUEUED = 0, 1, 2

# Steps of different streams submitted closer together than this count as concurrent.
CONCURRENT_WINDOW_S = 1e-3
# A Batch session's message runs on the event loop when its previous message computed in less
# than this, whatever other sessions and streams have queued or computing: the two thread hops
# (the batcher's wake-up, the hand-back through the loop's self-pipe, the GIL passed back and
# forth) cost more server CPU than that (4 sessions of 64 sequences: 16-25% of it), and the
# loop is held no longer than this.
INLINE_MESSAGE_S = 2e-3
# A session or stream stepping alone runs on the event loop up to these costs: nobody waits,
# and the hops cost a served model's long-context message 0.1 ms hot and 0.3 ms after its
# weights evicted the caches (docs/design.md, "A lone session's long message on the loop").
# Past them a hop costs under a percent, and the loop stays free for keepalives, cancellations
# and new streams: a message whose session's previous one computed this long, a Decode step
# reading this many cache bytes (about 30 ms at 35 GB/s).
ALONE_MESSAGE_S = 0.1
ALONE_STEP_BYTES = 1 << 30
# The loop's batch of small Decode steps (Batcher.run_soon) reads at most this many times
# --inline-step-bytes of cache: the loop is held about as long as that many inline steps.
LOOP_BATCH_STEPS = 4


class Placement:
    """Sends each step to where it costs least; call on the event loop. ``--inline-step-bytes``
    (read from ``config`` at every step; 0 keeps every step off the loop) is the cache bytes a
    step may read on the loop."""

    def __init__(self, config: ServerConfig, batcher: Batcher):
        self.config = config
        self.batcher = batcher
        self._last = None  # the stream or Batch session of the last step placed, and when
        self._last_at = 0.0

    def message(self, job: PendingJob) -> bool:
        """Places a Batch message; True when it already ran here (``job.result`` is set): when
        its session's previous message was fast (beside any other work but its own session's),
        or when the session steps alone (nothing queued or computing) and its previous message
        computed in under ``ALONE_MESSAGE_S``."""
        sequences = job.stream
        alone = self._alone(sequences, job.received)  # Decode's steps see this message
        last = sequences.last_compute_ns
        if self.config.inline_step_bytes:
            if last is not None and last < INLINE_MESSAGE_S * 1e9 and self.batcher.run_message_inline(job):
                return True
            if alone and (last is None or last < ALONE_MESSAGE_S * 1e9) and self.batcher.run_inline(job):
                return True
        self.batcher.submit(job)
        return False

    def step(self, pending: PendingStep) -> int:
        """Places a Decode step: ``HERE`` when it already ran here (``pending.result`` is set),
        ``SOON`` in the loop's batch, ``QUEUED`` on the workers (``decide``, then
        ``Batcher.run_inline`` or ``elsewhere``)."""
        here, cost = self.decide(pending.stream, pending.cache, pending.received)
        if here and self.batcher.run_inline(pending):
            return HERE
        return self.elsewhere(pending, cost)

    def decide(self, stream, cache, received: float) -> tuple[bool, int]:
        """(at once, cost) for a Decode step of ``stream`` on ``cache`` received at
        ``received``, its cost the cache bytes it reads; recorded as the last step placed. A
        step runs at once when its stream steps alone (no other step queued or computing, no
        other stream's step within ``CONCURRENT_WINDOW_S``) and reads under
        ``ALONE_STEP_BYTES``, as a lone Batch session's message does, if the batcher then finds
        nothing queued or computing (``Batcher.run_inline``, ``Batcher.compute_here``); else
        ``elsewhere`` places it. The cost is -1 (not computed) for a step at once of a stream
        whose ``step_bytes_bound`` is under ``ALONE_STEP_BYTES``."""
        alone = self._alone(stream, received)
        if not self.config.inline_step_bytes:
            return False, 0
        if alone and stream.step_bytes_bound < ALONE_STEP_BYTES:
            return True, -1  # no step of the stream reads that much: its cost is not needed yet
        cost = (cache.resident_length + 1) * cache.row_bytes
        return alone and cost < ALONE_STEP_BYTES, cost

    def elsewhere(self, pending: PendingStep, cost: int) -> int:
        """Places a step that does not run at once: a small one (``cost`` under
        --inline-step-bytes) in the loop's batch at its next turn (at most ``LOOP_BATCH_STEPS``
        x --inline-step-bytes of cache a turn): ``SOON``; a larger one, or every step with
        --inline-step-bytes 0, on the workers: ``QUEUED``."""
        inline = self.config.inline_step_bytes
        if cost < 0:  # not computed by decide
            cache = pending.cache
            cost = (cache.resident_length + 1) * cache.row_bytes
        if cost < inline and self.batcher.run_soon(pending, cost, LOOP_BATCH_STEPS * inline):
            return SOON
        self.batcher.submit(pending)
        return QUEUED

    def _alone(self, owner: object, now: float) -> bool:
        """Whether ``owner`` (a stream or a Batch session) steps alone: the last step placed was
        its own, or no other came within ``CONCURRENT_WINDOW_S``; records this one as the last."""
        alone = self._last is owner or now - self._last_at > CONCURRENT_WINDOW_S
        self._last, self._last_at = owner, now
        return alone
