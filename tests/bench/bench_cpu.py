"""CPU decode step, as a client waits for it: the public ``cache.step`` beside its peers and
the memory floor, every call made from a cold last-level cache.

B=1, Hq=32, Hkv=8, D=128 over S cached tokens; each implementation appends the new token and
attends over S+1:

- ``ours``: ``get_backend("cpu").create_cache(CacheSpec(...))``, ``prefill``, then the public
  ``cache.step(q, k, v)`` (policy none: checks, ring write, attention, the ``StepOutcome``).
- ``sdpa``: a preallocated (B, Hkv, C, D) cache, the row written in place, then
  ``scaled_dot_product_attention(enable_gqa=True)`` over the first S+1 rows.
- ``ort``: ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (CPU), a one-node model whose
  past and present K/V are bound (``io_binding``) to one shared buffer, so it appends in place;
  the step's inputs are bound once, so only ``run_with_iobinding`` is timed. It has no bfloat16
  CPU kernel.
- ``floor``: reading the same number of bytes (the S+1 rows of K and V) once from DRAM, a sum
  over them viewed as float32 words with the same threads (``common.floor_reader``).

Before every timed call a buffer of 3x the last-level cache is written (``common.Evictor``), for
every implementation and the floor alike; the implementations take turns round after round and
each figure is the median [p10-p90] of the per-round figures (ratios are per round too).

Tables: the step at S in LENGTHS per dtype; the fixed cost at S=1 (float32, Python call to
output; a hot column beside it, labelled); 2048 consecutive steps from an empty cache against
ONNX Runtime's shared-buffer loop (hot; in long mode also cold, an eviction before each step).
PASS/FAIL lines for the targets (issue #24's; #14's before it) follow each table.

``GQA_BENCH_MODE=long`` runs more rounds and the cold consecutive loops; ``smoke`` runs tiny sizes
(the tests' import check).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from backends import native
from backends.contract import CacheSpec
from backends.policy import EvictionPolicy
from backends.registry import get_backend

from .common import (
    Evictor,
    HotNotes,
    Report,
    bench_mode,
    cold_rounds,
    floor_reader,
    fmt_spread,
    hot_rounds,
    hot_seconds,
    per_round_ratio,
    sample_seconds,
    spread,
    table,
    verdict_spread,
)

B, HQ, HKV, D = 1, 32, 8, 128
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IMPLS = ("ours", "sdpa", "ort", "floor")
# Targets: issue #24's (the floor ratios were #14's, the ORT speedups now from S = 2048).
FLOOR_TARGET = {torch.float32: 1.25, torch.bfloat16: 1.5, torch.float16: 1.5}
FLOOR_TARGET_LENGTHS = (2048, 8192, 32768)
ORT_SPEEDUP_TARGET = {torch.float32: 1.35, torch.float16: 3.0}  # at every S >= ORT_SPEEDUP_FROM
ORT_SPEEDUP_FROM = 2048
CONSECUTIVE_TARGET = 2.0

MODES = {
    # lengths; rounds per length (fewer past 8192), at S=1, of the consecutive loops; seconds
    # after which a row stops at 3 rounds (a loaded machine must not stretch `make bench`)
    "smoke": dict(
        lengths=(64, 600),
        rounds=2,
        long_rounds=2,
        s1_rounds=5,
        consecutive=64,
        consecutive_rounds=1,
        consecutive_cold=True,
        budget_s=1.0,
        evict_bytes=1 << 20,
        hot_calls=3,
    ),
    "default": dict(
        lengths=(512, 2048, 8192, 32768),
        rounds=15,
        long_rounds=9,
        s1_rounds=100,
        consecutive=2048,
        consecutive_rounds=3,
        consecutive_cold=False,
        budget_s=5.0,
        evict_bytes=None,
        hot_calls=40,
    ),
    "long": dict(
        lengths=(512, 2048, 8192, 32768),
        rounds=41,
        long_rounds=25,
        s1_rounds=600,
        consecutive=2048,
        consecutive_rounds=5,
        consecutive_cold=True,
        budget_s=60.0,
        evict_bytes=None,
        hot_calls=100,
    ),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the implementations --------------------------------------------------------------------


def _ours(dtype, keys, values, policy):
    cache = get_backend("cpu").create_cache(CacheSpec(B, HQ, HKV, D, dtype, policy))
    cache.prefill(keys, values)
    return cache


class SDPAStep:
    def __init__(self, keys, values, capacity):
        s = keys.shape[2]
        self.k = torch.empty((B, HKV, capacity, D), dtype=keys.dtype)
        self.v = torch.empty_like(self.k)
        self.k[:, :, :s] = keys
        self.v[:, :, :s] = values
        self.s = s

    def __call__(self, q, new_k, new_v):
        s = self.s
        self.k[:, :, s] = new_k
        self.v[:, :, s] = new_v
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), self.k[:, :, : s + 1], self.v[:, :, : s + 1], enable_gqa=True
        )
        return out.squeeze(2)


class ORTStep:
    """One GroupQueryAttention node; the past buffer is also the present one (in-place append).
    ``bind_step`` binds a step's inputs; ``set_length`` moves the append position."""

    def __init__(self, keys, values, capacity):
        import onnx  # noqa: F401  (the helper below needs it installed)
        import onnxruntime as ort
        from onnx import TensorProto, helper

        elem = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}[keys.dtype]
        self.np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[keys.dtype]
        past = ["batch", HKV, "capacity", D]
        node = helper.make_node(
            "GroupQueryAttention",
            ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
            ["output", "present_key", "present_value"],
            domain="com.microsoft",
            num_heads=HQ,
            kv_num_heads=HKV,
        )
        graph = helper.make_graph(
            [node],
            "gqa_decode",
            [
                helper.make_tensor_value_info("query", elem, ["batch", 1, HQ * D]),
                helper.make_tensor_value_info("key", elem, ["batch", 1, HKV * D]),
                helper.make_tensor_value_info("value", elem, ["batch", 1, HKV * D]),
                helper.make_tensor_value_info("past_key", elem, past),
                helper.make_tensor_value_info("past_value", elem, past),
                helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
                helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
            ],
            [
                helper.make_tensor_value_info("output", elem, ["batch", 1, HQ * D]),
                helper.make_tensor_value_info("present_key", elem, past),
                helper.make_tensor_value_info("present_value", elem, past),
            ],
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        )
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        opts.inter_op_num_threads = 1
        # Idle threads that spin after a run steal the cores from whatever is timed next (the
        # floor read right after ORT came out 2-3x too slow with spinning on).
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        s = keys.shape[2]
        k = np.zeros((B, HKV, capacity, D), dtype=self.np_dtype)
        v = np.zeros_like(k)
        k[:, :, :s] = keys.numpy()
        v[:, :, :s] = values.numpy()
        self.k = ort.OrtValue.ortvalue_from_numpy(k)
        self.v = ort.OrtValue.ortvalue_from_numpy(v)
        self.out = ort.OrtValue.ortvalue_from_numpy(np.zeros((B, 1, HQ * D), dtype=self.np_dtype))
        binding = self.session.io_binding()
        binding.bind_ortvalue_input("past_key", self.k)
        binding.bind_ortvalue_input("past_value", self.v)
        binding.bind_ortvalue_output("present_key", self.k)
        binding.bind_ortvalue_output("present_value", self.v)
        binding.bind_ortvalue_output("output", self.out)
        self.binding = binding
        self.set_length(s)

    def set_length(self, s: int) -> None:
        """The next run appends at position ``s`` and attends over ``s + 1`` rows."""
        self.binding.bind_cpu_input("seqlens_k", np.full((B,), s, dtype=np.int32))
        self.binding.bind_cpu_input("total_sequence_length", np.array(s + 1, dtype=np.int32))

    def bind_step(self, q, new_k, new_v):
        """Binds a step's inputs: (B, 1, H*D) arrays, or torch tensors converted here."""
        b = self.binding
        for name, x, h in (("query", q, HQ), ("key", new_k, HKV), ("value", new_v, HKV)):
            a = x if isinstance(x, np.ndarray) else np.ascontiguousarray(x.reshape(B, 1, h * D).numpy())
            b.bind_cpu_input(name, a)

    def __call__(self):
        self.session.run_with_iobinding(self.binding)

    def output(self) -> torch.Tensor:
        return torch.from_numpy(self.out.numpy().reshape(B, HQ, D).copy())


