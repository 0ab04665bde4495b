"""Faults: random cancellations, clients that vanish, a backend that fails mid-step, unknown
exceptions in handlers. (The budget refusal while streams run is `test_service.py`'s
`test_budget_and_stream_limits`; the SIGTERM drain is `test_cli.py`'s `test_sigterm_drains`.)
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap

import grpc
import pytest
import torch

from service.api import gqa_pb2, gqa_pb2_grpc
from service.config import ServerConfig
from service.server import ServerThread
from tests.client import Session, open_message, step_request, wait_until
from tests.test_cli import free_port

BASE = ServerConfig(address="127.0.0.1:0", metrics_port=0, idle_timeout_s=3600.0)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _x(g):
    return torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 8, generator=g), torch.randn(1, 2, 8, generator=g)


def _zero(srv) -> bool:
    e = srv.engine
    return e.active_streams == 0 and e.bytes_reserved == 0 and e.bytes_in_use() == 0


def test_100_random_cancellations_free_every_byte():
    rng = random.Random(100)
    g = torch.Generator().manual_seed(100)
    config = dataclasses.replace(BASE, metrics_port=free_port())
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as ch:
        m = srv.server.metrics
        faults = {"after_reply": 0, "step_in_flight": 0, "right_after_open": 0}
        for _ in range(100):
            session = Session(ch, open_message(layers=rng.randint(1, 3), policy="greedy", window=8, capacity=12))
            for _ in range(rng.randint(0, 12)):
                session.step(0, *_x(g))
            point = rng.choice(list(faults))
            if point == "step_in_flight":
                session.send(step_request(999, 0, *_x(g)))
            faults[point] += 1
            session.cancel()
        assert sum(faults.values()) == 100
        assert wait_until(lambda: _zero(srv), timeout=20), (srv.engine.active_streams, srv.engine.bytes_reserved)
        assert m.value("gqa_cache_reserved_bytes") == 0 and m.value("gqa_cache_in_use_bytes") == 0
        assert (
            sum(
                s.value
                for metric in m.registry.collect()
                if metric.name == "gqa_active_streams"
                for s in metric.samples
            )
            == 0
        )
        # Still serving.
        session = Session(ch, open_message())
        assert session.step(0, *_x(g)).step.status.code == 0
        session.close()


CLIENT = textwrap.dedent("""
    import sys, time, grpc, torch
    from tests.client import Session, open_message
    ch = grpc.insecure_channel(sys.argv[1])
    s = Session(ch, open_message(layers=2, policy="strict", window=16))
    s.step(0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    print("stepping", flush=True)
    time.sleep(600)
""")


def _client(address):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, address], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "stepping"
    return proc


def test_a_killed_client_is_reclaimed():
    with ServerThread(BASE) as srv:
        proc = _client(srv.address)
        assert srv.engine.active_streams == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: _zero(srv), timeout=20)  # the connection dropped: cancelled


def test_a_frozen_client_is_reclaimed_by_the_idle_timeout():
    """A client that stops talking but keeps its connection (SIGSTOP): only the idle timeout
    can free it."""
    with ServerThread(dataclasses.replace(BASE, idle_timeout_s=1.0)) as srv:
        proc = _client(srv.address)
        try:
            proc.send_signal(signal.SIGSTOP)
            assert srv.engine.active_streams == 1
            assert wait_until(lambda: _zero(srv), timeout=20)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def test_backend_failure_mid_step_is_internal_and_changes_nothing(monkeypatch):
    g = torch.Generator().manual_seed(4)
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address) as ch:
        msg = open_message(layers=1, policy="greedy", window=4, capacity=6)
        victim, twin = Session(ch, msg), Session(ch, msg)
        for _ in range(9):  # past the window, so the failing write lands on a used row
            x = _x(g)
            victim.step(0, *x), twin.step(0, *x)
        cache = next(s for s in srv.engine.streams() if s.id == victim.opened.stream_id).caches[0]
        before = cache.tokens_seen, *cache.export()

        def boom(*args, **kwargs):
            raise RuntimeError(f"kernel failed in {ROOT}/backends/cpu.py")

        # after the row is written, in either compute path: torch's attention, or the compiled
        # step's injected failure (the kernel restores the row itself)
        monkeypatch.setattr(cache, "_attend", boom)
        monkeypatch.setattr(cache, "_fail_after_write", True, raising=False)
        reply = victim.step(0, *_x(g))
        assert reply.step.status.code == grpc.StatusCode.INTERNAL.value[0]
        assert ROOT not in reply.step.status.message and "Traceback" not in reply.step.status.message
        after = cache.tokens_seen, *cache.export()
        assert before[0] == after[0] and torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
        monkeypatch.undo()
        x = _x(g)
        assert torch.equal(victim.output(victim.step(0, *x)), twin.output(twin.step(0, *x)))
        victim.close(), twin.close()


def test_unknown_exceptions_become_a_fixed_internal_status(monkeypatch):
    with ServerThread(BASE) as srv, grpc.insecure_channel(srv.address) as ch:

        def boom():
            raise RuntimeError(f"{ROOT}/service/engine/engine.py: secret state")

        monkeypatch.setattr(srv.engine, "bytes_in_use", boom)
        with pytest.raises(grpc.RpcError) as info:
            gqa_pb2_grpc.AttentionServiceStub(ch).GetServerInfo(gqa_pb2.GetServerInfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details() == "internal error"


def test_read_ahead_stops_at_max_queued_steps(monkeypatch):
    """While a step computes, the server reads at most ``max_queued_steps`` more requests of
    that stream; the rest wait in the transport (HTTP/2 flow control)."""
    import threading

    from backends import batch_bytes
    from service.engine.engine import Stream

    release = threading.Event()
    touched: list[int] = []
    original_step, original_touch = batch_bytes.step_bytes, Stream.touch

    def slow_step(steps):
        release.wait(30)
        return original_step(steps)

    def counting_touch(self, now):
        touched.append(1)
        original_touch(self, now)

    monkeypatch.setattr(batch_bytes, "step_bytes", slow_step)
    monkeypatch.setattr(Stream, "touch", counting_touch)
    config = ServerConfig(
        address="127.0.0.1:0", metrics_port=0, max_queued_steps=2, inline_step_bytes=0
    )  # steps on a worker, so the loop stays free to read
    with ServerThread(config) as srv, grpc.insecure_channel(srv.address) as channel:
        session = Session(channel, open_message())
        for rid in range(1, 11):
            session.send(step_request(rid, 0, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)))
        # One request computing, two queued behind it: three read, however long we wait.
        assert wait_until(lambda: len(touched) >= 3, timeout=10)
        assert not wait_until(lambda: len(touched) > 3, timeout=1.0)
        release.set()
        replies = [session.recv() for _ in range(10)]
        assert [r.request_id for r in replies] == list(range(1, 11))
        assert all(r.step.status.code == 0 for r in replies)
        session.close()
