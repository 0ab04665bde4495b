"""The ``gqa_serve`` attention and mask functions, registered with transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` when this module is imported.

Every model written against ``AttentionInterface`` calls ``past_key_values.update(k, v, layer)``
and then the attention function for the same layer; ``ServedCache.update`` leaves its cache
here (``pending``, per thread), so the attention function finds it (it is not among its
arguments)."""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

__all__ = ["ATTN_IMPLEMENTATION", "pending"]

ATTN_IMPLEMENTATION = "gqa_serve"

# The layer whose ``ServedCache.update`` ran last on this thread: (cache, layer, is_prompt).
pending = threading.local()


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The ``gqa_serve`` attention function: query (B, Hq, q, D), key and value (B, Hkv, q', D);
    returns (B, q, Hq, D). Without a ``ServedCache`` (``use_cache=False``, or a cache of
    another kind) the attention is computed locally, with ``sdpa``."""
    noted = getattr(pending, "value", None)
    pending.value = None
    if noted is None or noted[1] != module.layer_idx:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cache, layer, prompt = noted
    cache.handle._check_layer(module, query, scaling, dropout, kwargs)
    if prompt:
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        cache._prompt_done(layer, key, value, attention_mask)
        return out
    return cache._decode(layer, query, key, value), None


def mask(*args, q_offset=0, q_length=1, attention_mask=None, **kwargs):
    """The ``gqa_serve`` mask function: ``sdpa``'s for a prompt (the cache is empty); none for
    later tokens, which the service attends to by the sequences' policies, after checking
    that none of them is padding."""
    if isinstance(q_offset, torch.Tensor):
        q_offset = int(q_offset)
    if q_offset == 0:
        return sdpa_mask(*args, q_offset=q_offset, q_length=q_length, attention_mask=attention_mask, **kwargs)
    if attention_mask is not None:
        new = attention_mask[:, q_offset : q_offset + q_length]
        if new.shape[-1] == q_length and not bool(new.all()):
            raise NotImplementedError(
                "gqa_serve: the attention mask pads out tokens after the prompt; only the prompt may be padded"
            )
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, mask)
