"""int8 cache versus the float32 and bfloat16 CPU backends, side by side in one run.

B=1, Hq=32, Hkv=8, D=128 at S in {2048, 8192, 32768}, on N(0, 1) data and on data with 4 key
and value channels 20x larger ("outliers"). Per row: bytes per token (and the ratio to a float16
cache; target <= 0.52), step latency (the int8 target: >= 2x faster than float32 at S=32768
and within 2x of its floor), the output's relative L2 error and the KL divergence of the
attention weights, both against float64 on the original data.

Timing: the configurations of one S take turns, ROUNDS rounds, each a median over CALLS calls
in a row after WARMUP (which also absorbs the idle spinning of torch's thread pool after the
previous configuration); a configuration's time is the median over rounds, so a drift of the
machine hits all of them alike.
The int8 floor is the time to read its stored bytes once (codes, float16 key channels, scales)
with the same threads: ``backends.native.Int8Kernel.read_bytes``.
The weights for the KL are recomputed in float64 from the keys each cache stores (``export``).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from backends import native
from backends.base import CacheSpec
from backends.cpu import CPUBackend
from backends.int8 import Int8Backend
from backends.policy import EvictionPolicy

from .common import median_seconds, table

B, HQ, HKV, D = 1, 32, 8, 128
LENGTHS = [2048, 8192, 32768]
ROUNDS, CALLS, WARMUP = 3, 7, 2
BUDGET_S = 1.5  # per function and round: fewer calls (at least 3) past it
OUTLIER_CHANNELS, OUTLIER_GAIN = 4, 20.0


def _weights64(q: torch.Tensor, keys: torch.Tensor) -> np.ndarray:
    """float64 attention weights (B, Hq, S) of (B, Hq, D) queries over (B, Hkv, S, D) keys."""
    g = HQ // HKV
    k = keys.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k) / math.sqrt(D)
    return torch.softmax(scores, dim=-1).numpy()


def _kl(p: np.ndarray, r: np.ndarray) -> float:
    """Mean over heads of KL(p || r) in nats."""
    p = np.clip(p, 1e-300, None)
    r = np.clip(r, 1e-300, None)
    return float(np.mean(np.sum(p * (np.log(p) - np.log(r)), axis=-1)))


def _data(shape, gen, outliers: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if outliers:
        x[..., torch.randperm(shape[-1], generator=gen)[:OUTLIER_CHANNELS]] *= OUTLIER_GAIN
    return x


def _rounds(fns: dict) -> dict:
    """Median seconds of each function: the median over ROUNDS rounds of its median over a few
    calls in a row (after WARMUP calls), the functions taking turns round after round."""
    per_round: dict = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            per_round[name].append(median_seconds(fn, repeat=CALLS, warmup=WARMUP, budget_s=BUDGET_S))
    return {name: statistics.median(t) for name, t in per_round.items()}


def run(report) -> None:
    rows = []
    gen = torch.Generator().manual_seed(0)
    f16_bytes = 2 * B * HKV * D * 2
    kernel = native.load()
    for s in LENGTHS:
        configs = {
            "cpu float32": (CPUBackend(), torch.float32),
            "cpu bfloat16": (CPUBackend(), torch.bfloat16),
            "int8 native": (Int8Backend(kernel="native"), torch.float32),
            "int8 int_mm": (Int8Backend(kernel="int_mm"), torch.float32),
            "int8 blocks": (Int8Backend(kernel="blocks"), torch.float32),
        }
        calls, caches = {}, {}
        for kind in ("normal", "outliers"):
            keys = _data((B, HKV, s + 1, D), gen, kind == "outliers")
            values = _data((B, HKV, s + 1, D), gen, kind == "outliers")
            q = torch.randn(B, HQ, D, generator=gen)
            w_ref = _weights64(q, keys)
            y_ref = np.einsum("bhs,bhsd->bhd", w_ref, values.double().repeat_interleave(HQ // HKV, dim=1).numpy())
            for name, (backend, dtype) in configs.items():
                if kind == "outliers" and not name.startswith(("cpu float32", "int8 native")):
                    continue  # errors only: the other kernels compute the same sums
                spec = CacheSpec(B, HQ, HKV, D, dtype, EvictionPolicy.none(s + 1))
                cache = backend.create_cache(spec)
                cache.prefill(keys[:, :, :s].to(dtype), values[:, :, :s].to(dtype))
                qd = q.to(dtype)
                out = cache.step(qd, keys[:, :, s].to(dtype), values[:, :, s].to(dtype)).output
                err = float(np.linalg.norm(out.double().numpy() - y_ref) / np.linalg.norm(y_ref))
                kl = _kl(w_ref, _weights64(qd.float(), cache.export()[0].float()))  # the keys as stored
                label = name if kind == "normal" else f"{name} (outliers)"
                rows.append([s, label, cache.row_bytes, cache.row_bytes / f16_bytes, None, err, kl])
                report.add(length=s, backend=name, data=kind, bytes_per_token=cache.row_bytes,
                           ratio_vs_float16=cache.row_bytes / f16_bytes, rel_l2=err, kl_nats=kl)
                if kind == "normal":
                    runs = cache._runs(cache.policy.attended(s + 1))
                    calls[name] = (lambda c=cache, x=qd, r=runs: c._attend(x, r))
                    caches[name] = cache
        native_cache = caches["int8 native"]
        stored = (native_cache._k.as_strided((native_cache._k.untyped_storage().nbytes(),), (1,)),  # with padding
                  native_cache._ko, native_cache._v, native_cache._ks, native_cache._vs)
        calls["int8 floor"] = lambda: [kernel.read_bytes(t) for t in stored]
        medians = _rounds(calls)
        for row in rows:
            if row[0] == s and row[1] in medians:
                row[4] = medians[row[1]] * 1e3
        rows.append([s, "int8 floor", native_cache.row_bytes, native_cache.row_bytes / f16_bytes,
                     medians["int8 floor"] * 1e3, float("nan"), float("nan")])
        for name, secs in medians.items():
            report.add(length=s, backend=name, step_seconds=secs)
        speedup = medians["cpu float32"] / medians["int8 native"]
        over_floor = medians["int8 native"] / medians["int8 floor"]
        report.add(length=s, int8_speedup_vs_float32=speedup, int8_over_floor=over_floor)
        print(f"S={s}: int8 is {speedup:.2f}x faster than float32, "
              f"{over_floor:.2f}x its floor (targets, at S=32768: >= 2x faster, <= 2x the floor)", flush=True)
        del calls, caches, native_cache, stored
    print(table(["S", "backend", "bytes/token", "x float16", "step ms", "rel L2", "KL nats"],
                [[c if c is not None else float("nan") for c in row] for row in rows]))
