"""The ``gqa-serve`` command: ``step`` (one decode step from JSON), ``serve``, ``demo``, ``bench``.

Every expected failure (bad input, a bad flag, no server, a port in use) is one line on stderr
and a non-zero exit: 2 for bad input or configuration, 1 for a failure at run time.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .common import EXIT_FAILURE, EXIT_USAGE, OneLineParser, fail, plain  # noqa: F401 (re-exported)

__all__ = ["main", "fail", "OneLineParser"]


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
TENSOR_KEYS = STEP_KEYS[:5]


def _explicit_tensor(name: str, spec: dict):
    """``{"shape": [...], "values": [...]}``: flat row-major values, so that a dimension may be
    0 (nested lists cannot say ``[1, 1, 0, 2]``)."""
    import math

    import torch

    if set(spec) != {"shape", "values"}:
        raise ValueError(
            f'{name}: an explicit tensor is {{"shape": [...], "values": [...]}}, got keys '
            f"{', '.join(sorted(spec)) or 'none'}"
        )
    shape, values = spec["shape"], spec["values"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"{name}.shape: expected a list of non-negative integers, got {shape!r}")
    if not isinstance(values, list) or len(values) != math.prod(shape):
        count = len(values) if isinstance(values, list) else "no"
        raise ValueError(f"{name}.values: shape {shape} needs {math.prod(shape)} values, got {count}")
    try:
        return torch.tensor(values, dtype=torch.float32).reshape(shape)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}.values: expected numbers ({exc})") from None


def cmd_step(args: argparse.Namespace) -> int:
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
    from backends.reference import gqa_decode_step  # torch: ~3 s of CPU, not paid for a malformed object

    try:
        inputs = {
            k: _explicit_tensor(k, payload[k]) if k in TENSOR_KEYS and isinstance(payload[k], dict) else payload[k]
            for k in STEP_KEYS
        }
        result = gqa_decode_step(**inputs)
    except (TypeError, ValueError) as exc:
        return fail(str(exc))
    print(json.dumps({k: tensor_to_json(result[k]) for k in ("output", "new_key_cache", "new_value_cache")}))
    return 0


STEP_EPILOG = """\
input: one JSON object with query (B, Hq, D), new_key and new_value (B, Hkv, D), key_cache and
value_cache (B, Hkv, S, D), num_query_heads, num_kv_heads. A tensor is a nested list, or
{"shape": [...], "values": [...]} with its values flat in row-major order, which can say S = 0:
  gqa-serve step --json '{"query": [[[0, 1]]], "new_key": [[[1, 0]]], "new_value": [[[6, 0]]],
    "key_cache": {"shape": [1, 1, 0, 2], "values": []},
    "value_cache": {"shape": [1, 1, 0, 2], "values": []}, "num_query_heads": 1, "num_kv_heads": 1}'
output: {"output", "new_key_cache", "new_value_cache"} as nested lists."""


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = OneLineParser(prog="gqa-serve", description=plain(__doc__.splitlines()[0]))
    parser.add_argument("--version", action="version", version=f"gqa-serve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{step,serve,demo,bench}")

    step = sub.add_parser(
        "step",
        help="one decode step: a JSON object on stdin (or --json) to a JSON object on stdout",
        description="One decode step computed locally (no server): JSON in, JSON out.",
        epilog=STEP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    step.add_argument("--json", help="the input object, instead of reading stdin")
    step.set_defaults(func=cmd_step)

    from .commands import add_commands

    add_commands(sub)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("gqa-serve: interrupted", file=sys.stderr)
        return 130
