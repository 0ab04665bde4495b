"""The service's layering (issue 23): the transport talks to the engine only, and the engine's
modules import one another one way.

Read from the sources' import statements (``ast``), a lazy import inside a function included;
imports for type annotations only (``if TYPE_CHECKING:``) do not load anything and are left out
of the cycle check, not of the backends check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parent.parent / "service"
TRANSPORT = ("servicer", "batch_rpc", "batch_session", "batch_reply", "decode_step", "session", "statuses")


def _imports(module: str, *, typing_too: bool = True) -> set[str]:
    """Every module ``service/<module>.py`` imports, as absolute names (``service.x``, ``backends.y``)."""
    tree = ast.parse((SERVICE / f"{module}.py").read_text())
    if not typing_too:
        tree.body = [
            n for n in tree.body if not (isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
        ]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "service" + (f".{node.module}" if node.module else "")
                names.add(base)
                if not node.module:
                    names.update(f"service.{alias.name}" for alias in node.names)
            else:
                names.add(node.module or "")
    return names


@pytest.mark.parametrize("module", TRANSPORT)
def test_the_transport_does_not_import_backends(module):
    assert not {n for n in _imports(module) if n == "backends" or n.startswith("backends.")}


def test_no_import_cycle_among_the_engine_modules():
    """engine -> batcher, plane, report; none of them back to the engine."""
    for module in ("batcher", "plane", "report", "stream", "stateless"):
        assert "service.engine" not in _imports(module, typing_too=False), module
    assert {"service.batcher", "service.plane", "service.report"} <= _imports("engine")
