"""The architecture, held: which folder may import which, written down once (issue #26).

Every product module is read with ``ast`` (lazy imports inside functions and imports for type
annotations included: an upward arrow is one even when it is only a type), each import resolved
to the component it lands in and checked against ``ALLOWED``. The README's "Code map" names the
same folders. A new folder fails ``test_every_module_has_a_component`` until it is given a row
here, so the table cannot fall behind the tree.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent

# component -> the components it may import (besides itself). Read top-down: nothing points up.
ALLOWED: dict[str, set[str]] = {
    "service.cli": {"service.server", "service.shared", "backends", "gqa_client"},
    "service.server": {"service.transport", "service.engine", "service.metrics", "service.shared", "backends"},
    # metrics observe the engine and wrap the transport; only the composition root imports them
    "service.metrics": {"service.engine", "service.transport", "service.shared"},
    # the transport talks to the engine only: never to backends, which the engine owns
    "service.transport": {"service.engine", "service.shared"},
    "service.engine": {"service.shared", "backends"},
    # config, vocab, errors, api and the package's version: names every folder shares
    "service.shared": {"backends"},
    "backends": {"quant"},
    "quant": set(),
    # the Python client is its own distribution: nothing of the server
    "gqa_client": set(),
}
# third-party packages a component must not import: gRPC and Prometheus stay at the edges
FORBIDDEN_THIRD_PARTY: dict[str, set[str]] = {
    "service.engine": {"grpc", "prometheus_client"},
    "backends": {"grpc", "google", "prometheus_client"},
    "quant": {"grpc", "google", "prometheus_client"},
    "gqa_client": {"prometheus_client"},
}
SERVICE_FOLDERS = ("cli", "metrics", "transport", "engine")


class Module(NamedTuple):
    name: str  # dotted, e.g. service.engine.batcher (a package: its own name)
    is_package: bool
    source: str


def component(name: str) -> str | None:
    """The component a dotted module name belongs to (None: not ours)."""
    parts = name.split(".")
    if parts[0] == "service":
        if len(parts) > 1 and parts[1] in SERVICE_FOLDERS:
            return f"service.{parts[1]}"
        if len(parts) > 1 and parts[1] == "server":
            return "service.server"
        return "service.shared"
    return parts[0] if parts[0] in ("backends", "quant", "gqa_client") else None


def product_modules() -> list[Module]:
    """Every product module (generated protobuf code left out)."""
    found = []
    for base, top in (
        (ROOT, "service"),
        (ROOT, "backends"),
        (ROOT, "quant"),
        (ROOT / "clients" / "python", "gqa_client"),
    ):
        for path in sorted((base / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            found.append(Module(".".join(parts), is_package, path.read_text()))
    return found


def imports_of(module: Module, tree: ast.AST | None = None, *, members: bool = False) -> set[str]:
    """The absolute names of the modules a module imports, relative imports resolved; with
    ``members``, also ``pkg.a`` for each ``from pkg import a`` (a may be a submodule)."""
    names = set()
    own = module.name.split(".")
    package = own if module.is_package else own[:-1]
    for node in ast.walk(tree or ast.parse(module.source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names.add(target)
            if members or not node.module:  # from . import a, b: a and b are modules
                names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def violations(modules: list[Module]) -> list[str]:
    """Each import that breaks the table, as 'importer -> imported'."""
    found = []
    for module in modules:
        mine = component(module.name)
        for name in sorted(imports_of(module)):
            theirs = component(name)
            if name.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(mine, ()):
                found.append(f"{module.name} -> {name} (forbidden here)")
            elif theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
                found.append(f"{module.name} -> {name}")
    return found


def test_the_table_points_one_way():
    try:
        list(TopologicalSorter(ALLOWED).static_order())
    except CycleError as error:
        pytest.fail(f"the allowed imports form a cycle: {error.args[1]}")


def test_every_module_has_a_component():
    modules = product_modules()
    assert len(modules) > 50
    assert {m.name for m in modules if component(m.name) not in ALLOWED} == set()


def test_no_import_breaks_the_table():
    assert violations(product_modules()) == []


def test_the_check_catches_upward_lazy_and_third_party_arrows():
    planted = [
        Module("service.engine.fake", False, "from ..transport import wire\n"),
        Module("service.engine.lazy", False, "def f():\n    from service.metrics.recorder import ServiceMetrics\n"),
        Module("service.transport.fake", False, "from backends.plane import CacheSet\n"),
        Module("service.engine.rpc", False, "import grpc\n"),
        Module("gqa_client.fake", False, "from service.engine import engine\n"),
        Module("service.transport", True, "from ..engine import report\nfrom . import wire\n"),
    ]
    assert violations(planted) == [
        "service.engine.fake -> service.transport",
        "service.engine.lazy -> service.metrics.recorder",
        "service.transport.fake -> backends.plane",
        "service.engine.rpc -> grpc (forbidden here)",
        "gqa_client.fake -> service.engine",
    ]


def test_no_module_level_import_cycle():
    """Loading a module never needs itself: the graph of top-level imports is acyclic (a lazy
    import inside a function, or one for annotations only, may point back within a folder)."""
    modules = product_modules()
    known = {m.name for m in modules}
    graph = {}
    for module in modules:
        tree = ast.parse(module.source)
        tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[module.name] = {n for n in imports_of(module, tree, members=True) if n in known and n != module.name}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as error:
        pytest.fail(f"module-level import cycle: {error.args[1]}")
