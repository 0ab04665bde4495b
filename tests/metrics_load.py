"""A bounded stream load for the metrics tests and benchmark: what the client saw, to compare;
and what the tests that run servers share: a free port, ``gqa-serve serve`` in a process of
its own, a gauge read from its /metrics.

Every loop here is bounded in count and in time.
"""

from __future__ import annotations

import pathlib
import random
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
import torch

from service.api import gqa_pb2, gqa_pb2_grpc
from service.engine.tensors import to_proto
from service.vocab import POLICY_ENUMS, TORCH_TO_DTYPE


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_FLOOR = _ephemeral_floor()
_pick = random.Random()  # seeded from the OS: processes running at once pick apart


def free_port() -> int:
    """A loopback port that is free now, below the kernel's ephemeral range when there is room:
    between this call and the server's bind, no outgoing connection (this process's clients, a
    scraper) can be given it as its local port, which a port the kernel chose (port 0, in that
    range) could be (CI saw EADDRINUSE once that way). The kernel's choice when 50 tries below
    the range all find a port taken."""
    if _EPHEMERAL_FLOOR > 10_000:
        for _ in range(50):
            port = _pick.randrange(10_000, _EPHEMERAL_FLOOR)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = pathlib.Path(__file__).resolve().parents[1]


class ServeProcess:
    """``gqa-serve serve`` in a process of its own, as deployed: gRPC on the loopback port it
    picks and reports (``wait_serving``), metrics on a free port (``metrics_port``), its stderr
    in ``log_path``. ``command``: how to run the command line (default: this interpreter's
    ``-m service.cli`` from the checkout)."""

    def __init__(self, log_path: pathlib.Path, *flags: str, env: dict | None = None, command: list | None = None):
        self.log_path = log_path
        self.metrics_port = free_port()
        self.port: int | None = None
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "service.cli"]), "serve", "--address", "127.0.0.1:0"]
            + ["--metrics-port", str(self.metrics_port), *flags],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )

    def wait_serving(self, deadline: float) -> None:
        """Until the server reports its port (``deadline``: ``time.monotonic()``); else
        ``AssertionError`` with the end of its log."""
        line = b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 0.2)[0]:
                line = self.proc.stdout.readline()
                if b"serving gqa.v1 on" in line:
                    self.port = int(line.rsplit(b":", 1)[1])
                    return
        raise AssertionError(f"{self.log_path.name}: the server did not start ({line!r}):\n{self.log()}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def close(self, *, kill: bool = False) -> None:
        """Stops the server: SIGTERM and up to 30 s for its drain, or at once with ``kill``."""
        try:
            if self.proc.poll() is None:
                if kill:
                    self.proc.kill()
                else:
                    self.proc.terminate()
            self.proc.wait(10 if kill else 30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.proc.stdout.close()
            self._log.close()


def gauge(port: int, name: str) -> float:
    """A gauge's value, summed over its labels, from the /metrics of the server whose metrics
    port on loopback is ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


@dataclass(frozen=True)
class Shape:
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    layers: int = 1


@dataclass
class StreamResult:
    """What one Decode stream's client observed."""

    ok_steps: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    evicted_tokens: int = 0
    eviction_events: int = 0
    code: grpc.StatusCode | None = None
    seconds: float = 0.0


def open_request(
    policy: str = "strict",
    window: int = 8,
    shape: Shape = Shape(),
    *,
    capacity: int = 0,
    sinks: int = 0,
    dtype: torch.dtype = torch.float32,
) -> gqa_pb2.DecodeRequest:
    return gqa_pb2.DecodeRequest(
        request_id=0,
        open=gqa_pb2.OpenStream(
            dtype=TORCH_TO_DTYPE[dtype],
            batch_size=1,
            num_query_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            num_layers=shape.layers,
            policy=POLICY_ENUMS[policy],
            window=window,
            capacity=capacity,
            sink_tokens=sinks,
        ),
    )


def step_requests(
    shape: Shape, count: int, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[gqa_pb2.DecodeRequest]:
    """``count`` valid steps of ``dtype`` (the stream's), built ahead so the client spends no time
    making tensors."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        out.append(
            gqa_pb2.DecodeRequest(
                request_id=i + 1,
                step=gqa_pb2.Step(
                    layer=i % shape.layers,
                    query=to_proto(torch.randn(1, shape.heads, shape.head_dim, generator=g).to(dtype)),
                    new_key=to_proto(torch.randn(1, shape.kv_heads, shape.head_dim, generator=g).to(dtype)),
                    new_value=to_proto(torch.randn(1, shape.kv_heads, shape.head_dim, generator=g).to(dtype)),
                ),
            )
        )
    return out


def run_stream(
    address: str,
    open_req: gqa_pb2.DecodeRequest,
    steps: list[gqa_pb2.DecodeRequest],
    *,
    pace_s: float = 0.0,
    hold: threading.Event | None = None,
    hold_timeout_s: float = 20.0,
    opened: threading.Event | None = None,
    timeout_s: float = 60.0,
) -> StreamResult:
    """Opens a stream, sends ``steps`` (pipelined, or one per ``pace_s``), then waits for
    ``hold`` (at most ``hold_timeout_s``) and half-closes. Returns what the responses said."""
    result = StreamResult()

    def requests():
        yield open_req
        for i, request in enumerate(steps):
            if pace_s and i:
                if hold is None:
                    time.sleep(pace_s)
                elif not hold.is_set():
                    hold.wait(pace_s)  # once released, the rest go out unpaced
            yield request
        if hold is not None:
            hold.wait(hold_timeout_s)

    t0 = time.perf_counter()
    with grpc.insecure_channel(address) as channel:
        stub = gqa_pb2_grpc.AttentionServiceStub(channel)
        call = stub.Decode(requests(), timeout=timeout_s)
        try:
            for response in call:
                kind = response.WhichOneof("kind")
                if kind == "opened":
                    if opened is not None:
                        opened.set()
                elif kind == "step":
                    step = response.step
                    if step.status.code:
                        name = grpc.StatusCode(_code_tuple(step.status.code)).name
                        result.refused[name] = result.refused.get(name, 0) + 1
                    else:
                        result.ok_steps += 1
                        result.evicted_tokens += step.evicted_tokens
                        result.eviction_events += int(step.evicted_tokens > 0)
            result.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            result.code = exc.code()
    result.seconds = time.perf_counter() - t0
    return result


def _code_tuple(number: int):
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code.value
    raise ValueError(number)
