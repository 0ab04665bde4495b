"""The ``serve``, ``demo`` and ``bench`` subcommands (imported by ``cli`` on use, to keep ``step``
light). The flags and helpers the commands share are ``service.cli.common``'s."""

from __future__ import annotations

import argparse
import socket

from ..config import ConfigError, add_arguments, from_args
from .common import (
    EXIT_FAILURE,
    add_client_arguments,
    client_from_args,
    fail,
    non_negative_int,
    positive_int,
)

DEMO_DESCRIPTION = """\
Opens one Decode stream against a running server and sends STEPS decode steps of random data,
one at a time, round-robin over the layers; prints what the server opened, a progress bar, then
per step the round trip (as this client sees it) beside the server's own compute time
(StepResult.compute_ns), and the evictions. The defaults evict: 500 steps over 2 layers are 250
tokens per layer, past greedy's window of 64 (capacity 96)."""


def add_commands(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="start the gRPC service (every flag also as a GQA_* variable)",
        description="Start the gRPC service. Every flag is also a GQA_* variable; the flag wins. "
        "Ctrl-C (or SIGTERM) drains: streams get --grace-period-s to finish; a second "
        "Ctrl-C stops at once.",
    )
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo",
        help="open a stream against a running server and run N steps",
        description=DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ..vocab import DTYPE_CHOICES, POLICY_CHOICES

    add_client_arguments(demo)
    shape = demo.add_argument_group("the stream")
    shape.add_argument("--steps", type=positive_int, default=500, help="decode steps to send (default %(default)s)")
    shape.add_argument("--layers", type=positive_int, default=2, help="layers of the stream (default %(default)s)")
    shape.add_argument("--heads", type=positive_int, default=32, help="query heads Hq (default %(default)s)")
    shape.add_argument(
        "--kv-heads", type=positive_int, default=8, help="KV heads Hkv, dividing Hq (default %(default)s)"
    )
    shape.add_argument("--head-dim", type=positive_int, default=128, help="head width D (default %(default)s)")
    shape.add_argument(
        "--policy",
        choices=POLICY_CHOICES,
        default="greedy",
        help="eviction policy (docs/eviction.md; default %(default)s)",
    )
    shape.add_argument(
        "--window",
        type=positive_int,
        default=64,
        help="W, keys a token attends to including itself (strict, greedy, sink; default %(default)s)",
    )
    shape.add_argument(
        "--capacity",
        type=non_negative_int,
        default=0,
        help="rows per layer: none's maximum length (0: the steps each layer gets), greedy's C >= W (0: 1.5 W)",
    )
    shape.add_argument(
        "--sink-tokens", type=non_negative_int, default=4, help="sink policy: first tokens kept (default %(default)s)"
    )
    shape.add_argument("--backend", default="", help="backend name (default: the server's)")
    shape.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="stream dtype (default %(default)s)")
    shape.add_argument("--seed", type=int, default=0, help="random data seed (default %(default)s)")
    demo.set_defaults(func=cmd_demo)

    from .loadgen import add_command

    add_command(sub)


def _check_port(host: str, port: int, flags: str) -> str | None:
    """Why ``host:port`` cannot be listened on, or None. Checked before gRPC binds, whose own
    failure is a C-core log line and a traceback."""
    if not port:
        return None
    host = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        return f"cannot listen on {host}:{port}: {exc.strerror} ({flags})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc} ({flags})"
    return None


def cmd_serve(args: argparse.Namespace) -> int:

    try:
        config = from_args(args)
    except ConfigError as exc:  # also a token file that holds no usable token
        return fail(str(exc))
    for port, flags in (
        (int(config.address.rpartition(":")[2]), "--address / GQA_ADDRESS"),
        (config.metrics_port, "--metrics-port / GQA_METRICS_PORT; 0 turns metrics off"),
        (config.health_port, "--health-port / GQA_HEALTH_PORT"),
    ):
        reason = _check_port(config.host, port, flags)
        if reason:
            return fail(reason, EXIT_FAILURE)
    from ..server import run

    try:
        return run(config)
    except ConfigError as exc:
        return fail(str(exc))
    except RuntimeError as exc:
        if str(exc).startswith("Failed to bind"):
            return fail(
                f"cannot listen on {config.address}: the port is in use or the address is not on this "
                "machine (--address / GQA_ADDRESS)",
                EXIT_FAILURE,
            )
        raise
    except OSError as exc:  # the metrics or health port in use; the message names the flag
        return fail(str(exc), EXIT_FAILURE)


def cmd_demo(args: argparse.Namespace) -> int:
    from gqa_client import GqaError

    from .demo import run_demo

    if args.heads % args.kv_heads:
        return fail(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    try:
        with client_from_args(args) as client:
            run_demo(client, args)
    except ConfigError as exc:
        return fail(str(exc))
    except GqaError as exc:
        return fail(f"{args.address}: {exc.code.name}: {exc.message}", EXIT_FAILURE)
    return 0
