"""Builds and runs the grpc.aio server: the attention service, health, reflection, reaper.

With ``config.metrics_port`` nonzero the server also records metrics (``service.metrics.recorder``): the
engine's observer, an outermost interceptor for the ``grpc_server_*`` families, and /metrics on
``config.host:metrics_port``, beside HTTP health and the status page (``service.metrics.pages``).
With 0 none of them exists, so metrics off costs nothing.

``Server`` owns one event loop's worth of state. ``run(config)`` serves until SIGTERM/SIGINT
and drains; ``ServerThread`` runs the same server on a background thread for in-process tests
and benchmarks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from backends import native

from .api import gqa_pb2, gqa_pb2_grpc
from .config import ServerConfig
from .engine.engine import Engine, EngineObserver
from .engine.tensors import tune_allocator
from .errors import Unavailable
from .metrics.pages import READY, pages
from .metrics.recorder import ObserverFanOut, ServiceMetrics
from .transport.security import BearerTokenInterceptor, load_token, server_credentials
from .transport.servicer import AttentionServicer
from .transport.statuses import SafeStatusInterceptor

__all__ = ["Server", "ServerThread", "run"]

log = logging.getLogger("gqa.server")

SERVICE_NAME = gqa_pb2.DESCRIPTOR.services_by_name["AttentionService"].full_name
# How long stop waits for the compute workers to answer their last batch and exit.
WORKER_JOIN_S = 10.0


class Server:
    """One gRPC server over one engine."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        clock: Callable[[], float] | None = None,
        observer: EngineObserver | None = None,
        interceptors: list | None = None,
    ):
        self.config = config
        # Authentication first, then the guard that keeps statuses safe to show; a metrics
        # interceptor goes outside both, so refused and failed RPCs are counted with their code.
        token = load_token(config)
        self.authenticates = token is not None
        interceptors = [
            *([BearerTokenInterceptor(token)] if token else []),
            SafeStatusInterceptor(),
            *(interceptors or []),
        ]
        self.metrics: ServiceMetrics | None = None
        if config.metrics_port:
            self.metrics = ServiceMetrics()
            observer = self.metrics.recorder if observer is None else ObserverFanOut(self.metrics.recorder, observer)
            # Outermost, so RPCs that inner interceptors refuse are counted too.
            interceptors.insert(0, self.metrics.interceptor)
            self.metrics.interceptor.initialize(gqa_pb2.DESCRIPTOR.services_by_name["AttentionService"])
        kwargs = {"clock": clock} if clock is not None else {}
        self.engine = Engine(config, observer=observer, **kwargs)
        if self.metrics is not None:
            self.metrics.bind(self.engine)
        torch.set_num_threads(config.torch_threads)
        tune_allocator()  # process-wide: per-message buffers from the heap, not fresh pages
        native.set_threads(config.kernel_pool_threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(config.compute_workers, thread_name_prefix="gqa-compute")
        self.engine.pool = self.pool
        self.health = health.aio.HealthServicer()
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        if config.max_connection_age_s > 0:
            # No max_connection_age_grace: a GOAWAY never cuts a stream that is already open.
            options.append(("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)))
        self.grpc = grpc.aio.server(options=options, interceptors=interceptors)
        self.servicer = AttentionServicer(self.engine, config, self.pool)
        gqa_pb2_grpc.add_AttentionServiceServicer_to_server(self.servicer, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)
        credentials = server_credentials(config)
        if credentials is None:
            self.port = self.grpc.add_insecure_port(config.address)
        else:
            self.port = self.grpc.add_secure_port(config.address, credentials)
        if not self.port:
            raise OSError(f"cannot bind {config.address}")
        # A plaintext port with health alone, for probes that cannot speak TLS (kubelet's grpc
        # probe): the same HealthServicer, so a drain shows NOT_SERVING on both ports.
        self.health_grpc: grpc.aio.Server | None = None
        self.health_port = 0
        if config.health_port:
            self.health_grpc = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_grpc)
            health_address = f"{config.host}:{config.health_port}"
            self.health_port = self.health_grpc.add_insecure_port(health_address)
            if not self.health_port:
                raise OSError(f"cannot bind {health_address} (--health-port / GQA_HEALTH_PORT)")
        self._reaper: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        # What /readyz answers: READY exactly while the health service says SERVING for the
        # attention service. It turns READY after that status is set and leaves READY before
        # the drain changes it, so HTTP never says ready while gRPC health does not.
        self._readiness = "NOT_SERVING (starting)"
        self.drain_summary: str | None = None

    def readiness(self) -> str:
        """``metrics.pages.READY`` while the gRPC health status is SERVING, else why not."""
        return self._readiness

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def metrics_address(self) -> str | None:
        """host:port of /metrics while it is served, else None."""
        http = self.metrics.http if self.metrics is not None else None
        return f"{self.config.metrics_bind_host}:{http.port}" if http is not None else None

    async def start(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics.start_http(
                    self.config.metrics_bind_host, self.config.metrics_port, routes=pages(self.readiness)
                )
            except OSError as exc:
                raise OSError(
                    f"cannot serve metrics on {self.config.metrics_bind_host}:{self.config.metrics_port}: {exc} "
                    "(--metrics-port / GQA_METRICS_PORT; 0 turns metrics off)"
                ) from None
        # Probe the backends before reporting SERVING: the first probe imports optional modules.
        await self.servicer.backend_infos()
        await self.grpc.start()
        if self.health_grpc is not None:
            await self.health_grpc.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._readiness = READY
        self._reaper = asyncio.create_task(self._reap_forever())
        log.info(
            "gqa-serve listening on %s (backend %s, dtype %s, cache budget %d bytes = %.2f GiB, %s%s)",
            self.address,
            self.config.backend,
            self.config.dtype,
            self.config.max_cache_bytes,
            self.config.max_cache_bytes / (1 << 30),
            "mutual TLS" if self.config.tls_client_ca_file else "TLS" if self.config.tls else "plaintext",
            ", bearer token required" if self.authenticates else "",
        )

    async def _reap_forever(self) -> None:
        period = min(5.0, max(0.05, self.config.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for stream in self.engine.reap_idle():
                log.info("stream %s idle: freed %d bytes", stream.id, stream.bytes_reserved)

    async def drain(self) -> None:
        """SIGTERM: NOT_SERVING, refuse new streams, finish steps, end streams after the grace."""
        log.info("draining: grace period %.1f s", self.config.grace_period_s)
        started = time.monotonic()
        open_at_start = self.engine.active_streams
        self._readiness = "NOT_SERVING (draining)"
        self.engine.start_draining()
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.grace_period_s
        while self.engine.active_streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        cut = self.engine.active_streams
        self.engine.close_all(
            Unavailable("the server is shutting down; reopen the stream on another replica"), "shutdown"
        )
        # A step being computed finishes and its reply goes out before its RPC ends (a stuck
        # write is cut by the session after its grace), so no RPC is left for stop to cancel.
        await self.servicer.sessions_ended()
        await self.stop(grace=min(1.0, self.config.grace_period_s) or None)
        took = f"drained in {time.monotonic() - started:.1f} s"
        self.drain_summary = (
            f"{took}: of {open_at_start} streams open at the signal, {open_at_start - cut} ended within the "
            f"grace period and {cut} with UNAVAILABLE after it"
            if open_at_start
            else f"{took}: no stream was open"
        )

    async def stop(self, grace: float | None = None) -> None:
        self._readiness = "NOT_SERVING (stopped)" if self._readiness == READY else self._readiness
        if self._reaper is not None:
            self._reaper.cancel()
        await self.grpc.stop(grace)
        if self.health_grpc is not None:
            await self.health_grpc.stop(None)
        self.pool.shutdown(wait=False, cancel_futures=True)
        # Joined off the loop: a worker hands its last batch's replies back to this loop.
        if not await asyncio.to_thread(self.engine.stop, WORKER_JOIN_S):
            log.warning("compute workers still running %.0f s after stop", WORKER_JOIN_S)
        if self.metrics is not None:
            self.metrics.stop_http()
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def _run(config: ServerConfig) -> None:
    server = Server(config)
    await server.start()
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_signal(signame: str) -> None:
        if draining:  # a second signal (Ctrl-C twice): no grace, end every stream now
            if len(draining) == 1:
                log.warning("received %s again: stopping now", signame)
                draining.append(asyncio.ensure_future(server.stop(0)))
            return
        log.info("received %s", signame)
        draining.append(asyncio.ensure_future(server.drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    print(f"gqa-serve: serving gqa.v1 on {server.address}", flush=True)
    if server.metrics_address:
        http = f"http://{server.metrics_address}"
        print(f"gqa-serve: metrics on {http}/metrics, status page {http}/, health {http}/readyz", flush=True)
    await server.wait()
    log.info("gqa-serve stopped: %s", server.drain_summary or "stopped without a drain (a second signal)")


def run(config: ServerConfig) -> int:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run(config))
    return 0


class ServerThread:
    """A server on a background thread and event loop (for tests and benchmarks)."""

    def __init__(self, config: ServerConfig, **server_kwargs):
        self._config = config
        self._kwargs = server_kwargs
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: Server | None = None
        self._thread = threading.Thread(target=self._main, name="gqa-server", daemon=True)

    def _main(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_until_complete(self.server.wait())
        self.loop.close()

    async def _start(self) -> None:
        self.server = Server(self._config, **self._kwargs)
        await self.server.start()

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def engine(self) -> Engine:
        return self.server.engine

    def call(self, coro, timeout: float = 30):
        """Runs a coroutine on the server's loop and waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        # A server that drained has stopped itself; its loop may be closing already.
        if self.server is not None and self._thread.is_alive() and not self.server.stopped:
            self.call(self.server.stop(0))
        self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