# -- the runs -------------------------------------------------------------------------------


def _inputs(s, dtype, gen):
    keys = torch.randn((B, HKV, s, D), generator=gen).to(dtype)
    values = torch.randn((B, HKV, s, D), generator=gen).to(dtype)
    q = torch.randn((B, HQ, D), generator=gen).to(dtype)
    nk = torch.randn((B, HKV, D), generator=gen).to(dtype)
    nv = torch.randn((B, HKV, D), generator=gen).to(dtype)
    return keys, values, q, nk, nv


def check_peers_match_ours() -> None:
    """A broken peer column must not print: ONNX Runtime's and SDPA's outputs must equal ours."""
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 3e-2)):
        keys, values, q, nk, nv = _inputs(300, dtype, gen)
        ours = _ours(dtype, keys, values, EvictionPolicy.none(301)).step(q, nk, nv).output.float()
        peers = {"sdpa": SDPAStep(keys, values, 301)(q, nk, nv).float()}
        if dtype != torch.bfloat16:
            ort_step = ORTStep(keys, values, 301)
            ort_step.bind_step(q, nk, nv)
            ort_step()
            peers["ort"] = ort_step.output().float()
        for name, theirs in peers.items():
            err = ((theirs - ours).abs().max() / ours.abs().max()).item()
            assert err < tol, f"{name} differs from ours ({_name(dtype)}): {err:.2e}"


