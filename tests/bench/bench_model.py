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
- memory: this process's resident set above the loaded model's, after each mode's first token
  (the served context uploaded and dropped before the local one is made).
- cases: batch 1 at S = 2048, 8192, 32768 and batch 8 at 2048, 8 tokens a round, 3 rounds (about
  a minute on 2 quiet cores); GQA_BENCH_MODE=long adds batch 8 at 8192 and decodes 32 tokens a
  round in 5 rounds.

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
    return dict(shape=shape, cases=[(2048, 1), (2048, 8), (8192, 1), (32768, 1)], tokens=8, rounds=3)


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


def run(report) -> None:
    from transformers import DynamicCache

    from gqa_client.transformers import offload_attention

    mode = bench_mode()
    cfg = settings(mode)
    status("building the model")
    model = build_model(cfg["shape"])
    baseline = rss_bytes()
    proc, address = start_server(["-m", "service.cli", "serve"])
    rows, lines = [], []
    try:
        for length, batch in cfg["cases"]:
            tokens, rounds = cfg["tokens"], cfg["rounds"]
            status(f"S={length} batch {batch}: filling the context")
            handle = offload_attention(model, address)
            served_cache = handle.new_cache(max_length=length + (rounds + 1) * tokens + 8)
            kv = context(model, batch, length, seed=length + batch)
            started = time.perf_counter()
            served_cache.load(kv)
            upload_s = time.perf_counter() - started
            del kv
            decode(model, served_cache, batch, 1)  # warm-up
            served_rss = rss_bytes() - baseline
            model.set_attn_implementation("sdpa")  # the same model, its own attention and cache
            local_cache = DynamicCache(config=model.config)
            for layer, (k, v) in enumerate(context(model, batch, length, seed=length + batch + 1)):
                local_cache.update(k, v, layer)
            decode(model, local_cache, batch, 1)  # warm-up
            local_rss = rss_bytes() - baseline

            served_t, local_t, transport, server, model_s = [], [], [], [], []
            for r in range(rounds):
                status(f"S={length} batch {batch}: round {r + 1}/{rounds}")
                handle.stats.reset()
                model.set_attn_implementation("gqa_serve")
                s = statistics.median(decode(model, served_cache, batch, tokens))
                st = handle.stats
                per = st.tokens or 1
                served_t.append(s)
                server.append(st.server_ns / per * 1e-9)
                transport.append((st.round_trip_ns - st.server_ns) / per * 1e-9)
                model_s.append(s - st.round_trip_ns / per * 1e-9)
                model.set_attn_implementation("sdpa")
                local_t.append(statistics.median(decode(model, local_cache, batch, tokens)))
            served_cache.close()
            handle.close()
            del local_cache, served_cache

            ratio = per_round_ratio(served_t, local_t)
            rows.append(
                [
                    length,
                    batch,
                    fmt_spread(local_t, 1e3),
                    fmt_spread(served_t, 1e3),
                    fmt_spread(ratio),
                    f"{statistics.median(transport) * 1e3:.1f}",
                    f"{statistics.median(server) * 1e3:.1f}",
                    f"{statistics.median(model_s) * 1e3:.1f}",
                    f"{served_rss / 2**20:.0f}",
                    f"{local_rss / 2**20:.0f}",
                    f"{upload_s:.2f}",
                ]
            )
            report.add(
                S=length,
                batch=batch,
                tokens=tokens,
                local_s=local_t,
                served_s=served_t,
                ratio=ratio,
                transport_s=transport,
                server_s=server,
                model_s=model_s,
                served_rss_bytes=served_rss,
                local_rss_bytes=local_rss,
                upload_s=upload_s,
            )
            if batch == 1 and length in TARGETS:
                lines.append(verdict_spread(f"batch 1 S={length}: served / local per token", ratio, TARGETS[length]))
            elif mode == "smoke" and batch == 1:
                lines.append(verdict_spread(f"batch 1 S={length}: served / local per token (smoke)", ratio, 1.0))
    finally:
        stop_server(proc)
    print(
        table(
            [
                "S",
                "B",
                "local ms/token",
                "served ms/token",
                "served/local",
                "transport ms",
                "server ms",
                "model ms",
                "served MiB",
                "local MiB",
                "upload s",
            ],
            rows,
        )
    )
    print(
        "legend: per-token latency, median [p10-p90] over rounds of "
        f"{cfg['tokens']} tokens; served = attention on gqa-serve (one Batch "
        "step message per layer), local = transformers sdpa + DynamicCache; transport = round trips less "
        "the server's compute; model = the rest of a served token (weights, norms, sampling); MiB = this "
        "process's resident set above the loaded model after the decode; upload = ServedCache.load of the context"
    )
    for line in lines:
        print(line)
