"""``OffloadedAttention``: a model switched to the ``gqa_serve`` attention until ``close()``.
It wraps ``generate`` and hooks forward calls so that each gets a ``ServedCache``, refuses (once
per layer) what the service does not compute, and collects the sequences of caches left to the
garbage collector."""

from __future__ import annotations

import functools
import itertools
import math
import threading

import torch

from ..client import Client
from .attention import ATTN_IMPLEMENTATION
from .cache import FORWARD_HEADROOM, ServedCache
from .plans import plan_layers, sliding_windows
from .sessions import ServedAttentionError, Sessions

__all__ = ["OffloadedAttention"]


class OffloadedAttention:
    """The handle ``offload_attention`` returns: the model's attention is on the service until
    ``close()`` (or the end of a ``with`` block), which restores the model as it was.
    ``stats`` sums what the service did (``ServedStats``); ``plans`` has a ``LayerPlan`` per
    layer and ``groups`` the sessions' layers."""

    def __init__(
        self,
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
    ):
        config = model.config.get_text_config(decoder=True)
        self.model = model
        self.num_query_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = dtype or model.dtype
        self.max_length = max_length
        self.plans = plan_layers(config, policy, window, sink_tokens, capacity)
        self._sliding = sliding_windows(config)
        self._owns_client = isinstance(target, str)
        self.client = Client(target) if self._owns_client else target
        self.address = target if isinstance(target, str) else getattr(target, "address", "the server")
        shape = dict(
            num_query_heads=self.num_query_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            backend=backend,
        )
        self.sessions = Sessions(self.client, self.address, self.plans, shape)
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._orphans: list[tuple[set, list[int]]] = []
        self._checked: set[int] = set()
        self._closed = False
        self._switch(model)

    @property
    def stats(self):
        return self.sessions.stats

    @property
    def groups(self):
        return self.sessions.groups

    def _switch(self, model) -> None:
        """Switches the model over; ``close`` puts back each piece."""
        self._original_attn = model.config._attn_implementation
        self._original_generate = model.__dict__.get("generate")
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        generate = model.generate
        model.generate = functools.wraps(generate)(functools.partial(self._generate, generate))
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self._generating = threading.local()

    # -- what the model calls -------------------------------------------------------------------
    def _generate(self, generate, *args, **kwargs):
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache") is False:
            return generate(*args, **kwargs)
        cache = self.new_cache(max_length=self.max_length or self._generation_length(args, kwargs))
        self._generating.value = True
        try:
            return generate(*args, past_key_values=cache, **kwargs)
        finally:
            self._generating.value = False
            cache.close()

    def _generation_length(self, args, kwargs) -> int:
        inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
        prompt = inputs.shape[1] if isinstance(inputs, torch.Tensor) else 0
        config = kwargs.get("generation_config") or self.model.generation_config
        new = kwargs.get("max_new_tokens", config.max_new_tokens)
        if new is not None:
            return prompt + new + 1
        return max(kwargs.get("max_length", config.max_length) or 0, prompt) + 1

    def _pre_forward(self, module, args, kwargs):
        """A forward call that would make a cache of its own gets a ``ServedCache`` instead."""
        if kwargs.get("past_key_values") is not None or getattr(self._generating, "value", False):
            return None
        if not kwargs.get("use_cache", getattr(self.model.config, "use_cache", False)):
            return None
        inputs = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs_embeds"))
        prompt = inputs.shape[1] if isinstance(inputs, torch.Tensor) else 0
        kwargs["past_key_values"] = self.new_cache(max_length=self.max_length or prompt + FORWARD_HEADROOM)
        return args, kwargs

    def _check_layer(self, module, query, scaling, dropout, kwargs) -> None:
        """Refuses, once per layer, what the service does not compute."""
        layer = module.layer_idx
        if layer in self._checked:
            return
        d = query.shape[-1]
        if (query.shape[1], d) != (self.num_query_heads, self.head_dim):
            raise NotImplementedError(
                f"gqa_serve: layer {layer} has {query.shape[1]} query heads of width {d}; "
                f"the sessions were opened for {self.num_query_heads} of width {self.head_dim}"
            )
        if scaling is not None and not math.isclose(scaling, d**-0.5, rel_tol=1e-6):
            raise NotImplementedError(f"gqa_serve: layer {layer} scales scores by {scaling}, not 1/sqrt(D) = {d**-0.5}")
        for name in ("softcap", "s_aux", "position_bias", "sinks"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"gqa_serve: layer {layer} uses {name!r}, which the service does not compute")
        if dropout:
            raise NotImplementedError("gqa_serve: attention dropout (training) is not supported")
        if not getattr(module, "is_causal", True):
            raise NotImplementedError(f"gqa_serve: layer {layer} is not causal")
        if kwargs.get("sliding_window") and self.plans[layer].policy == "none":
            raise NotImplementedError(
                f"gqa_serve: layer {layer} has a sliding window {kwargs['sliding_window']} the config does not declare"
            )
        self._checked.add(layer)

    # -- caches and their sequences -------------------------------------------------------------
    def new_cache(self, max_length: int | None = None) -> ServedCache:
        """An empty ``ServedCache`` for a forward call (``past_key_values=``): its full-attention
        layers hold ``max_length`` positions per sequence (default: the prompt plus
        ``FORWARD_HEADROOM``)."""
        if self._closed:
            raise ServedAttentionError("this OffloadedAttention was closed")
        self._collect_orphans()
        return ServedCache(self, max_length)

    def _new_ids(self, n: int) -> list[int]:
        with self._ids_lock:
            return [next(self._ids) for _ in range(n)]

    def _orphan(self, added: set[int], ids: list[int]) -> None:
        # From the garbage collector, possibly in the middle of a session call on this thread:
        # only noted here, removed by the next new_cache or close.
        if ids and added:
            self._orphans.append((added, ids))

    def _collect_orphans(self) -> None:
        while self._orphans:
            added, ids = self._orphans.pop()
            self.sessions.remove(added, ids)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Restores the model (attention implementation, ``generate``) and ends the sessions,
        which frees every sequence they hold."""
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        if self._original_generate is None:
            self.model.__dict__.pop("generate", None)
        else:
            self.model.generate = self._original_generate
        self.model.set_attn_implementation(self._original_attn)
        self.sessions.close()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "OffloadedAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