def _kv_bytes(s: int, dtype: torch.dtype) -> int:
    """The bytes a step at S reads: the S+1 rows of K and V (the floor's)."""
    return 2 * B * HKV * (s + 1) * D * torch.empty((), dtype=dtype).element_size()


def measure(s, dtype, gen, evict, rounds, budget_s, report):
    """The cold rounds at S (samples per implementation) and a function that times our step hot
    (``common.hot_seconds``, for ``HotNotes``)."""
    keys, values, q, nk, nv = _inputs(s, dtype, gen)
    headroom = rounds + 8  # ours appends one token per call (warm-up included); the peers overwrite row s
    cache = _ours(dtype, keys, values, EvictionPolicy.none(s + headroom))
    sdpa = SDPAStep(keys, values, s + 1)
    fns = {
        "ours": lambda: cache.step(q, nk, nv),
        "sdpa": lambda: sdpa(q, nk, nv),
    }
    if dtype in (torch.float32, torch.float16):
        ort_step = ORTStep(keys, values, s + 1)
        ort_step.bind_step(q, nk, nv)
        fns["ort"] = ort_step
    kv_bytes = _kv_bytes(s, dtype)
    fns["floor"] = floor_reader(kv_bytes)
    del keys, values
    samples = cold_rounds(fns, evict, rounds=rounds, budget_s=budget_s)
    report.add(
        kind="step", dtype=_name(dtype), S=s, kv_bytes=kv_bytes, cold=True, **{f"{k}_s": v for k, v in samples.items()}
    )
    return samples, partial(hot_seconds, cache, q, nk, nv)


def per_call(evict, rounds, budget_s, report) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The fixed cost at S=1 (float32): cold (each call after an eviction) and hot (blocks of
    calls in a row). Ours runs a strict window of 2, so every step attends 2 rows; SDPA and ONNX
    Runtime overwrite row 1 and attend 2 rows as well."""
    gen = torch.Generator().manual_seed(3)
    keys, values, q, nk, nv = _inputs(1, torch.float32, gen)
    cache = _ours(torch.float32, keys, values, EvictionPolicy.strict(2))
    sdpa = SDPAStep(keys, values, 2)
    ort_step = ORTStep(keys, values, 2)
    ort_step.bind_step(q, nk, nv)
    fns = {
        "ours": lambda: cache.step(q, nk, nv).output,
        "sdpa": lambda: sdpa(q, nk, nv),
        "ort": ort_step,
    }
    cold = cold_rounds(fns, evict, rounds=rounds, warmup=20, budget_s=budget_s, min_rounds=min(rounds, 20))
    hot = hot_rounds(fns, rounds=max(3, rounds // 10), calls=25, budget_s=budget_s / 2)
    report.add(kind="per_call", dtype="float32", S=1, cold=True, **{f"{k}_s": v for k, v in cold.items()})
    report.add(kind="per_call", dtype="float32", S=1, cold=False, **{f"{k}_s": v for k, v in hot.items()})
    return cold, hot


def _ours_step(cache, qs, ks, vs, i, last) -> None:
    """Step ``i`` of the consecutive loop (the inputs indexed in the call, as a loop does), its
    output kept in ``last["ours"]``."""
    last["ours"] = cache.step(qs[i], ks[i], vs[i]).output


def _ort_step(ort_step, np_inputs, i) -> None:
    """Step ``i`` of ONNX Runtime's loop: bind the inputs and the past length, run."""
    ort_step.set_length(i)
    ort_step.bind_step(*np_inputs[i])
    ort_step()


