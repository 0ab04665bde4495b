"""A transformers model decoding with its attention on gqa-serve, against the same model with sdpa.

- model: a random-weight Llama with real attention shapes (hidden 4096, Hq=32, Hkv=8, D=128,
  intermediate 1024, 2 layers, vocabulary 1000), float32, in this process with torch's default
  threads.
- served: the model with ``gqa_client.transformers.offload_attention`` (the integration as a user
  calls it, nothing special) on a ``gqa-serve serve`` of its own process (default configuration)
  on loopback: each token is one ``Batch`` step message per layer.
- local: the same model with transformers' ``sdpa`` attention and its default ``DynamicCache``.
- the context: random keys and values of S positions filled directly (no long prompt computed):
  ``ServedCache.load`` uploads them to the service (4 MiB messages), a ``DynamicCache`` holds them
  locally. Then each round decodes ``TOKENS`` tokens by forward calls, the two taking turns
  round after round; the figure is the per-token latency (median over rounds, p10-p90).
- the split of a served token: transport (round trips less the server's compute), the server's
  compute (``compute_ns`` of the step replies) and the local model (the rest: weights, norms,
  rotary, sampling), from the handle's ``ServedStats``.
- floor: the same local model over a 1-position context, taking turns with the other two: a
  token's weights, norms and sampling without its attention. No served token can cost less, so
  floor / local is the lowest served / local ratio this machine allows at that context; where it
  exceeds a target, the verdict line says so.
- memory: this process's resident set after each mode's first token above its size when the
  case began (the served context uploaded and dropped before the local one is made), so what an
  earlier case's local cache left in the allocator does not count.
- cases: batch 1 at S = 2048, 8192, 32768 and batch 8 at 2048, 8 tokens a round, 5 rounds (about
  a minute and a half on 2 quiet cores: with 3, one slow round of either mode moved a verdict);
  GQA_BENCH_MODE=long adds batch 8 at 8192 and decodes 32 tokens a round.

Targets (issue 25), batch 1, served / local per-token latency: <= 0.85x at S=2048, <= 0.35x at
8192, <= 0.15x at 32768.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import statistics
import time

import torch

from .common import bench_mode, fmt_spread, per_round_ratio, start_server, status, stop_server, table, verdict_spread

TARGETS = {2048: 0.85, 8192: 0.35, 32768: 0.15}


def settings(mode: str) -> dict:
    if mode == "smoke":
        shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=128)
        return dict(shape=shape, cases=[(64, 1), (128, 2)], tokens=2, rounds=2)
    shape = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=1024)
    if mode == "long":
        return dict(shape=shape, cases=[(2048, 1), (2048, 8), (8192, 1), (8192, 8), (32768, 1)], tokens=32, rounds=5)
    return dict(shape=shape, cases=[(2048, 1), (2048, 8), (8192, 1), (32768, 1)], tokens=8, rounds=5)


def build_model(shape: dict):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1000, num_hidden_layers=2, max_position_embeddings=65536, attn_implementation="sdpa", **shape
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
        model.model.rotary_emb.__init__(config)  # its buffers were on the meta device
    return model.eval()


def rss_bytes() -> int:
    """This process's resident set, after handing freed heap memory back (glibc keeps freed
    message buffers mapped otherwise: live memory, not the allocator's cache, is the figure)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def context(model, batch: int, length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    g = torch.Generator().manual_seed(seed)
    shape = (batch, c.num_key_value_heads, length, c.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(c.num_hidden_layers)]


