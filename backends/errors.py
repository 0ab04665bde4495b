"""Errors raised by backends and caches.

They carry no transport knowledge: the service maps each class to a status code in one place.
Bad shapes and dtypes are plain ``ValueError``/``TypeError`` (what a Python caller expects);
the classes below are the conditions that are not a caller's typo.
"""

from __future__ import annotations

__all__ = ["BackendUnavailable", "CacheFullError", "RollbackError"]


class BackendUnavailable(RuntimeError):
    """A backend cannot serve on this machine or for this configuration.

    ``reasons`` lists every reason, each prefixed with the backend's name, so that a caller can
    show them all at once ("cuda: no CUDA device; int8: head_dim 3 not supported").
    """

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons) or "backend unavailable")


class CacheFullError(RuntimeError):
    """Under policy ``none``, a step found no free row. The cache is unchanged."""


class RollbackError(RuntimeError):
    """A rollback that would not be exact. The cache is unchanged."""

    def __init__(self, message: str, reach: int):
        self.reach = reach
        super().__init__(message)
