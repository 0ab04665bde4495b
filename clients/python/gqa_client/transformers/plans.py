"""How a model's layers map onto the service: a ``LayerPlan`` per attention layer (policy,
window, sinks, capacity) and the sessions they share (layers with the same plan share one)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

__all__ = ["POLICIES", "LayerPlan", "plan_layers", "sliding_windows"]

POLICIES = ("strict", "greedy", "sink")


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


def sliding_windows(config) -> list[int | None]:
    """Per layer of the (text) config: its sliding window, or None for a full-attention layer."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    return [kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(layer_types, layer_kwargs)]


def _policies(config, policy: str | None, window: int | None) -> list[tuple[int, str, int]]:
    """(layer, policy, W) per layer: the model's own semantics, or ``policy`` everywhere."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    raw = []
    for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if kind == "sliding_attention":
            raw.append((i, policy or "strict", int(kwargs["sliding_window"])))
        elif kind == "full_attention":
            if policy is None:
                raw.append((i, "none", 0))
            elif not window:
                raise ValueError(f"policy={policy!r} needs window= for the model's full-attention layers (layer {i})")
            else:
                raw.append((i, policy, int(window)))
        else:
            raise NotImplementedError(f"gqa_serve: layer {i} is {kind!r}; only full and sliding attention are served")
    return raw


def plan_layers(
    config, policy: str | None, window: int | None, sink_tokens: int, capacity: int | None
) -> list[LayerPlan]:
    """A ``LayerPlan`` per layer of ``config`` (the arguments of ``offload_attention``);
    ``ValueError`` for a policy's missing or inconsistent argument, ``NotImplementedError`` for
    what the service does not compute (soft-capping, layer kinds other than full and sliding)."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of None (the model's own), {', '.join(POLICIES)}")
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError("gqa_serve: attention logit soft-capping is not supported")
    groups: dict[tuple, int] = {}
    counts: dict[int, int] = {}
    plans = []
    for i, p, w in _policies(config, policy, window):
        sinks = sink_tokens if p == "sink" else 0
        cap = (capacity or 2 * w) if p == "greedy" else 0
        if p == "greedy" and cap < w:
            raise ValueError(f"capacity: greedy needs C >= W, got C={cap} for W={w}")
        group = groups.setdefault((p, w, sinks, cap), len(groups))
        index = counts.get(group, 0)
        counts[group] = index + 1
        plans.append(LayerPlan(i, p, w, sinks, cap, group, index))
    return plans