def consecutive(steps, rounds, budget_s, cold, evict, report) -> dict[str, list[float]]:
    """Total seconds of ``steps`` consecutive float32 steps from an empty cache: ours (the public
    step, policy none) and ONNX Runtime's shared-buffer loop (per step: bind the inputs, the
    past length, run). The inputs are made (and converted to numpy) before the clock starts;
    the total is the sum of the steps' times. ``cold``: every step after an eviction (as in a
    model); else the loop runs hot, one eviction before it (a 2048-token cache fits in L3)."""
    gen = torch.Generator().manual_seed(2)
    qs = torch.randn((steps, B, HQ, D), generator=gen)
    ks = torch.randn((steps, B, HKV, D), generator=gen)
    vs = torch.randn((steps, B, HKV, D), generator=gen)
    np_inputs = [
        (
            qs[i].reshape(B, 1, HQ * D).numpy(),
            ks[i].reshape(B, 1, HKV * D).numpy(),
            vs[i].reshape(B, 1, HKV * D).numpy(),
        )
        for i in range(steps)
    ]
    empty = torch.empty((B, HKV, 0, D))

    def loop_seconds(calls) -> float:
        """The sum of the steps' times, one eviction before the loop and, cold, one before each step."""
        evict()
        return sum(sample_seconds([fn], 1, before=evict if cold else None)[0] for fn in calls)

    samples: dict[str, list[float]] = {"ours": [], "ort": []}
    last = {}
    deadline = time.perf_counter() + budget_s
    for r in range(rounds):
        cache = get_backend("cpu").create_cache(CacheSpec(B, HQ, HKV, D, torch.float32, EvictionPolicy.none(steps)))
        samples["ours"].append(loop_seconds([partial(_ours_step, cache, qs, ks, vs, i, last) for i in range(steps)]))
        ort_step = ORTStep(empty, empty, steps)
        samples["ort"].append(loop_seconds([partial(_ort_step, ort_step, np_inputs, i) for i in range(steps)]))
        last["ort"] = ort_step.output()
        if r >= 1 and time.perf_counter() > deadline:
            break
    err = ((last["ort"] - last["ours"]).abs().max() / last["ours"].abs().max()).item()
    assert err < 1e-4, f"ONNX Runtime's loop differs from ours at its last step: {err:.2e}"
    report.add(kind="consecutive", dtype="float32", steps=steps, cold=cold, **{f"{k}_s": v for k, v in samples.items()})
    return samples


