"""What the engine's data plane reports: a step's record, the observer of plain stats, and the
one way an exception a step raised becomes a status.

Shared by the engine (``service.engine.engine``), the batcher (``service.engine.batcher``) and the Batch
session's data plane (``service.engine.plane``), so none of them imports another for these, and the
metrics (``service.metrics.recorder``) implement ``EngineObserver`` without importing the engine's
machinery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.contract import StepOutcome
from backends.errors import CacheFullError, InvalidInput

from ..errors import Internal, InvalidArgument, ResourceExhausted, ServiceError

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Stream

__all__ = ["StepReport", "EngineObserver", "classify_step_error"]

log = logging.getLogger("gqa.engine")

# (backend, dtype, policy): the labels a step is counted under
Labels = tuple[str, str, str]


@dataclass(frozen=True)
class StepReport:
    """What the servicer sends back for one Decode step."""

    outcome: StepOutcome
    compute_ns: int
    rollback_reach: int


class EngineObserver:
    """Receives plain stats; the default does nothing. ``service.metrics.recorder`` implements it.

    Steps are reported in bulk, per message and label set: ``steps_done`` counts ``n`` steps
    that succeeded with the same queue wait and compute time (a Decode step is n=1; a Batch
    message's sequences of one policy are one call), ``steps_refused`` ``n`` refused with one
    status code."""

    def stream_opened(self, stream: "Stream") -> None: ...

    def stream_closed(self, stream: "Stream", reason: str) -> None: ...

    def open_refused(self, reason: str) -> None: ...

    def steps_done(
        self,
        labels: Labels,
        n: int,
        queue_seconds: float,
        compute_seconds: float,
        evicted_tokens: int,
        evictions: int,
        bytes_written: int,
    ) -> None:
        """``n`` steps succeeded, each after ``queue_seconds`` waiting and ``compute_seconds``
        computing (the batched computation's time); together they evicted ``evicted_tokens``
        tokens in ``evictions`` steps and stored ``bytes_written`` bytes."""

    def steps_refused(self, labels: Labels, code: str, n: int = 1) -> None:
        """``n`` steps refused with status ``code`` (e.g. ``RESOURCE_EXHAUSTED``)."""

    def batch_done(self, backend: str, dtype: str, size: int) -> None:
        """One batched computation of ``size`` steps (of one kernel) finished."""

    def batch_message(self, backend: str, dtype: str, sequences: int) -> None:
        """A ``Batch`` RPC step message for ``sequences`` sequences was answered."""


def classify_step_error(exc: BaseException, where: str) -> ServiceError:
    """The status of an exception a step raised, by type: the backends' input errors
    (``backends.errors.InvalidInput``: shapes, dtypes, values a cache cannot store) ->
    INVALID_ARGUMENT, no room -> RESOURCE_EXHAUSTED, anything else (a plain ``ValueError``
    out of a computation included) INTERNAL, logged with its traceback."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, CacheFullError):
        return ResourceExhausted(str(exc))
    if isinstance(exc, InvalidInput):
        return InvalidArgument(str(exc))
    log.error("%s failed", where, exc_info=(type(exc), exc, exc.__traceback__))
    return Internal()
