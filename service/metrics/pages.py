"""The pages of the metrics listener beside ``/metrics``: HTTP health and the status page.

- ``/healthz`` and ``/v2/health/live`` (liveness): 200 while the process serves this listener,
  draining included; a process that is gone answers nothing.
- ``/readyz`` and ``/v2/health/ready`` (readiness): 200 exactly while the gRPC health service
  reports ``gqa.v1.AttentionService`` SERVING (backends probed, not draining), else 503. The
  body names the state: ``SERVING``, ``NOT_SERVING (starting)``, ``NOT_SERVING (draining)``,
  ``NOT_SERVING (stopped)``. The ``/v2/health/*`` pair are the paths of the KServe/Triton
  inference protocol, for tools that probe those.
- ``/`` (and ``/status``): one self-contained HTML page (``status_page.html``: inline CSS and
  script, no external request) that reads ``/metrics`` every few seconds and draws what the
  server holds and does now and over the last minutes.

Each answer is built from state read at once: these run on the listener's single thread.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from .listener import Route

__all__ = ["READY", "health_routes", "status_page", "pages"]

READY = "SERVING"
TEXT = "text/plain; charset=utf-8"


def health_routes(state: Callable[[], str]) -> dict[str, Route]:
    """Liveness and readiness; ``state()`` is the server's readiness, ``READY`` or why not."""

    def live() -> tuple[int, bytes, str]:
        return 200, b"ok\n", TEXT

    def ready() -> tuple[int, bytes, str]:
        now = state()
        return (200 if now == READY else 503), f"{now}\n".encode(), TEXT

    return {"/healthz": live, "/v2/health/live": live, "/readyz": ready, "/v2/health/ready": ready}


def status_page() -> bytes:
    """The status page's HTML (package data)."""
    return resources.files(__package__).joinpath("status_page.html").read_bytes()


def pages(state: Callable[[], str]) -> dict[str, Route]:
    """Every route of the listener beside /metrics."""
    html = status_page()

    def page() -> tuple[int, bytes, str]:
        return 200, html, "text/html; charset=utf-8"

    return {**health_routes(state), "/": page, "/status": page}
