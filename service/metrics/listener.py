"""The /metrics HTTP endpoint: one thread, a bounded number of connections, deadlines.

prometheus_client's ``start_http_server`` starts a thread per connection and waits on an idle
one forever: a few hundred half-open connections pinned a few hundred threads. Here one thread
multiplexes every connection with ``selectors``:

- at most ``max_connections`` are held; a new one past that pushes out the oldest connection
  still sending its request, so idle or slow connections cannot lock a scraper out;
- a connection has ``timeout_s`` to send its request and take the answer, then it is closed;
- a request head larger than ``MAX_REQUEST_BYTES`` is refused (431);
- every answer closes its connection (``Connection: close``): Prometheus reconnects per scrape.

It serves ``GET /metrics`` in the format the ``Accept`` header asks for, gzip when offered,
and any further ``routes`` the owner hands it (path -> a function answering ``(status, body,
content type)``: the server's health endpoints and status page); ``HEAD`` alike, 404 for other
paths and 405 for other methods. A route runs on this one thread, so it must answer at once
from state it reads, never wait. It has no authentication: bind it to a private address
(``--metrics-host``) or restrict it with a NetworkPolicy (the Helm chart's ``networkPolicy``).
"""

from __future__ import annotations

import gzip
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["MetricsHttpServer", "Route", "serve_http", "MAX_CONNECTIONS", "TIMEOUT_S", "MAX_REQUEST_BYTES"]

# A page beside /metrics: called on the listener's thread, answers (status, body, content type).
Route = Callable[[], tuple[int, bytes, str]]

MAX_CONNECTIONS = 64
TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 16 * 1024
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    deadline: float
    request: bytearray = field(default_factory=bytearray)
    response: memoryview | None = None


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    extra: tuple[tuple[str, str], ...] = (),
    head: bool = False,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in extra),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)


class MetricsHttpServer:
    """Serves a registry on one thread; ``close()`` stops it and frees the port."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = TIMEOUT_S,
        routes: Mapping[str, Route] | None = None,
    ):
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.registry = registry
        self.routes = dict(routes or {})
        self.host = host
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        bind = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((bind, port))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        # Oldest first: the connection pushed out when a new one arrives at the limit.
        self._connections: OrderedDict[socket.socket, _Connection] = OrderedDict()
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="gqa-metrics-http", daemon=True)
        self.thread.start()

    @property
    def connections(self) -> int:
        """Connections held now (for tests)."""
        return len(self._connections)

    # -- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            timeout = None
            if self._connections:
                timeout = max(0.0, min(c.deadline for c in self._connections.values()) - time.monotonic())
            for key, mask in self._selector.select(timeout):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_r:
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                else:
                    conn = self._connections.get(sock)
                    if conn is None:
                        continue
                    if mask & selectors.EVENT_READ and conn.response is None:
                        self._read(conn)
                    elif mask & selectors.EVENT_WRITE and conn.response is not None:
                        self._write(conn)
            now = time.monotonic()
            for conn in [c for c in self._connections.values() if c.deadline <= now]:
                self._drop(conn)
        for conn in list(self._connections.values()):
            self._drop(conn)

    def _accept(self) -> None:
        for _ in range(self.max_connections):  # drain the backlog, a bounded amount per turn
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            while len(self._connections) >= self.max_connections:
                self._drop(self._oldest_idle())
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + self.timeout_s)
            self._connections[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _oldest_idle(self) -> _Connection:
        # One still sending its request (an idle or slow client) goes first; one being answered
        # only if every held connection is being answered.
        for conn in self._connections.values():
            if conn.response is None:
                return conn
        return next(iter(self._connections.values()))

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        conn.request += data
        end = conn.request.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.request) > MAX_REQUEST_BYTES:
                self._respond(conn, _response(431, b"request head too large\n"))
            return
        self._respond(conn, self._answer(bytes(conn.request[:end])))

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, b"bad request\n")
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return _response(405, b"only GET and HEAD\n", extra=(("Allow", "GET, HEAD"),))
        path = target.split("?", 1)[0]
        head = method == "HEAD"
        route = self.routes.get(path)
        if route is not None:
            try:
                status, body, content_type = route()
            except Exception:
                return _response(500, b"this page failed\n", head=head)
            return _response(status, body, content_type, (("Cache-Control", "no-store"),), head=head)
        if path != "/metrics":
            paths = " ".join(sorted(["/metrics", *self.routes]))
            return _response(404, f"not found; this listener serves {paths}\n".encode(), head=head)
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            body = encoder(self.registry)
        except Exception:
            return _response(500, b"collecting metrics failed\n")
        extra: tuple[tuple[str, str], ...] = ()
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=6)
            extra = (("Content-Encoding", "gzip"),)
        return _response(200, body, content_type, extra, head=head)

    def _respond(self, conn: _Connection, payload: bytes) -> None:
        conn.response = memoryview(payload)
        conn.request.clear()
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.response)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        conn.response = conn.response[sent:]
        if not conn.response:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock, None) is None:
            return
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(5)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()


def serve_http(registry: CollectorRegistry, host: str, port: int, **options) -> MetricsHttpServer:
    """Serves ``registry`` at http://host:port/metrics, and ``routes`` beside it, on one daemon
    thread (see the module doc)."""
    return MetricsHttpServer(registry, host, port, **options)
