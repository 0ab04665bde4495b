"""Backend names mapped to lazy import paths.

CUDA-only code is never imported until its backend is asked for, so ``import backends`` works
on any machine; an unusable backend is reported with every reason, never by a failed import at
start-up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import BackendUnavailable

if TYPE_CHECKING:  # names only: importing the registry imports no torch (the command line's flags)
    from .contract import Backend, Capabilities

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "BackendInfo", "describe", "get_backend"]

BACKENDS: dict[str, str] = {
    "cpu": "backends.cpu:CPUBackend",
    "int8": "backends.int8:Int8Backend",
    "cuda": "backends.cuda:CUDABackend",
}
DEFAULT_BACKEND = "cpu"

_instances: dict[str, Backend] = {}


@dataclass(frozen=True)
class BackendInfo:
    name: str
    available: bool
    reasons: list[str] = field(default_factory=list)
    capabilities: Capabilities | None = None


def _load(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise BackendUnavailable([f"{name}: unknown backend (known: {', '.join(sorted(BACKENDS))})"])
    module_name, _, attr = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # an optional dependency is missing
        raise BackendUnavailable([f"{name}: cannot import {module_name} ({exc})"]) from None
    return getattr(module, attr)


def get_backend(name: str) -> Backend:
    """The backend called ``name``, or ``BackendUnavailable`` listing why not."""
    if name in _instances:
        return _instances[name]
    cls = _load(name)
    reasons = cls.probe()
    if reasons:
        raise BackendUnavailable(reasons)
    _instances[name] = backend = cls()
    backend.__dict__["_probed"] = reasons  # probed once per process: see Backend.probe_reasons
    return backend


def describe() -> list[BackendInfo]:
    """Every known backend with its capabilities, or the reasons it is unavailable here."""
    infos = []
    for name in BACKENDS:
        try:
            cls = _load(name)
        except BackendUnavailable as exc:
            infos.append(BackendInfo(name, False, exc.reasons))
            continue
        reasons = cls.probe()
        infos.append(BackendInfo(name, not reasons, reasons, cls.capabilities))
    return infos
