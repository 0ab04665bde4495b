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

import functools
import itertools
import math
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .client import Client
from .errors import CallFailed, Refused

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LayerPlan",
    "OffloadedAttention",
    "ServedAttentionError",
    "ServedCache",
    "ServedStats",
    "offload_attention",
]

ATTN_IMPLEMENTATION = "gqa_serve"
# A cache made for a plain forward call (no ``generate`` to say how long it runs) holds the
# prompt plus this many tokens in its full-attention layers, unless ``max_length`` says more.
FORWARD_HEADROOM = 256
POLICIES = ("strict", "greedy", "sink")


class ServedAttentionError(RuntimeError):
    """The service failed or refused a step or an upload. ``code`` is the gRPC status code's
    name (``"UNAVAILABLE"``, ``"RESOURCE_EXHAUSTED"``...)."""

    def __init__(self, message: str, code: str = "UNKNOWN"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class LayerPlan:
    """How one model layer is served: its policy (``none``, ``strict``, ``greedy``, ``sink``),
    W (0 for ``none``), the sink tokens and greedy's capacity C; ``group`` is the session
    (layers with the same plan share one) and ``index`` the layer's index in it."""

    layer: int
    policy: str
    window: int
    sinks: int
    capacity: int
    group: int
    index: int


@dataclass
class ServedStats:
    """What the service did for this handle, summed: ``messages`` step messages sent (one per
    layer per token), ``tokens`` decode tokens (per sequence, all layers), ``round_trip_ns``
    their round trips as this process saw them, ``server_ns`` the server's compute in them,
    ``uploaded_bytes`` the prompts' keys and values sent."""

    messages: int = 0
    tokens: int = 0
    round_trip_ns: int = 0
    server_ns: int = 0
    uploaded_bytes: int = 0

    def reset(self) -> None:
        self.messages = self.tokens = self.round_trip_ns = self.server_ns = self.uploaded_bytes = 0


# The layer whose ``ServedCache.update`` ran last on this thread: every model following
# transformers' attention pattern calls ``update`` and then the attention function, for the same
# layer, so the attention function finds its cache here (it is not among its arguments).
_PENDING = threading.local()


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The ``gqa_serve`` attention function: query (B, Hq, q, D), key and value (B, Hkv, q', D);
    returns (B, q, Hq, D). Without a ``ServedCache`` (``use_cache=False``, or a cache of
    another kind) the attention is computed locally, with ``sdpa``."""
    pending = getattr(_PENDING, "value", None)
    _PENDING.value = None
    if pending is None or pending[1] != module.layer_idx:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cache, layer, prompt = pending
    cache.handle._check_layer(module, query, scaling, dropout, kwargs)
    if prompt:
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        cache._prompt_done(layer, key, value, attention_mask)
        return out
    return cache._decode(layer, query, key, value), None


def _mask(*args, q_offset=0, q_length=1, attention_mask=None, **kwargs):
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


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _mask)


class _ServedLayer(CacheLayerMixin):
    """One model layer of a ``ServedCache``: how many positions (padding included, as
    transformers counts them) it has seen. Its keys and values live on the service."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, sliding_window: int | None):
        super().__init__()
        self.is_sliding = sliding_window is not None
        self.seen = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("a ServedCache is updated as a whole (ServedCache.update)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a ServedCache cannot be reset; close it and make another")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("gqa_serve: beam search is not supported (its caches would be copied per beam)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("gqa_serve: cropping a served cache is not supported (assisted decoding)")


class _Group:
    """One ``Batch`` session: the layers sharing a plan, and the lock its calls take."""

    def __init__(self, plan: LayerPlan, layers: list[int]):
        self.plan = plan
        self.layers = layers
        self.session = None
        self.lock = threading.Lock()


class ServedCache(Cache):
    """A transformers ``Cache`` whose keys and values are held by gqa-serve: one sequence per
    batch row in each of the handle's sessions, added by the first forward call (the prompt)
    or by ``load``. ``close()`` removes the sequences (``generate`` does it for the caches it
    makes; a cache left to the garbage collector is removed by the handle later)."""

    def __init__(self, handle: "OffloadedAttention", max_length: int | None):
        super().__init__(layers=[_ServedLayer(w) for w in handle._sliding])
        self.handle = handle
        self.max_length = max_length
        self.ids: list[int] | None = None
        self.closed = False
        self._prompt: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._real: torch.Tensor | None = None  # (B, prompt) True for the positions that are not padding
        self._added: set[int] = set()  # groups whose sequences are on the service
        self._finalizer = weakref.finalize(self, handle._orphan, self._added, [])

    # -- transformers' Cache interface ---------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.closed:
            raise ServedAttentionError("this ServedCache was closed: its sequences are no longer on the service")
        layer = self.layers[layer_idx]
        batch = key_states.shape[0]
        if self.ids is None:
            self.ids = self.handle._new_ids(batch)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, self.handle._orphan, self._added, list(self.ids))
        elif batch != len(self.ids):
            raise ValueError(f"gqa_serve: the cache holds {len(self.ids)} sequences, this call has a batch of {batch}")
        prompt = layer.seen == 0 and self.handle.plans[layer_idx].group not in self._added
        layer.seen += key_states.shape[2]
        _PENDING.value = (self, layer_idx, prompt)
        return key_states, value_states

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.ids is not None:
            raise NotImplementedError("gqa_serve: a served cache cannot be repeated along the batch")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("gqa_serve: a served cache cannot select batch rows")

    # -- the prompt ----------------------------------------------------------------------------
    def _prompt_done(self, layer: int, key: torch.Tensor, value: torch.Tensor, mask) -> None:
        """Called by the attention function once the prompt's attention of ``layer`` is
        computed; the keys wait for the last layer of their session, then go in one upload."""
        if self._real is None:
            b, _, n, _ = key.shape
            if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.shape[-2:] == (n, n):
                # A position is padding exactly when it may not attend to itself.
                self._real = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1).to("cpu")
            else:
                self._real = torch.ones(b, n, dtype=torch.bool)
        self._prompt[layer] = (key, value)
        group = self.handle.groups[self.handle.plans[layer].group]
        if layer == group.layers[-1]:
            self._upload(group, {i: self._prompt.pop(m) for i, m in enumerate(group.layers)}, self._real)

    def load(self, layers) -> None:
        """Fills an empty cache with a context computed elsewhere: ``layers`` holds, per model
        layer, (keys, values) of shape (B, Hkv, S, D) after the rotary embedding, oldest
        first (a ``DynamicCache`` works: it iterates so). The next forward call continues
        after them at position S."""
        layers = [(k, v) for k, v, *_ in layers]
        if len(layers) != len(self.layers) or self.ids is not None:
            raise ValueError(f"load: expected an empty cache and {len(self.layers)} layers, got {len(layers)}")
        batch, _, n, _ = layers[0][0].shape
        self.ids = self.handle._new_ids(batch)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, self.handle._orphan, self._added, list(self.ids))
        real = torch.ones(batch, n, dtype=torch.bool)
        for group in self.handle.groups:
            self._upload(group, {i: layers[m] for i, m in enumerate(group.layers)}, real)
        for layer in self.layers:
            layer.seen = n

    def _upload(self, group: _Group, keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]], real) -> None:
        plan, handle = group.plan, self.handle
        prompt = real.shape[1]
        capacity = 0
        if plan.policy == "none":
            capacity = prompt + FORWARD_HEADROOM if self.max_length is None else self.max_length
            if capacity < prompt:
                raise ValueError(
                    f"gqa_serve: max_length={self.max_length} is shorter than the prompt ({prompt} positions)"
                )
        elif plan.policy == "greedy":
            capacity = plan.capacity
        dense = bool(real.all())
        self._added.add(plan.group)  # before the adds: close() removes whichever got in
        for row, sid in enumerate(self.ids):
            keep = None if dense else real[row].nonzero().squeeze(1)
            prefill = {}
            for index, (k, v) in keys_values.items():
                k, v = k[row : row + 1], v[row : row + 1]
                if keep is not None:
                    k, v = k[:, :, keep.to(k.device)], v[:, :, keep.to(v.device)]
                prefill[index] = (k.detach().to("cpu", handle.dtype), v.detach().to("cpu", handle.dtype))
                handle.stats.uploaded_bytes += 2 * prefill[index][0].numel() * prefill[index][0].element_size()
            with group.lock:
                session = handle._session(group)
                try:
                    session.add(
                        sid,
                        policy=plan.policy,
                        window=plan.window,
                        capacity=capacity,
                        sink_tokens=plan.sinks,
                        prefill=prefill,
                    )
                except CallFailed as exc:
                    handle._broken(group)
                    raise _failed(exc, f"uploading the prompt of sequence {sid}", handle.address) from None
                except Refused as exc:  # in-band: budget, limits, configuration
                    raise ServedAttentionError(
                        f"gqa-serve refused sequence {sid} (layers {group.layers}): {exc.message}", exc.code.name
                    ) from None

    # -- decode steps --------------------------------------------------------------------------
    def _decode(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One step message per new token: (B, Hq, q, D), (B, Hkv, q, D) x2 -> (B, q, Hq, D)."""
        handle = self.handle
        plan = handle.plans[layer]
        group = handle.groups[plan.group]
        dtype = handle.dtype
        outputs = []
        for t in range(query.shape[2]):
            q = query[:, :, t].detach().to("cpu", dtype)
            k = key[:, :, t].detach().to("cpu", dtype)
            v = value[:, :, t].detach().to("cpu", dtype)
            with group.lock:
                session = handle._session(group)
                started = time.perf_counter_ns()
                try:
                    result = session.step(plan.index, self.ids, q, k, v)
                except CallFailed as exc:
                    handle._broken(group)
                    raise _failed(exc, f"layer {layer}'s decode step", handle.address) from None
                except Refused as exc:  # the message as a whole
                    raise ServedAttentionError(
                        f"gqa-serve refused layer {layer}'s step: {exc.message}", exc.code.name
                    ) from None
                elapsed = time.perf_counter_ns() - started
            stats = handle.stats
            stats.messages += 1
            stats.round_trip_ns += elapsed
            stats.server_ns += result.compute_ns
            if layer == handle.last_layer:
                stats.tokens += 1
            if result.refusals:
                sid, refusal = next(iter(result.refusals.items()))
                code = refusal.code.name
                raise ServedAttentionError(
                    f"gqa-serve refused sequence {sid} on layer {layer}: {refusal.message}"
                    + (" (pass a larger max_length)" if code == "RESOURCE_EXHAUSTED" else ""),
                    code,
                )
            outputs.append(torch.as_tensor(result.output))
        out = torch.stack(outputs, dim=1) if len(outputs) > 1 else outputs[0].unsqueeze(1)
        return out.to(query.device, query.dtype)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Removes this cache's sequences from the service (idempotent; never raises for a
        service that is gone: its sequences went with it)."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        self._prompt.clear()
        if self.ids is not None:
            self.handle._remove(self._added, self.ids)


def _failed(exc: CallFailed, what: str, address: str) -> ServedAttentionError:
    return ServedAttentionError(
        f"gqa-serve at {address} failed during {what}: {exc.code.name}: {exc.message}", exc.code.name
    )


def _plans(config, policy: str | None, window: int | None, sink_tokens: int, capacity: int | None) -> list[LayerPlan]:
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of None (the model's own), {', '.join(POLICIES)}")
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError("gqa_serve: attention logit soft-capping is not supported")
    raw = []
    for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if kind == "sliding_attention":
            w = int(kwargs["sliding_window"])
            raw.append((i, policy or "strict", w))
        elif kind == "full_attention":
            if policy is None:
                raw.append((i, "none", 0))
            elif not window:
                raise ValueError(f"policy={policy!r} needs window= for the model's full-attention layers (layer {i})")
            else:
                raw.append((i, policy, int(window)))
        else:
            raise NotImplementedError(f"gqa_serve: layer {i} is {kind!r}; only full and sliding attention are served")
    keys: dict[tuple, int] = {}
    counts: dict[int, int] = {}
    plans = []
    for i, p, w in raw:
        sinks = sink_tokens if p == "sink" else 0
        cap = (capacity or 2 * w) if p == "greedy" else 0
        if p == "greedy" and cap < w:
            raise ValueError(f"capacity: greedy needs C >= W, got C={cap} for W={w}")
        group = keys.setdefault((p, w, sinks, cap), len(keys))
        index = counts.get(group, 0)
        counts[group] = index + 1
        plans.append(LayerPlan(i, p, w, sinks, cap, group, index))
    return plans


class OffloadedAttention:
    """The handle ``offload_attention`` returns: the model's attention is on the service until
    ``close()`` (or the end of a ``with`` block), which restores the model as it was."""

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
        self.backend = backend
        self.max_length = max_length
        self.plans = _plans(config, policy, window, sink_tokens, capacity)
        self.last_layer = len(self.plans) - 1
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        self._sliding = [
            kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(layer_types, layer_kwargs)
        ]
        first = {}
        for p in self.plans:
            first.setdefault(p.group, p)
        self.groups = [_Group(first[g], [p.layer for p in self.plans if p.group == g]) for g in range(len(first))]
        self.stats = ServedStats()
        self._owns_client = isinstance(target, str)
        self.client = Client(target) if self._owns_client else target
        self.address = target if isinstance(target, str) else getattr(target, "address", "the server")
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._orphans: list[tuple[set, list[int]]] = []
        self._checked: set[int] = set()
        self._closed = False
        # The model, switched over; ``close`` puts back each piece.
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
        window = kwargs.get("sliding_window")
        plan = self.plans[layer]
        if window and plan.policy in ("none",):
            raise NotImplementedError(
                f"gqa_serve: layer {layer} has a sliding window {window} the config does not declare"
            )
        self._checked.add(layer)

    # -- sessions and sequences -----------------------------------------------------------------
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

    def _session(self, group: _Group):
        """The group's session, opened on first use or after a failure (call under its lock)."""
        if group.session is None:
            try:
                group.session = self.client.batch(
                    num_query_heads=self.num_query_heads,
                    num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim,
                    num_layers=len(group.layers),
                    dtype=str(self.dtype).removeprefix("torch."),
                    backend=self.backend,
                )
            except CallFailed as exc:
                raise _failed(exc, "opening a Batch session", self.address) from None
        return group.session

    def _broken(self, group: _Group) -> None:
        """Drops a session whose RPC failed; the next use opens a fresh one."""
        session, group.session = group.session, None
        if session is not None:
            try:
                session.cancel()
            except Exception:  # noqa: BLE001 - it is already broken
                pass

    def _remove(self, added: set[int], ids: list[int]) -> None:
        for g in sorted(added):
            group = self.groups[g]
            with group.lock:
                if group.session is None:
                    continue  # the session ended, and its sequences with it
                try:
                    group.session.remove(ids)
                except Exception:  # noqa: BLE001 - a failed session frees its sequences itself
                    self._broken(group)
        added.clear()

    def _orphan(self, added: set[int], ids: list[int]) -> None:
        # From the garbage collector, possibly in the middle of a session call on this thread:
        # only noted here, removed by the next new_cache or close.
        if ids and added:
            self._orphans.append((added, ids))

    def _collect_orphans(self) -> None:
        while self._orphans:
            added, ids = self._orphans.pop()
            self._remove(added, ids)

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
        for group in self.groups:
            with group.lock:
                session, group.session = group.session, None
                if session is not None:
                    try:
                        session.close()
                    except Exception:  # noqa: BLE001 - a session that failed is already gone
                        pass
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> "OffloadedAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
