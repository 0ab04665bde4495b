"""Server configuration: one object, read from flags and ``GQA_*`` variables in one place.

Every field has a flag ``--field-name`` and a variable ``GQA_FIELD_NAME``; a flag wins over the
variable, the variable over the default. ``ServerConfig.validate`` runs once at start-up.

A field's docstring is its only description: the first paragraph is the flag's ``--help`` (a
phrase, no final period), the rest the contract. ``metadata`` carries behaviour only: ``size``
(parsed by ``parse_size``), ``env_only`` (no flag), ``optional_env`` (the Helm chart renders it
only when set).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

__all__ = [
    "ServerConfig",
    "ConfigError",
    "add_arguments",
    "from_args",
    "parse_size",
    "format_size",
    "load_snapshot_key",
]

GiB = 1 << 30
MiB = 1 << 20


class ConfigError(ValueError):
    """A configuration value that cannot be served; the message names the flag."""


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}
# What a size flag's help says about its units: the two families mean different numbers.
SIZE_UNITS = (
    "Ki Mi Gi Ti are powers of 1024, K M G T (B optional) powers of 1000: 4Gi is 4294967296 bytes, 4GB 4000000000"
)
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``4Gi``, ``512Mi``, ``1.5GiB`` (powers of 1024), ``1G``, ``4GB`` (powers of
    1000: ``4GB`` is 4000000000 bytes) or a plain integer."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"expected a size such as 4Gi, 512Mi, 1G or 1048576, got {text!r}")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: int) -> str:
    """The shortest exact binary form: ``4Gi``, ``512Mi``, ``1000``."""
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        if n and n % _UNITS[unit.lower()] == 0:
            return f"{n // _UNITS[unit.lower()]}{unit}"
    return str(n)


@dataclass
class ServerConfig:
    address: str = "127.0.0.1:50051"
    """host:port the gRPC server binds

    Loopback by default."""

    backend: str = "cpu"
    """default backend of new streams

    Used by streams that do not name one; one of ``service.vocab.BACKEND_CHOICES``."""

    dtype: str = "float32"
    """default stream dtype

    Used by streams that do not name one; one of ``service.vocab.DTYPE_CHOICES``."""

    max_streams: int = 1024
    """streams open at once

    An open past it gets RESOURCE_EXHAUSTED."""

    max_cache_bytes: int = field(default=4 * GiB, metadata={"size": True})
    """bytes of all streams' caches together

    A stream's bytes are reserved at open, before allocation."""

    max_capacity: int = 1 << 20
    """rows per layer a stream may ask for

    Largest capacity (rows per layer) of one stream."""

    max_layers: int = 256
    """layers per stream"""
    max_heads: int = 256
    """query heads per stream"""
    max_head_dim: int = 1024
    """head width"""
    max_batch_size: int = 256
    """batch size per stream"""

    max_message_bytes: int = field(default=64 * MiB, metadata={"size": True})
    """gRPC message size, both directions

    Larger snapshots are chunked below it."""

    idle_timeout_s: float = 300.0
    """seconds of silence before a stream is freed

    A stream that sends nothing for this long is closed and its caches freed."""

    max_queued_steps: int = 8
    """steps read ahead per stream

    Requests of one stream read ahead of the one being computed; beyond it the server stops
    reading and HTTP/2 flow control holds the client back."""

    grace_period_s: float = 10.0
    """seconds open streams get to finish on SIGTERM

    On SIGTERM: new streams are refused at once, open ones end with UNAVAILABLE after this."""

    inline_step_bytes: int = field(default=1 * MiB, metadata={"size": True})
    """steps reading fewer cache bytes run on the event loop

    A step that reads fewer cache bytes than this runs on the event loop thread: a thread hop
    costs more than the step. A stream stepping alone runs it at once; the small steps of
    streams stepping together are computed as one batch at the loop's next turn (at most four
    times this many cache bytes a turn; the rest go to the pool). Longer steps run on the
    compute pool so streams stay responsive. A Batch step message runs on the loop when its
    session's previous message computed in under 2 ms (beside other sessions' work), or in
    under 100 ms when its session steps alone with nothing queued or computing (nobody waits on
    the loop then); a lone stream's Decode step likewise, up to 1 GiB of cache read. 0 keeps
    every step and message on the compute pool."""

    workers: int = 0
    """compute threads (0: one per core)

    Threads that run steps; streams run in parallel on them."""

    max_queued_bytes: int = field(default=16 * MiB, metadata={"size": True})
    """request bytes read ahead per stream

    Bytes of one stream's requests read ahead and not yet handled: the reader stops while
    this many are buffered, so a stream holds at most this plus one message (``max_message_bytes``)."""

    batch_max_delay_us: int = 0
    """microseconds a step may wait for batch-mates

    How long the oldest waiting step may be held back so that more streams' steps join its
    batch. 0 (the default) adds no delay: a free compute worker takes whatever is queued."""

    batch_max_steps: int = 0
    """steps per batched computation (0: no limit)

    Largest batch; 0 means no limit beyond one step per stream."""

    kernel_threads: int = 0
    """threads of the compiled kernels' pool (0: one per core)

    Size of the process-wide pool the compiled kernels run on (``backends.native.set_threads``).
    The pool's workers are pinned to CPUs other than the calling thread's (``backends/csrc/pool.c``)."""

    torch_threads: int = 1
    """torch intra-op threads per step

    torch's intra-op threads (``torch.set_num_threads``, process-wide). One by default:
    parallelism comes from running different streams' steps on the ``workers`` threads, and
    several OpenMP teams on few cores contend (docs/design.md, "Threads")."""

    metrics_port: int = 9464
    """Prometheus /metrics port on --metrics-host (0: off)"""

    metrics_host: str = field(default="", metadata={"optional_env": True})
    """host /metrics binds (empty: the host of --address)

    Address the /metrics listener binds. Empty means the host of ``address``; set it to
    127.0.0.1 (or a private interface) to keep the unauthenticated exposition off the network
    the gRPC port serves when ``--address 0.0.0.0``."""

    health_port: int = field(default=0, metadata={"optional_env": True})
    """plaintext port serving only grpc.health.v1, for probes when the main port uses TLS (0: off)

    A second, plaintext port on the host of ``address`` with the health service alone:
    kubelet's ``grpc:`` probes cannot speak TLS. It reveals nothing but SERVING/NOT_SERVING."""

    max_connection_age_s: float = 0.0
    """seconds after which a client connection is asked to reconnect (0: never)

    After this long the server sends a connection GOAWAY: streams already open on it go on
    untouched (no grace limit), new RPCs make the client reconnect, and so re-resolve DNS and
    reach pods added since (gRPC balances per connection). 0 keeps connections forever."""

    log_level: str = "INFO"
    """logging level"""

    # -- transport security and authentication (service/transport/security.py) --------------------------
    # Optional in deployments: the Helm chart renders them only when set (``optional_env``).
    tls_cert_file: str = field(default="", metadata={"optional_env": True})
    """PEM certificate chain: serve TLS instead of plaintext

    Server certificate chain (PEM). With ``tls_key_file`` set too, the port speaks TLS only;
    both empty (the default) keeps plaintext, meant for loopback and trusted networks."""

    tls_key_file: str = field(default="", metadata={"optional_env": True})
    """PEM private key of --tls-cert-file"""

    tls_client_ca_file: str = field(default="", metadata={"optional_env": True})
    """PEM CA bundle: require client certificates signed by it (mutual TLS)

    Mutual TLS: a client must present a certificate that chains to one of these CAs, or the
    handshake fails before any RPC. Needs ``tls_cert_file``/``tls_key_file``."""

    auth_token_file: str = field(default="", metadata={"optional_env": True})
    """file holding the bearer token every RPC but health must carry

    A file whose content (surrounding whitespace stripped) is the bearer token; RPCs other
    than health must send ``authorization: Bearer <token>`` or get UNAUTHENTICATED. A file
    that holds no token (empty, or whitespace only) refuses the start: it never means "off"."""

    auth_token: str = field(default="", repr=False, metadata={"env_only": True, "optional_env": True})
    """the bearer token itself

    The token from ``GQA_AUTH_TOKEN`` (e.g. a Kubernetes Secret through ``secretKeyRef``).
    There is deliberately no flag: a command line is visible to every user of the machine.
    Authentication never fails open: the variable set but empty or whitespace (an empty
    Secret key, say) refuses the start; only its absence means no authentication."""

    snapshot_key_file: str = field(default="", metadata={"optional_env": True})
    """file holding the key that signs snapshots (HMAC-SHA256); replicas that restore each other's share it

    With a key (at least 16 bytes, surrounding whitespace stripped), every snapshot is signed and
    a restore must carry a valid signature: a client cannot forge or alter a stream's state.
    Without one, snapshots carry only a CRC-32, which detects accidents but not tampering."""

    snapshot_key: str = field(default="", repr=False, metadata={"env_only": True, "optional_env": True})
    """the snapshot key itself

    The snapshot key from ``GQA_SNAPSHOT_KEY`` (e.g. a Kubernetes Secret); no flag, as for
    ``auth_token``."""

    def validate(self) -> "ServerConfig":
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"--address: expected HOST:PORT, got {self.address!r}")
        from .vocab import BACKEND_CHOICES, DTYPE_CHOICES  # names only: no backend module is imported

        if self.backend not in BACKEND_CHOICES:
            raise ConfigError(
                f"--backend: unknown backend {self.backend!r} (known: {', '.join(sorted(BACKEND_CHOICES))})"
            )
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(
                f"--dtype: expected {', '.join(DTYPE_CHOICES[:-1])} or {DTYPE_CHOICES[-1]}, got {self.dtype!r}"
            )
        for name in (
            "max_streams",
            "max_cache_bytes",
            "max_capacity",
            "max_layers",
            "max_heads",
            "max_head_dim",
            "max_batch_size",
            "max_message_bytes",
            "max_queued_steps",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)}: must be positive, got {getattr(self, name)}")
        if self.idle_timeout_s <= 0:
            raise ConfigError(f"--idle-timeout-s: must be positive, got {self.idle_timeout_s}")
        if not 0 <= self.health_port < 65536:
            raise ConfigError(f"--health-port: expected 0..65535, got {self.health_port}")
        if self.max_connection_age_s < 0:
            raise ConfigError(f"--max-connection-age-s: must be >= 0, got {self.max_connection_age_s}")
        if self.grace_period_s < 0:
            raise ConfigError(f"--grace-period-s: must be >= 0, got {self.grace_period_s}")
        for name in ("batch_max_delay_us", "batch_max_steps", "kernel_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)}: must be >= 0, got {getattr(self, name)}")
        if self.max_queued_bytes <= 0:
            raise ConfigError(f"--max-queued-bytes: must be positive, got {self.max_queued_bytes}")
        if self.workers < 0:
            raise ConfigError(f"--workers: must be >= 0, got {self.workers}")
        if self.torch_threads < 1:
            raise ConfigError(f"--torch-threads: must be >= 1, got {self.torch_threads}")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port: expected 0..65535, got {self.metrics_port}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("--tls-cert-file and --tls-key-file: set both (TLS) or neither (plaintext)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("--tls-client-ca-file: mutual TLS needs --tls-cert-file and --tls-key-file too")
        if self.auth_token and self.auth_token_file:
            raise ConfigError("GQA_AUTH_TOKEN and --auth-token-file: set one of them, not both")
        if self.auth_token:
            _check_token(self.auth_token, "GQA_AUTH_TOKEN")
        if self.snapshot_key and self.snapshot_key_file:
            raise ConfigError("GQA_SNAPSHOT_KEY and --snapshot-key-file: set one of them, not both")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file", "snapshot_key_file"):
            path = getattr(self, name)
            if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
                raise ConfigError(f"--{_flag(name)}: {path!r} is not a readable file")
        if self.auth_token_file:
            try:
                with open(self.auth_token_file, "rb") as f:
                    content = f.read().decode("utf-8", "replace")
            except OSError as exc:
                raise ConfigError(f"--auth-token-file: cannot read {self.auth_token_file!r}: {exc.strerror}") from None
            _check_token(content, "--auth-token-file")
        return self

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def metrics_bind_host(self) -> str:
        """The host /metrics binds: ``metrics_host``, else the host of ``address``."""
        return self.metrics_host or self.host

    @property
    def compute_workers(self) -> int:
        return self.workers or (os.cpu_count() or 1)

    @property
    def kernel_pool_threads(self) -> int:
        return self.kernel_threads or (os.cpu_count() or 1)


MIN_SNAPSHOT_KEY_BYTES = 16


def load_snapshot_key(config: ServerConfig) -> bytes | None:
    """The snapshot signing key of ``config``, or None (snapshots unsigned); ``ConfigError``
    when a key source is set but holds fewer than ``MIN_SNAPSHOT_KEY_BYTES`` bytes (an empty Secret
    must not turn signing off silently)."""
    if config.snapshot_key_file:
        try:
            with open(config.snapshot_key_file, "rb") as f:
                key, where = f.read().strip(), "--snapshot-key-file"
        except OSError as exc:
            raise ConfigError(
                f"--snapshot-key-file: cannot read {config.snapshot_key_file!r} ({exc.strerror})"
            ) from None
    elif config.snapshot_key:
        key, where = config.snapshot_key.strip().encode(), "GQA_SNAPSHOT_KEY"
    else:
        return None
    if len(key) < MIN_SNAPSHOT_KEY_BYTES:
        raise ConfigError(
            f"{where}: the snapshot key must hold at least {MIN_SNAPSHOT_KEY_BYTES} bytes, got {len(key)}"
        )
    return key


def _check_token(raw: str, where: str) -> None:
    """A configured token source must hold a usable token: never fall back to no authentication."""
    token = raw.strip()
    if not token:
        raise ConfigError(
            f"{where}: set but empty; refusing to start without authentication (unset it to run without a token)"
        )
    if any(c.isspace() for c in token):
        raise ConfigError(f"{where}: the token must not contain whitespace")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _env(name: str) -> str:
    return "GQA_" + name.upper()


def _kind(f):
    if f.metadata.get("size"):
        return _size
    return f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str}[f.type]


