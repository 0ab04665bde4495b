"""Errors raised by backends and caches.

They carry no transport knowledge: the service maps each class to a status code in one place.
A caller's bad input (shapes, dtypes, devices, values a cache cannot store) raises
``InputValueError`` or ``InputTypeError``: subclasses of ``ValueError``/``TypeError`` (what a
Python caller expects) and of ``InvalidInput``, which the service maps to INVALID_ARGUMENT by
type. A plain ``ValueError``/``TypeError`` out of a backend's computation is a fault of ours.
The other classes below are the conditions that are not a caller's typo.
"""

from __future__ import annotations

__all__ = ["BackendUnavailable", "CacheFullError", "InputTypeError", "InputValueError", "InvalidInput", "RollbackError"]


class InvalidInput(Exception):
    """Base of the input errors: the caller's tensors (or values) cannot be taken; nothing was
    written. Never raised itself: catch it, raise ``InputValueError``/``InputTypeError``."""


class InputValueError(InvalidInput, ValueError):
    """A bad shape, device or value in the caller's input."""


class InputTypeError(InvalidInput, TypeError):
    """A bad type or dtype in the caller's input."""


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
