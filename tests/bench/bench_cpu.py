"""CPU decode-step latency: our backend beside the usual alternatives and the memory floor.

One step at B=1, Hq=32, Hkv=8, D=128 over S cached tokens, each implementation including its
append of the new token:

- ``ours``: ``DenseCache.step`` (policy none; validation, ring write, attention).
- ``naive``: ``torch.cat`` of the new row onto the cache, ``repeat_interleave`` of K/V to the
  query heads, matmul, softmax (float32), matmul, all in the cache dtype.
- ``sdpa``: a preallocated (B, Hkv, C, D) cache, the row written in place, then
  ``scaled_dot_product_attention(enable_gqa=True)`` over the first S+1 rows.
- ``ort``: ONNX Runtime's ``com.microsoft.GroupQueryAttention`` (CPU), one-node model, past and
  present K/V bound to the same buffer so it appends in place. It has no bfloat16 CPU kernel.
- ``floor``: the time to read the same K and V bytes once: ``sum()`` over contiguous
  (B, Hkv, S+1, D) tensors, their bytes viewed as float32 words, so that a half-precision cache
  is charged for its bytes and not for a slow half-precision reduction.

Ratios are to the floor and to ONNX Runtime, medians measured side by side in one run (the
machine is shared, so absolute numbers move; ratios within one run are what to compare).
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from backends.base import CacheSpec
from backends.cpu import DenseCache
from backends.policy import EvictionPolicy

from .common import Report, median_seconds, table

B, HQ, HKV, D = 1, 32, 8, 128
G = HQ // HKV
LENGTHS = (512, 2048, 8192, 32768)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADROOM = 64  # rows beyond S: each timed step appends one token
CONSECUTIVE = 2048
IMPLS = ("ours", "naive", "sdpa", "ort", "floor")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _interleaved(fns: dict, rounds: int = 15, budget_s: float = 4.0) -> dict[str, float]:
    """Median seconds of each function, called round-robin so that all of them see the same
    machine load and the same cache state (each evicts the others' bytes from L3, as the other
    layers of a real model would), within ``budget_s`` (at least 3 rounds)."""
    for fn in fns.values():
        median_seconds(fn, repeat=1, warmup=1, budget_s=budget_s)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.perf_counter() + budget_s
    for i in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > deadline:
            break
    return {name: statistics.median(t) for name, t in samples.items()}


# -- the implementations --------------------------------------------------------------------


def naive_step(q, k_cache, v_cache, new_k, new_v):
    """What one writes first: grow the cache by concatenation, repeat K/V per query head."""
    k_cache = torch.cat([k_cache, new_k.unsqueeze(2)], dim=2)
    v_cache = torch.cat([v_cache, new_v.unsqueeze(2)], dim=2)
    k = k_cache.repeat_interleave(G, dim=1)
    v = v_cache.repeat_interleave(G, dim=1)
    scores = (q.unsqueeze(2) @ k.transpose(2, 3)) * (1.0 / math.sqrt(D))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).squeeze(2), k_cache, v_cache


def _ours(dtype, keys, values, capacity):
    spec = CacheSpec(B, HQ, HKV, D, dtype, EvictionPolicy.none(capacity))
    cache = DenseCache(spec)
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
    """One GroupQueryAttention node; the past buffer is also the present one (in-place append)."""

    def __init__(self, keys, values, capacity):
        import onnx
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
        self.session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        s = keys.shape[2]
        k = np.zeros((B, HKV, capacity, D), dtype=self.np_dtype)
        v = np.zeros_like(k)
        k[:, :, :s] = keys.numpy()
        v[:, :, :s] = values.numpy()
        self.k = ort.OrtValue.ortvalue_from_numpy(k)
        self.v = ort.OrtValue.ortvalue_from_numpy(v)
        self.out = ort.OrtValue.ortvalue_from_numpy(np.zeros((B, 1, HQ * D), dtype=self.np_dtype))
        self.ort = ort
        self.s = s
        binding = self.session.io_binding()
        binding.bind_ortvalue_input("past_key", self.k)
        binding.bind_ortvalue_input("past_value", self.v)
        binding.bind_ortvalue_output("present_key", self.k)
        binding.bind_ortvalue_output("present_value", self.v)
        binding.bind_ortvalue_output("output", self.out)
        binding.bind_cpu_input("seqlens_k", np.array([s] * B, dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(s + 1, dtype=np.int32))
        self.binding = binding

    def bind_step(self, q, new_k, new_v):
        """Binds the step's inputs once (their conversion is not the kernel's cost)."""
        b = self.binding
        b.bind_cpu_input("query", np.ascontiguousarray(q.reshape(B, 1, HQ * D).numpy()))
        b.bind_cpu_input("key", np.ascontiguousarray(new_k.reshape(B, 1, HKV * D).numpy()))
        b.bind_cpu_input("value", np.ascontiguousarray(new_v.reshape(B, 1, HKV * D).numpy()))

    def __call__(self):
        self.session.run_with_iobinding(self.binding)

    def output(self) -> torch.Tensor:
        return torch.from_numpy(self.out.numpy().reshape(B, HQ, D).copy())


def _floor_fn(keys, values, new_k, new_v):
    # The same S+1 rows of K and V, contiguous, read once as float32 words.
    k = torch.cat([keys, new_k.unsqueeze(2)], dim=2).contiguous().view(-1).view(torch.float32)
    v = torch.cat([values, new_v.unsqueeze(2)], dim=2).contiguous().view(-1).view(torch.float32)
    return lambda: (k.sum(), v.sum())


# -- the runs -------------------------------------------------------------------------------


def _inputs(s, dtype, gen):
    keys = torch.randn((B, HKV, s, D), generator=gen).to(dtype)
    values = torch.randn((B, HKV, s, D), generator=gen).to(dtype)
    q = torch.randn((B, HQ, D), generator=gen).to(dtype)
    nk = torch.randn((B, HKV, D), generator=gen).to(dtype)
    nv = torch.randn((B, HKV, D), generator=gen).to(dtype)
    return keys, values, q, nk, nv


def check_ort_matches_ours() -> None:
    """A broken ONNX Runtime column must not print: its output must equal ours on one case."""
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        keys, values, q, nk, nv = _inputs(300, dtype, gen)
        ours = _ours(dtype, keys, values, 300 + HEADROOM).step(q, nk, nv).output.float()
        ort_step = ORTStep(keys, values, 300 + HEADROOM)
        ort_step.bind_step(q, nk, nv)
        ort_step()
        theirs = ort_step.output().float()
        err = ((theirs - ours).abs().max() / ours.abs().max()).item()
        assert err < tol, f"ONNX Runtime GroupQueryAttention differs from ours ({_name(dtype)}): {err:.2e}"


def measure(s, dtype, gen, report) -> dict[str, float]:
    keys, values, q, nk, nv = _inputs(s, dtype, gen)
    capacity = s + HEADROOM
    cache = _ours(dtype, keys, values, capacity)
    sdpa = SDPAStep(keys, values, capacity)
    fns = {
        "ours": lambda: cache.step(q, nk, nv),
        "naive": lambda: naive_step(q, keys, values, nk, nv),
        "sdpa": lambda: sdpa(q, nk, nv),
    }
    if dtype in (torch.float32, torch.float16):
        ort_step = ORTStep(keys, values, capacity)
        ort_step.bind_step(q, nk, nv)
        fns["ort"] = ort_step
    fns["floor"] = _floor_fn(keys, values, nk, nv)
    times = _interleaved(fns, budget_s=2.0 if s < 8192 else 5.0)
    times.setdefault("ort", float("nan"))
    kv_bytes = 2 * B * HKV * (s + 1) * D * keys.element_size()
    report.add(kind="step", dtype=_name(dtype), S=s, kv_bytes=kv_bytes,
               **{f"{k}_s": (None if v != v else v) for k, v in times.items()})
    return times


def consecutive(dtype, report) -> tuple[float, float]:
    """Total seconds of CONSECUTIVE steps from an empty cache: ours, then naive."""
    gen = torch.Generator().manual_seed(2)
    qs = torch.randn((CONSECUTIVE, B, HQ, D), generator=gen).to(dtype)
    ks = torch.randn((CONSECUTIVE, B, HKV, D), generator=gen).to(dtype)
    vs = torch.randn((CONSECUTIVE, B, HKV, D), generator=gen).to(dtype)
    cache = DenseCache(CacheSpec(B, HQ, HKV, D, dtype, EvictionPolicy.none(CONSECUTIVE)))
    t0 = time.perf_counter()
    for i in range(CONSECUTIVE):
        cache.step(qs[i], ks[i], vs[i])
    ours = time.perf_counter() - t0
    k_cache = torch.empty((B, HKV, 0, D), dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    t0 = time.perf_counter()
    for i in range(CONSECUTIVE):
        _, k_cache, v_cache = naive_step(qs[i], k_cache, v_cache, ks[i], vs[i])
    naive = time.perf_counter() - t0
    report.add(kind="consecutive", dtype=_name(dtype), steps=CONSECUTIVE, ours_s=ours, naive_s=naive)
    return ours, naive


def per_call(report) -> list[object]:
    """Per-call overhead at S=1 (float32), microseconds. Ours runs a strict window of 2, so it
    stays at S=1; SDPA and ONNX Runtime append into a buffer and grow by one per call (at most
    a few thousand calls: still tiny, and it can only flatter them)."""
    gen = torch.Generator().manual_seed(3)
    keys, values, q, nk, nv = _inputs(1, torch.float32, gen)
    cache = DenseCache(CacheSpec(B, HQ, HKV, D, torch.float32, EvictionPolicy.strict(2)))
    cache.prefill(keys, values)
    sdpa = SDPAStep(keys, values, 1 + 4096)
    ort_step = ORTStep(keys, values, 1 + 4096)
    ort_step.bind_step(q, nk, nv)
    times = {
        "ours": median_seconds(lambda: cache.step(q, nk, nv), repeat=2000, warmup=50, budget_s=0.5),
        "naive": median_seconds(lambda: naive_step(q, keys, values, nk, nv), repeat=2000, warmup=50, budget_s=0.5),
        "sdpa": median_seconds(lambda: sdpa(q, nk, nv), repeat=2000, warmup=50, budget_s=0.5),
        "ort": median_seconds(ort_step, repeat=2000, warmup=50, budget_s=0.5),
    }
    report.add(kind="per_call", dtype="float32", S=1, **{f"{k}_s": v for k, v in times.items()})
    return ["float32", 1] + [times[k] * 1e6 for k in ("ours", "naive", "sdpa", "ort")]


def run(report: Report) -> None:
    check_ort_matches_ours()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in DTYPES:
        for s in LENGTHS:
            t = measure(s, dtype, gen, report)
            f, o = t["floor"], t["ort"]
            rows.append(
                [_name(dtype), s]
                + [t[k] * 1e3 for k in IMPLS]
                + [t[k] / f for k in IMPLS[:4]]
                + [t[k] / o for k in IMPLS[:3]]
            )
            print(f"  {_name(dtype)} S={s} done", flush=True)
    print("\nper-step latency, medians in ms (B=1, Hq=32, Hkv=8, D=128); x = ratio")
    print(table(
        ["dtype", "S"] + [f"{k} ms" for k in IMPLS] + [f"{k}/floor" for k in IMPLS[:4]]
        + [f"{k}/ort" for k in IMPLS[:3]],
        rows,
    ))
    print(f"\nper call at S=1, us")
    print(table(["dtype", "S", "ours", "naive", "sdpa", "ort"], [per_call(report)]))
    rows = []
    for dtype in (torch.float32,):
        ours, naive = consecutive(dtype, report)
        rows.append([_name(dtype), CONSECUTIVE, ours, naive, naive / ours])
    print(f"\n{CONSECUTIVE} consecutive steps from an empty cache, total seconds")
    print(table(["dtype", "steps", "ours s", "naive s", "naive/ours"], rows))