def _size(text: str) -> int:
    return parse_size(text)


_size.__name__ = "size"  # argparse names the type in its error: "invalid size value: '4Q'"


@functools.cache
def field_docs() -> dict[str, str]:
    """Each ``ServerConfig`` field's docstring (the string literal under it), by field name; read
    from the source, as Python keeps no attribute docstrings. Empty where no source is at hand."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(ServerConfig)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _help(doc: str, choices: tuple[str, ...] | None) -> str:
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    return f"{summary} ({', '.join(choices)})" if choices else summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; defaults stay unset so that the environment can fill them."""
    from .vocab import BACKEND_CHOICES, DTYPE_CHOICES

    choices = {"backend": BACKEND_CHOICES, "dtype": DTYPE_CHOICES}
    docs = field_docs()
    for f in fields(ServerConfig):
        if f.metadata.get("env_only"):
            continue
        default = format_size(f.default) if f.metadata.get("size") else f.default
        units = f"; {SIZE_UNITS}" if f.metadata.get("size") else ""
        parser.add_argument(
            f"--{_flag(f.name)}",
            dest=f.name,
            type=_kind(f),
            default=None,
            help=f"{_help(docs.get(f.name, ''), choices.get(f.name))} [env {_env(f.name)}, default {default}{units}]",
        )


def from_args(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    env = os.environ if env is None else env
    values = {}
    for f in fields(ServerConfig):
        kind = _kind(f)
        flag_value = getattr(args, f.name, None) if args is not None else None
        if flag_value is not None:
            values[f.name] = flag_value
        elif _env(f.name) in env:
            raw = env[_env(f.name)]
            if f.metadata.get("env_only") and not raw.strip():
                # A secret variable present but empty is a misconfigured Secret, not a request
                # to run without authentication or without snapshot signing.
                raise ConfigError(
                    f"{_env(f.name)}: set but empty; refusing to start without it "
                    "(unset the variable to run without it)"
                )
            try:
                values[f.name] = kind(raw)
            except ValueError as exc:
                expected = str(exc) if kind is _size else f"expected {kind.__name__}, got {raw!r}"
                raise ConfigError(f"{_env(f.name)}: {expected}") from None
    return dataclasses.replace(ServerConfig(), **values).validate()
