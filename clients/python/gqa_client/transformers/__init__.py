"""A Hugging Face transformers model with its attention and KV cache on gqa-serve.

    import transformers
    from gqa_client.transformers import offload_attention

    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    with offload_attention(model, "127.0.0.1:50051") as served:
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
        print(served.stats)   # steps sent, round trips, the server's compute

``offload_attention`` registers an attention implementation (``gqa_serve``) with transformers'
``AttentionInterface`` and switches the model to it, so that every attention layer of every
``generate`` (and every forward call with a cache) runs on the service:

* **The prompt** is computed locally, as the model would, with transformers' ``sdpa``
  attention and the model's own masks; each sequence's keys (after the rotary embedding) and
  values are then uploaded once per layer (``BatchAdd.prefill``, split into messages of 4 MiB at
  most), without the positions the attention mask pads out (left padding is exact).
* **Each decode step** sends one ``Batch`` step message per layer carrying the query, key and
  value of the new token of every sequence of the batch; the server appends them to the
  sequences' caches and returns the attention output. The process keeps no keys or values.
* **Layers**: every layer is one layer of a ``Batch`` session; layers that share a policy share
  a session (a Qwen2 model mixing full and sliding layers has two). Full-attention layers are
  ``none`` (room for the generation's ``max_length`` tokens); sliding-window layers are
  ``strict`` with W = ``config.sliding_window`` (transformers' window counts the new token,
  like gqa-serve's). ``policy="greedy"`` or ``"sink"`` chooses another policy for the model.
* **Lifetime**: ``generate`` removes its sequences from the service when it returns or fails; a
  cache made for a forward call frees its sequences when it is closed or garbage; ``close()``
  (or leaving the ``with``) restores the model and ends the sessions.

The service computes ``softmax(q . k / sqrt(D)) v`` over the cache: a model whose attention
uses another scale, logit soft-capping, ALiBi or another position bias, attention sinks, or
layer kinds other than full and sliding attention is refused with ``NotImplementedError``.
docs/integrations.md has the mapping, the limits and what a token costs.
"""

from __future__ import annotations

import torch

from .attention import ATTN_IMPLEMENTATION
from .cache import FORWARD_HEADROOM, ServedCache
from .handle import OffloadedAttention
from .plans import POLICIES, LayerPlan
from .sessions import ServedAttentionError, ServedStats

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FORWARD_HEADROOM",
    "POLICIES",
    "LayerPlan",
    "OffloadedAttention",
    "ServedAttentionError",
    "ServedCache",
    "ServedStats",
    "offload_attention",
]


def offload_attention(
    model,
    target,
    *,
    policy: str | None = None,
    window: int | None = None,
    sink_tokens: int = 4,
    capacity: int | None = None,
    max_length: int | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "",
) -> OffloadedAttention:
    """Puts every attention layer of ``model`` (a transformers causal LM whose attention goes
    through ``AttentionInterface``: Llama, Mistral, Qwen2, Qwen3...) on the gqa-serve at
    ``target`` (an address, or a ``Client``) until the returned handle is closed.

    ``policy``: ``None`` keeps the model's semantics (full-attention layers keep everything,
    sliding-window layers are ``strict`` with the model's window); ``"strict"``, ``"greedy"`` or
    ``"sink"`` apply that policy to the sliding layers with their window and to the
    full-attention layers with ``window`` (required then). ``sink_tokens``: the sinks of
    ``"sink"``; ``capacity``: greedy's C (default 2 W). ``max_length``: positions a
    full-attention layer holds per sequence (default: ``generate``'s max_length, or a forward
    call's prompt plus ``FORWARD_HEADROOM``). ``dtype``: the sessions' dtype (default the
    model's; float32, bfloat16 or float16); ``backend``: the server's backend (``"int8"`` for
    int8 caches; default the server's)."""
    return OffloadedAttention(
        model,
        target,
        policy=policy,
        window=window,
        sink_tokens=sink_tokens,
        capacity=capacity,
        max_length=max_length,
        dtype=dtype,
        backend=backend,
    )
