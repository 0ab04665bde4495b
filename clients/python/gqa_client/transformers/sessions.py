"""The service side of an offloaded model: one ``Batch`` session per group of layers sharing a
plan, opened on first use (again after a failure), and the three calls the model makes on it:
add a sequence with its prompt, step a layer's token, remove sequences. Failures become
``ServedAttentionError`` naming the address and the gRPC code."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CallFailed, Refused, refusal
from ..tensors import decode
from .plans import LayerPlan

__all__ = ["ServedAttentionError", "ServedStats", "Sessions"]

# The sessions' dtypes numpy has: their tensors travel as numpy views (``Sessions.step``).
_NUMPY = {torch.float32: np.dtype("<f4"), torch.float16: np.dtype("<f2")}


class ServedAttentionError(RuntimeError):
    """The service failed or refused a step or an upload. ``code`` is the gRPC status code's
    name (``"UNAVAILABLE"``, ``"RESOURCE_EXHAUSTED"``...)."""

    def __init__(self, message: str, code: str = "UNKNOWN"):
        super().__init__(message)
        self.code = code


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


class _Group:
    """One ``Batch`` session: the layers sharing a plan, and the lock its calls take."""

    def __init__(self, plan: LayerPlan, layers: list[int]):
        self.plan = plan
        self.layers = layers
        self.session = None
        self.lock = threading.Lock()


def _failed(exc: CallFailed, what: str, address: str) -> ServedAttentionError:
    return ServedAttentionError(
        f"gqa-serve at {address} failed during {what}: {exc.code.name}: {exc.message}", exc.code.name
    )


class Sessions:
    """The sessions of one offloaded model on ``client``: ``groups[g]`` serves the layers whose
    plan has group g. ``shape`` holds the sessions' ``num_query_heads``, ``num_kv_heads``,
    ``head_dim``, ``dtype`` (a torch dtype) and ``backend``."""

    def __init__(self, client, address: str, plans: list[LayerPlan], shape: dict):
        self.client = client
        self.address = address
        self.plans = plans
        self.shape = shape
        self.dtype: torch.dtype = shape["dtype"]
        self.last_layer = len(plans) - 1
        first: dict[int, LayerPlan] = {}
        for p in plans:
            first.setdefault(p.group, p)
        self.groups = [_Group(first[g], [p.layer for p in plans if p.group == g]) for g in range(len(first))]
        self.stats = ServedStats()

    def group_of(self, layer: int) -> _Group:
        return self.groups[self.plans[layer].group]

    # -- sessions -----------------------------------------------------------------------------
    def _session(self, group: _Group):
        """The group's session, opened on first use or after a failure (call under its lock)."""
        if group.session is None:
            s = self.shape
            try:
                group.session = self.client.batch(
                    num_query_heads=s["num_query_heads"],
                    num_kv_heads=s["num_kv_heads"],
                    head_dim=s["head_dim"],
                    num_layers=len(group.layers),
                    dtype=str(self.dtype).removeprefix("torch."),
                    backend=s["backend"],
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

    # -- the calls ----------------------------------------------------------------------------
    def add(self, group: _Group, sid: int, capacity: int, prefill: dict) -> None:
        """Adds sequence ``sid`` to the group's session with its prompt: ``prefill`` maps the
        group's layer index to (1, Hkv, n, D) CPU tensors of the sessions' dtype."""
        plan = group.plan
        self.stats.uploaded_bytes += sum(2 * k.numel() * k.element_size() for k, _ in prefill.values())
        with group.lock:
            session = self._session(group)
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
                self._broken(group)
                raise _failed(exc, f"uploading the prompt of sequence {sid}", self.address) from None
            except Refused as exc:  # in-band: budget, limits, configuration
                raise ServedAttentionError(
                    f"gqa-serve refused sequence {sid} (layers {group.layers}): {exc.message}", exc.code.name
                ) from None

    def step(self, layer: int, ids: list[int], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """The new tokens of model layer ``layer`` for the sequences ``ids``, one step message
        per token: query (B, Hq, q, D), key and value (B, Hkv, q, D) as the attention function
        receives them; the output (B, q, Hq, D) of the query's device and dtype."""
        lean = query.is_cpu and query.dtype == self.dtype and not query.requires_grad and query.shape[2] == 1
        if lean and self.dtype in _NUMPY:
            # One token on the CPU in the sessions' dtype: numpy views in, a tensor over the
            # reply's bytes out. This runs twice per layer per token, each time after the model
            # has streamed its weights through the caches, so every library call here runs
            # cold: numpy and protobuf code instead of torch's dispatch halves its cost.
            r = self._send(layer, ids, query.numpy()[:, :, 0], key.numpy()[:, :, 0], value.numpy()[:, :, 0])
            out = np.frombuffer(bytearray(r.output.data), _NUMPY[self.dtype])
            return torch.from_numpy(out.reshape(query.shape[0], 1, query.shape[1], query.shape[3]))
        outputs = []
        for t in range(query.shape[2]):
            q = query[:, :, t].detach().to("cpu", self.dtype)
            k = key[:, :, t].detach().to("cpu", self.dtype)
            v = value[:, :, t].detach().to("cpu", self.dtype)
            outputs.append(decode(self._send(layer, ids, q, k, v).output, q, "output"))
        out = torch.stack(outputs, dim=1) if len(outputs) > 1 else outputs[0].unsqueeze(1)
        return out.to(query.device, query.dtype)

    def _send(self, layer: int, ids: list[int], query, key, value):
        """One step message: query (B, Hq, D), key and value (B, Hkv, D) of the sessions' dtype
        (numpy arrays or CPU tensors); the server's ``BatchStepResult``."""
        plan = self.plans[layer]
        group = self.groups[plan.group]
        with group.lock:
            session = self._session(group)
            started = time.perf_counter_ns()
            try:
                result = session.step_reply(plan.index, ids, query, key, value)
            except CallFailed as exc:
                self._broken(group)
                raise _failed(exc, f"layer {layer}'s decode step", self.address) from None
            except Refused as exc:  # the message as a whole
                raise ServedAttentionError(
                    f"gqa-serve refused layer {layer}'s step: {exc.message}", exc.code.name
                ) from None
            elapsed = time.perf_counter_ns() - started
        stats = self.stats
        stats.messages += 1
        stats.round_trip_ns += elapsed
        stats.server_ns += result.compute_ns
        if layer == self.last_layer:
            stats.tokens += 1
        if result.refusals:
            first = result.refusals[0]
            sid, exc = first.id, refusal(first.status, first.id)
            raise ServedAttentionError(
                f"gqa-serve refused sequence {sid} on layer {layer}: {exc.message}"
                + (" (pass a larger max_length)" if exc.code.name == "RESOURCE_EXHAUSTED" else ""),
                exc.code.name,
            )
        return result

    def remove(self, added: set[int], ids: list[int]) -> None:
        """Removes ``ids`` from the sessions of the groups in ``added`` (then emptied); never
        raises: a failed session is dropped, and its sequences went with it."""
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

    def close(self) -> None:
        """Ends every session, which frees every sequence they hold."""
        for group in self.groups:
            with group.lock:
                session, group.session = group.session, None
                if session is not None:
                    try:
                        session.close()
                    except Exception:  # noqa: BLE001 - a session that failed is already gone
                        pass
