"""The ``gqa-serve`` command: ``step`` (one decode step from JSON), ``serve``, ``demo``.

Exit status 2 with a one-line message on stderr for bad input or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

__all__ = ["main"]


def _shortest(value: float, dtype) -> float:
    # The shortest decimal that reads back as the same value in the tensor's own dtype, so
    # a float32 0.2 prints as 0.2, not 0.20000000298023224.
    return float(np.format_float_positional(dtype(value), unique=True, trim="0"))


def tensor_to_json(t) -> Any:
    import torch

    dtype = np.float64 if t.dtype == torch.float64 else np.float32
    arr = t.detach().to("cpu").to(torch.float64 if dtype is np.float64 else torch.float32).numpy()
    if t.dtype in (torch.float16, torch.bfloat16):
        return arr.tolist()  # exactly representable in float32; tolist keeps them exact
    flat = [_shortest(v, dtype) for v in arr.reshape(-1).tolist()]
    return np.array(flat, dtype=np.float64).reshape(arr.shape).tolist() if flat else arr.tolist()


STEP_KEYS = ("query", "new_key", "new_value", "key_cache", "value_cache", "num_query_heads", "num_kv_heads")


def cmd_step(args: argparse.Namespace) -> int:
    from backends.reference import gqa_decode_step

    text = args.json if args.json is not None else sys.stdin.read()
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        return fail(f"input is not valid JSON: {exc}")
    if not isinstance(payload, dict):
        return fail(f"input must be one JSON object with keys {', '.join(STEP_KEYS)}")
    missing = [k for k in STEP_KEYS if k not in payload]
    if missing:
        return fail(f"input is missing {', '.join(missing)}")
    unknown = sorted(set(payload) - set(STEP_KEYS))
    if unknown:
        return fail(f"input has unknown keys {', '.join(unknown)}")
    try:
        result = gqa_decode_step(**{k: payload[k] for k in STEP_KEYS})
    except (TypeError, ValueError) as exc:
        return fail(str(exc))
    print(json.dumps({k: tensor_to_json(result[k]) for k in ("output", "new_key_cache", "new_value_cache")}))
    return 0


def fail(message: str) -> int:
    print(f"gqa-serve: error: {message}".replace("\n", " "), file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gqa-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    step = sub.add_parser("step", help="one decode step: a JSON object on stdin (or --json) to a JSON object on stdout")
    step.add_argument("--json", help="the input object, instead of reading stdin")
    step.set_defaults(func=cmd_step)

    from .cli_server import add_commands

    add_commands(sub)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
