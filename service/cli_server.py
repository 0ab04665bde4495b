"""The ``serve`` and ``demo`` subcommands (imported by ``cli`` on use, to keep ``step`` light)."""

from __future__ import annotations

import argparse

from .config import ConfigError, add_arguments, from_args


def add_commands(sub) -> None:
    serve = sub.add_parser("serve", help="start the gRPC service (every flag also as a GQA_* variable)")
    add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="open a stream against a running server and run N steps")
    demo.add_argument("--address", default="127.0.0.1:50051")
    demo.add_argument("--steps", type=int, default=500)
    demo.add_argument("--policy", choices=["none", "strict", "greedy", "sink"], default="greedy")
    demo.add_argument("--window", type=int, default=256)
    demo.add_argument("--backend", default="", help="backend name (default: the server's)")
    demo.set_defaults(func=cmd_demo)


def cmd_serve(args: argparse.Namespace) -> int:
    from .cli import fail
    from .server import run

    try:
        config = from_args(args)
        return run(config)
    except ConfigError as exc:  # also a token file that holds no usable token
        return fail(str(exc))


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.steps <= 0:
        from .cli import fail

        return fail("--steps must be positive")
    run_demo(args.address, args.steps, policy=args.policy, window=args.window, backend=args.backend)
    return 0