def run(report: Report) -> None:
    cfg = MODES[bench_mode()]
    evict = Evictor(nbytes=cfg["evict_bytes"])
    check_peers_match_ours()
    print(
        f"B={B}, Hq={HQ}, Hkv={HKV}, D={D}; threads: torch {torch.get_num_threads()}, "
        f"kernel pool {native.threads()}, ONNX Runtime {torch.get_num_threads()}; {evict.nbytes >> 20} MiB "
        f"written before every timed call (mode {bench_mode()})",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    rows, verdicts = [], []
    for dtype in DTYPES:
        notes = HotNotes(cfg["hot_calls"])
        for s in cfg["lengths"]:
            rounds = cfg["rounds"] if s <= 8192 else cfg["long_rounds"]
            t, hot = measure(s, dtype, gen, evict, rounds, cfg["budget_s"], report)
            kv_bytes = _kv_bytes(s, dtype)
            fl = t["floor"]
            ort = t.get("ort")
            over = {k: per_round_ratio(t[k], fl) for k in ("ours", "sdpa", "ort") if k in t}
            speedup = per_round_ratio(ort, t["ours"]) if ort else []
            rows.append(
                [_name(dtype), s]
                + [spread(t[k])[0] * 1e3 if k in t else float("nan") for k in IMPLS]
                + [fmt_spread(over[k]) if k in over else "-" for k in ("ours", "sdpa", "ort")]
                + [fmt_spread(speedup)]
                # the floor's own rate: it must read at the machine's bandwidth for the ratios to mean anything
                + [kv_bytes / spread(fl)[0] / 1e9]
            )
            if s in FLOOR_TARGET_LENGTHS:
                hot_s = notes.time(s, kv_bytes, hot)
                if hot_s is not None:
                    report.add(kind="hot_step", dtype=_name(dtype), S=s, ours_s=hot_s)
                verdicts.append(verdict_spread(f"{_name(dtype)} S={s} ours/floor", over["ours"], FLOOR_TARGET[dtype]))
                verdicts.extend(notes.under(verdicts[-1], kv_bytes, hot_s, fl, FLOOR_TARGET[dtype]))
            del hot  # its cache with it
            if s >= ORT_SPEEDUP_FROM and dtype in ORT_SPEEDUP_TARGET:
                verdicts.append(
                    verdict_spread(
                        f"{_name(dtype)} S={s} ort/ours (speedup)", speedup, ORT_SPEEDUP_TARGET[dtype], at_most=False
                    )
                )
            print(f"  {_name(dtype)} S={s}: {len(fl)} rounds", flush=True)
    print("\nthe public step from a cold L3 (B=1, Hq=32, Hkv=8, D=128)")
    print(
        "legend: '<impl> ms' median per-call milliseconds; '<impl>/floor' its time over the floor's and "
        "'ort/ours' ONNX Runtime's time over ours (>1: ours faster), median [p10-p90] of per-round ratios; "
        "'floor GB/s' the floor's median rate"
    )
    print(
        table(
            ["dtype", "S"]
            + [f"{k} ms" for k in IMPLS]
            + [f"{k}/floor" for k in ("ours", "sdpa", "ort")]
            + ["ort/ours", "floor GB/s"],
            rows,
        )
    )
    print("\n".join(verdicts))

    cold, hot = per_call(evict, cfg["s1_rounds"], cfg["budget_s"], report)
    print("\nthe fixed cost: one float32 step at S=1, Python call to output")
    print(
        "legend: 'cold us' median [p10-p90] microseconds, each call after an eviction; 'hot us' per-round "
        "medians of 25 calls in a row; '/ort' the per-round ratio to ONNX Runtime's run_with_iobinding (cold)"
    )
    print(
        table(
            ["impl", "cold us", "hot us", "/ort"],
            [
                [
                    k,
                    fmt_spread(cold[k], 1e6),
                    fmt_spread(hot[k], 1e6),
                    fmt_spread(per_round_ratio(cold[k], cold["ort"])),
                ]
                for k in cold
            ],
        )
    )
    print(verdict_spread("float32 S=1 ours/ort per call (cold)", per_round_ratio(cold["ours"], cold["ort"]), 1.0))

    steps = cfg["consecutive"]
    rows, verdicts = [], []
    for cold in (False, True) if cfg["consecutive_cold"] else (False,):
        c = consecutive(steps, cfg["consecutive_rounds"], 2 * cfg["budget_s"], cold, evict, report)
        speedup = per_round_ratio(c["ort"], c["ours"])
        label = "cold (an eviction before each step)" if cold else "hot (one eviction before the loop)"
        rows.append([steps, label, spread(c["ours"])[0], spread(c["ort"])[0], fmt_spread(speedup)])
        verdicts.append(
            verdict_spread(
                f"{steps} consecutive steps, {label.partition(' ')[0]}, ort/ours (speedup)",
                speedup,
                CONSECUTIVE_TARGET,
                at_most=False,
            )
        )
    print(f"\n{steps} consecutive float32 steps from an empty cache, against ONNX Runtime's shared-buffer loop")
    print(
        "legend: 'ours s', 'ort s' median total seconds (the sum of the steps' times); 'ort/ours' per-round "
        "ratio, median [p10-p90] (>1: ours faster)"
    )
    print(table(["steps", "L3", "ours s", "ort s", "ort/ours"], rows))
    print("\n".join(verdicts))
