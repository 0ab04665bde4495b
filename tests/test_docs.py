"""The documentation runs: every ```python, ```sh (```bash, ```shell) and ```js block of README.md
and docs/*.md, in document order, against a real server this module starts with the project's
own command line (``gqa-serve serve``), as a reader would paste it.

- A block runs alone: a Python block in a fresh interpreter, a shell block in ``bash -e -o
  pipefail``, a JavaScript block in ``node``. Each must be self-contained (imports included)
  and exit 0. The working directory is a scratch copy of the checkout's layout (links to its
  files, ``.venv`` linked to the running interpreter's environment), so what a block writes
  stays out of the checkout.
- The documented addresses are the test server's: ``127.0.0.1:50051`` (gRPC) and
  ``127.0.0.1:9464`` / ``localhost:9464`` (metrics) are replaced by the ports it listens on, so
  parallel runs never collide.
- A block that cannot run here says so in the markdown, on the line before its fence:
  ``<!-- doc-test: skip (why) -->`` skips it with that reason, and ``<!-- doc-test: needs A, B
  -->`` skips it unless each of A, B is a command on PATH or, with a ``/``, a path of the
  checkout (installed by ``make tools``). Any other ``doc-test`` comment fails the collection.

New markdown under docs/ is picked up with no change here.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from tests.metrics_load import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNERS = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh", "js": "js"}
DOC_GRPC = "127.0.0.1:50051"
DOC_METRICS = ("127.0.0.1:9464", "localhost:9464")
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"^```\s*([A-Za-z0-9_+-]*)\s*$")
_MARK = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$")
_DIRECTIVE = re.compile(r"^(skip)\s*\((.+)\)$|^(needs)\s+(.+)$")


@dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    directive: str  # the doc-test comment before the fence, or ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}-{self.lang}"


def parse(path: pathlib.Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of one markdown file, each with the doc-test comment just before it.
    A doc-test comment that no fence follows, or an unclosed fence, is an error."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i, pending = [], 0, None
    while i < len(lines):
        stripped = lines[i].strip()
        mark = _MARK.match(stripped)
        if mark:
            pending = (i + 1, mark.group(1))
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if fence:
            start = i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{path}:{start + 1}: the fence is never closed")
            directive = ""
            if pending is not None:
                if pending[0] != start:  # the comment must sit on the line right before the fence
                    raise ValueError(f"{path}:{pending[0]}: a doc-test comment must come right before a fence")
                directive = pending[1]
                if not _DIRECTIVE.match(directive):
                    raise ValueError(f"{path}:{pending[0]}: unknown doc-test comment {directive!r}")
                pending = None
            blocks.append(Block(path, start + 1, fence.group(1).lower(), "\n".join(body) + "\n", directive))
        elif stripped and pending is not None:
            raise ValueError(f"{path}:{pending[0]}: a doc-test comment must come right before a fence")
        i += 1
    if pending is not None:
        raise ValueError(f"{path}:{pending[0]}: a doc-test comment with no fence after it")
    return blocks


def runnable_blocks() -> list[Block]:
    return [b for path in DOCS for b in parse(path) if b.lang in RUNNERS]


def why_not(block: Block) -> str | None:
    """The reason this block is not run here, or None."""
    match = _DIRECTIVE.match(block.directive) if block.directive else None
    if match is None:
        return None
    if match.group(1):
        return f"{block.id}: {match.group(2)}"
    missing = []
    for need in (n.strip() for n in match.group(4).split(",")):
        found = (ROOT / need).exists() if "/" in need else shutil.which(need) is not None
        if not found:
            missing.append(need)
    if missing:
        return f"{block.id}: needs {', '.join(missing)} (run `make tools`)"
    return None


# -- the server the blocks talk to -----------------------------------------------------------------
@dataclass
class DocServer:
    address: str
    metrics: str
    workdir: pathlib.Path
    env: dict


def _ready(metrics: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{metrics}/readyz", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("docs")
    for entry in ROOT.iterdir():
        if entry.name not in (".venv", ".git"):
            (workdir / entry.name).symlink_to(entry)
    (workdir / ".venv").symlink_to(pathlib.Path(sys.prefix))
    # The documented defaults, whatever this shell's GQA_* settings say (a token, other limits).
    env = {k: v for k, v in os.environ.items() if not k.startswith("GQA_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    port, metrics_port = free_port(), free_port()
    address, metrics = f"127.0.0.1:{port}", f"127.0.0.1:{metrics_port}"
    entry = pathlib.Path(sys.executable).parent / "gqa-serve"
    command = [str(entry)] if entry.exists() else [sys.executable, "-m", "service.cli"]
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen(
        [*command, "serve", "--backend", "cpu", "--address", address, "--metrics-port", str(metrics_port)],
        env={**env, "GQA_GRACE_PERIOD_S": "1"},
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not _ready(metrics):
            assert proc.poll() is None, (workdir / "server.log").read_text()
            assert time.monotonic() < deadline, "the server did not become ready in 120 s"
            time.sleep(0.1)
        yield DocServer(address, metrics, workdir, env)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def localized(code: str, server: DocServer) -> str:
    code = code.replace(DOC_GRPC, server.address)
    for documented in DOC_METRICS:
        code = code.replace(documented, server.metrics)
    return code


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.id)
def test_doc_block_runs(block: Block, doc_server: DocServer):
    reason = why_not(block)
    if reason:
        pytest.skip(reason)
    code = localized(block.code, doc_server)
    runner = RUNNERS[block.lang]
    if runner == "python":
        script = doc_server.workdir / f"block_{block.line}.py"
        script.write_text(code)
        argv = [sys.executable, script.name]
    elif runner == "js":
        script = doc_server.workdir / f"block_{block.line}.js"
        script.write_text(code)
        argv = ["node", script.name]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    run = subprocess.run(
        argv, cwd=doc_server.workdir, env=doc_server.env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )
    assert run.returncode == 0, (
        f"{block.id} exited {run.returncode}\n--- block ---\n{code}--- stdout ---\n{run.stdout[-4000:]}"
        f"\n--- stderr ---\n{run.stderr[-4000:]}"
    )


# -- the harness itself ----------------------------------------------------------------------------
def test_every_doc_is_read_and_its_markers_parse():
    assert DOCS[0].name == "README.md" and len(DOCS) > 1
    blocks = runnable_blocks()
    assert {b.path.name for b in blocks} >= {"README.md", "clients.md"}
    assert any(b.lang == "python" for b in blocks) and any(b.lang == "sh" for b in blocks)
    # Every skip says why.
    for b in blocks:
        if b.directive.startswith("skip"):
            assert len(_DIRECTIVE.match(b.directive).group(2).strip()) > 5, b.id


@pytest.mark.parametrize(
    "text, error",
    [
        ("<!-- doc-test: skip (no) -->\n\ntext\n```sh\nls\n```\n", "right before a fence"),
        ("<!-- doc-test: later -->\n```sh\nls\n```\n", "unknown doc-test comment"),
        ("```sh\nls\n", "never closed"),
        ("<!-- doc-test: skip (why) -->\n", "no fence after it"),
    ],
    ids=["not-before-a-fence", "unknown-word", "unclosed", "dangling"],
)
def test_bad_markers_fail_the_collection(text, error):
    with pytest.raises(ValueError, match=error):
        parse(ROOT / "x.md", text)


def test_markers_attach_to_their_block(monkeypatch):
    text = (
        "intro\n```python\nprint(1)\n```\n"
        "<!-- doc-test: skip (needs a cluster) -->\n```sh\nkubectl get pods\n```\n"
        "<!-- doc-test: needs no-such-tool-here, tests/no/such/path -->\n```sh\nno-such-tool-here\n```\n"
    )
    first, skipped, needs = parse(ROOT / "x.md", text)
    assert (first.lang, first.code, first.directive, first.line) == ("python", "print(1)\n", "", 2)
    assert why_not(first) is None
    assert why_not(skipped) == "x.md:6-sh: needs a cluster"
    assert why_not(needs) == "x.md:10-sh: needs no-such-tool-here, tests/no/such/path (run `make tools`)"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not on PATH")
def test_make_run_installs_what_the_readme_commands_need():
    """The README runs `gqa-serve bench ... --plot` right after `make run`: make run's install
    (printed by a dry run, nothing executed) takes the loadgen extra, which brings matplotlib."""
    import tomllib

    dry = subprocess.run(["make", "-n", "-B", "run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    installs = [line for line in dry.stdout.splitlines() if "pip install" in line and " -e " in line]
    assert len(installs) == 1 and re.search(r"-e '\.\[loadgen[],]", installs[0]), dry.stdout
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("matplotlib") for req in extras["loadgen"])
    readme = (ROOT / "README.md").read_text()
    assert "--plot bench.png" in readme and "which `make run` installs" in readme