def decode(model, cache, batch: int, tokens: int) -> list[float]:
    """Seconds of each of ``tokens`` forward calls of one token per sequence, cache passed along."""
    ids = torch.zeros((batch, 1), dtype=torch.long)
    times = []
    with torch.no_grad():
        for _ in range(tokens):
            t0 = time.perf_counter()
            out = model(ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return times


def local_cache(model, batch: int, length: int, seed: int):
    """transformers' own ``DynamicCache`` filled directly with ``length`` random positions."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(context(model, batch, length, seed)):
        cache.update(k, v, layer)
    return cache


def measure(model, address: str, length: int, batch: int, cfg: dict) -> dict:
    """One case: the served cache uploaded, then rounds of ``tokens`` tokens served, local and
    with the weights floor (the local model over a 1-position context: everything of a token
    but its attention), taking turns; per-round medians in seconds, memory in bytes."""
    from gqa_client.transformers import offload_attention

    tokens, rounds = cfg["tokens"], cfg["rounds"]
    load = os.getloadavg()[0]
    start_rss = rss_bytes()
    status(f"S={length} batch {batch}: filling the context")
    handle = offload_attention(model, address)
    served_cache = handle.new_cache(max_length=length + (rounds + 1) * tokens + 8)
    kv = context(model, batch, length, seed=length + batch)
    started = time.perf_counter()
    served_cache.load(kv)
    upload_s = time.perf_counter() - started
    del kv
    decode(model, served_cache, batch, 1)  # warm-up
    served_rss = rss_bytes() - start_rss
    model.set_attn_implementation("sdpa")  # the same model, its own attention and cache
    caches = {"local": local_cache(model, batch, length, length + batch + 1), "floor": local_cache(model, batch, 1, 0)}
    decode(model, caches["local"], batch, 1)  # warm-up
    local_rss = rss_bytes() - start_rss
    r = dict(served_s=[], local_s=[], floor_s=[], transport_s=[], server_s=[], model_s=[])
    for i in range(rounds):
        status(f"S={length} batch {batch}: round {i + 1}/{rounds}")
        handle.stats.reset()
        model.set_attn_implementation("gqa_serve")
        s = statistics.median(decode(model, served_cache, batch, tokens))
        st = handle.stats
        per = st.tokens or 1
        r["served_s"].append(s)
        r["server_s"].append(st.server_ns / per * 1e-9)
        r["transport_s"].append((st.round_trip_ns - st.server_ns) / per * 1e-9)
        r["model_s"].append(s - st.round_trip_ns / per * 1e-9)
        model.set_attn_implementation("sdpa")
        for kind in ("local", "floor") if i % 2 == 0 else ("floor", "local"):
            r[f"{kind}_s"].append(statistics.median(decode(model, caches[kind], batch, tokens)))
    served_cache.close()
    handle.close()
    ratio = per_round_ratio(r["served_s"], r["local_s"])
    floor_ratio = per_round_ratio(r["floor_s"], r["local_s"])
    return dict(
        S=length,
        batch=batch,
        tokens=tokens,
        **r,
        ratio=ratio,
        floor_ratio=floor_ratio,
        served_rss_bytes=served_rss,
        local_rss_bytes=local_rss,
        upload_s=upload_s,
        load_average=[load, os.getloadavg()[0]],
    )


HEADERS = [
    "S",
    "B",
    "local ms/token",
    "served ms/token",
    "served/local",
    "transport ms",
    "server ms",
    "model ms",
    "floor ms",
    "floor/local",
    "served MiB",
    "local MiB",
    "upload s",
]
LEGEND = (
    "legend: per-token latency, median [p10-p90] over rounds of {tokens} tokens; served = attention on "
    "gqa-serve (one Batch step message per layer), local = transformers sdpa + DynamicCache; transport = "
    "round trips less the server's compute; model = the rest of a served token (weights, norms, sampling); "
    "floor = the local model over a 1-position context (a token without its attention: no served token can "
    "cost less), floor/local the lowest served/local ratio this machine allows; MiB = this process's "
    "resident set after the first token above its size before the case (served: the context uploaded and "
    "dropped); upload = ServedCache.load of the context"
)


def row(rec: dict) -> list:
    m = statistics.median
    return [
        rec["S"],
        rec["batch"],
        fmt_spread(rec["local_s"], 1e3),
        fmt_spread(rec["served_s"], 1e3),
        fmt_spread(rec["ratio"]),
        f"{m(rec['transport_s']) * 1e3:.1f}",
        f"{m(rec['server_s']) * 1e3:.1f}",
        f"{m(rec['model_s']) * 1e3:.1f}",
        f"{m(rec['floor_s']) * 1e3:.1f}",
        f"{m(rec['floor_ratio']):.3g}",
        f"{rec['served_rss_bytes'] / 2**20:.0f}",
        f"{rec['local_rss_bytes'] / 2**20:.0f}",
        f"{rec['upload_s']:.2f}",
    ]


def verdicts(rec: dict, mode: str) -> list[str]:
    length, batch = rec["S"], rec["batch"]
    if batch != 1:
        return []
    if length not in TARGETS:
        if mode != "smoke":
            return []
        return [verdict_spread(f"batch 1 S={length}: served / local per token (smoke)", rec["ratio"], 1.0)]
    target = TARGETS[length]
    lines = [verdict_spread(f"batch 1 S={length}: served / local per token", rec["ratio"], target)]
    floor = statistics.median(rec["floor_ratio"])
    if floor > target:
        lines.append(
            f"      the model without its attention already costs {floor:.3g}x local here (floor/local): "
            f"<= {target}x is out of reach on this machine as measured"
        )
    return lines


def run(report) -> None:
    mode = bench_mode()
    cfg = settings(mode)
    status("building the model")
    model = build_model(cfg["shape"])
    proc, address = start_server(["-m", "service.cli", "serve"])
    rows, lines = [], []
    try:
        for length, batch in cfg["cases"]:
            rec = measure(model, address, length, batch, cfg)
            gc.collect()
            report.add(**rec)
            rows.append(row(rec))
            lines += verdicts(rec, mode)
    finally:
        stop_server(proc)
    print(table(HEADERS, rows))
    print(LEGEND.format(tokens=cfg["tokens"]))
    loads = [x for rec in report.records for x in rec["load_average"]]
    print(
        f"load average (1 min) during the cases: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores. "
        "Above the core count, contention flatters served/local: a process that blocks on its server "
        "every layer is favoured by the scheduler over one that computes throughout."
    )
    for line in lines:
        print(line)
