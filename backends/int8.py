"""The int8 backend: KV caches stored as int8 codes plus one scale per (token, KV head).

Streams exchange float tensors (float32, bfloat16, float16); each new token's key and value are
quantized on append (``quant.quantize_int8``, absmax / 127 per row of D), so a position costs
``2 * (D + scale bytes)`` per KV head instead of ``2 * D * 2`` in float16 (0.52x at D = 128 with
float32 scales, 0.51x with float16 ones).

Before quantizing, each row is rotated by a normalized Hadamard matrix H (``quant.
hadamard_rotation``; QuaRot's trick): a few outlier channels, common in keys, otherwise set every
token's absmax and coarsen all its other channels. Attention is rotation-invariant (queries are
rotated by the same H, the output rotated back), so only the stored codes see it; ``export``
rotates back. On N(0, 1) data with 4 channels 20x larger it cuts the output error ~4x.

Layout, as in the CPU backend: key codes transposed (B, Hkv, D, C), value codes (B, Hkv, C, D),
scales (B, Hkv, C) each, all in the ring of ``base.LayerCache``. From C = 4032 on, each key row
is padded to a whole number of 64-byte lines (under 1/64 more), so that the kernel's blocks of
64 positions are whole lines; the reservation counts the padding.

Attention never dequantizes the cache. The key scales are folded into the scores and the value
scales into the attention weights::

    score[s] = (q . kcode[s]) * kscale[s]            out = sum_s (p[s] * vscale[s]) * vcode[s]

and the two products run on the int8 codes themselves. Three kernels compute them (measured
side by side by ``python -m tests.bench int8``):

- ``"native"`` (the default on the CPU): ``backends/csrc/int8_decode.c`` through
  ``backends.native``, built on first use. It reads each code once, widens it to float32 in
  registers, and keeps an online softmax per block of 64 positions (flash-decoding), so nothing
  but the output is written. On the reference machine at S = 32768: 2.8x faster than the float32
  backend, 1.3x its memory floor. ``"native-portable"`` and ``"native-avx512"`` pick one of its
  implementations (the default takes the fastest this CPU runs).
- ``"int_mm"`` (the CPU fallback where no C compiler is at hand): the float operand (the scaled
  query; the weights ``p * vscale``) is split into three int8 pieces, each quantizing what the
  previous left (``quant.quantize_int8_residual``), so it is reproduced to float32 resolution,
  and each product is ``torch._int_mm`` (int8 x int8 -> int32, exact), read straight from the
  cache. The splitting passes make it about as fast as the float32 backend.
- ``"blocks"``: blocks of ``BLOCK`` codes are widened to float32 by torch in a small reused
  workspace that stays in cache, then a float matrix product; the path on other devices.

An integer variant of the native kernel (int16 query and weights, AVX-512 VNNI products) was
measured at 0-15% faster for 30x the kernel error (5e-5 against float32's 2e-6) and not kept.

int32 sums of int8 products are exact while a product runs over at most ``_INT32_SAFE_ROWS``
rows (127 * 127 * rows < 2**31), so longer runs are cut into chunks accumulated in float32.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from quant import dequantize_int8, hadamard_rotation, quantize_int8, quantize_int8_residual

from . import native
from .base import Backend, Capabilities, CacheSpec, LayerCache, scaled_query
from .validation import dtype_name

__all__ = ["Int8Backend", "Int8Cache", "default_kernel", "int8_nbytes"]

log = logging.getLogger(__name__)

# "native" runs the compiled kernel (``backends.native``) with the fastest implementation this
# CPU has; "native-<isa>" picks one (the tests run each).
NATIVE_ISAS = ("portable", "avx512")
KERNELS = ("native", *(f"native-{isa}" for isa in NATIVE_ISAS), "int_mm", "blocks")
# Pieces the float operand of an int8 product is split into: 3 reach float32's resolution of
# the row's absmax (each piece shrinks the error ~254x), 2 would leave ~1e-5 relative.
PIECES = 3
BLOCK = 1024
_INT32_SAFE_ROWS = 65536


def _has_int_mm() -> bool:
    return hasattr(torch, "_int_mm")


def default_kernel(device) -> str:
    """"native" on the CPU where it builds and loads, else "int_mm" there, else "blocks"."""
    if torch.device(device).type != "cpu":
        return "blocks"
    ok, reason = native.available()
    if ok:
        return "native"
    fallback = "int_mm" if _has_int_mm() else "blocks"
    _warn_fallback(reason, fallback)
    return fallback


@functools.cache
def _warn_fallback(reason: str, fallback: str) -> None:
    log.warning("int8: the native kernel is unavailable (%s); using the %s kernel, 2-3x slower", reason, fallback)


def _key_row_stride(capacity: int) -> int:
    return capacity if capacity < 64 * 63 else -(-capacity // 64) * 64


def int8_nbytes(spec: CacheSpec, scale_dtype: torch.dtype) -> int:
    """Codes plus scales for keys and values (key rows padded to 64 bytes once C >= 4032, under
    1/64 more): what ``Int8Cache`` allocates."""
    b, h, c, d = spec.rows_shape
    scale = torch.empty((), dtype=scale_dtype).element_size()
    return b * h * (d * _key_row_stride(c) + d * c + 2 * c * scale)


def _chunks(a: int, b: int, size: int):
    for start in range(a, b, size):
        yield start, min(start + size, b)


class Int8Cache(LayerCache):
    """One layer's cache as int8 codes plus per-(token, KV head) scales, in a ring."""

    state_encoding = "int8"

    def __init__(self, spec: CacheSpec, scale_dtype: torch.dtype = torch.float32, kernel: str = "auto",
                 rotate: bool = True):
        super().__init__(spec)
        if kernel == "auto":
            kernel = default_kernel(spec.device)
        if kernel not in KERNELS:
            raise ValueError(f"int8: unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")
        self._native = None
        if kernel.startswith("native"):
            if torch.device(spec.device).type != "cpu":
                raise ValueError(f"int8: kernel {kernel!r} runs on the CPU only")
            self._native = native.load()  # NativeUnavailable says why not
            self._isa = kernel.partition("-")[2] or "auto"
            if self._isa != "auto" and self._isa not in self._native.isas(spec.head_dim):
                raise native.NativeUnavailable(
                    f"int8: kernel {kernel!r} does not run here at head_dim {spec.head_dim} "
                    f"(this CPU: {', '.join(self._native.isas(spec.head_dim))})"
                )
        self.kernel = kernel
        self.scale_dtype = scale_dtype
        # Rows are stored rotated (``quant.hadamard_rotation``): outlier channels then cost a
        # few times less precision. H is symmetric and orthonormal, so it also rotates back.
        self.rotation = hadamard_rotation(spec.head_dim, device=spec.device) if rotate else None
        # On the CPU the native library computes the same product as a fast Walsh-Hadamard
        # transform without torch's thread pool (whose idle spinning would then slow the kernel);
        # for every kernel alike, so that the stored codes never depend on the kernel chosen.
        self._hadamard = None
        if torch.device(spec.device).type == "cpu" and native.available()[0]:
            self._hadamard = native.load().hadamard
        b, h, c, d = spec.rows_shape
        dev = spec.device
        # Key rows (one channel, every position) are padded to whole 64-byte lines once that
        # costs under 1/64 of a row: the kernel then reads whole lines per block of positions.
        self._k = torch.zeros((b, h, d, _key_row_stride(c)), dtype=torch.int8, device=dev)[..., :c]
        self._v = torch.zeros((b, h, c, d), dtype=torch.int8, device=dev)
        self._ks = torch.zeros((b, h, c), dtype=scale_dtype, device=dev)
        self._vs = torch.zeros((b, h, c), dtype=scale_dtype, device=dev)

    # -- storage ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._k.untyped_storage().nbytes() + self._v.nbytes + self._ks.nbytes + self._vs.nbytes

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rows (..., D) into (or, H being its own inverse, out of) the stored basis, float32."""
        x = x.to(torch.float32)
        if self.rotation is None:
            return x
        if self._hadamard is not None and x.numel():
            return self._hadamard(x)
        return x @ self.rotation

    def _write_rows(self, start, keys, values):
        keys, values = self._rotate(keys), self._rotate(values)
        kc, ks = quantize_int8(keys, scale_dtype=self.scale_dtype, name="key")
        vc, vs = quantize_int8(values, scale_dtype=self.scale_dtype, name="value")
        self._write_codes(start, kc, vc, ks, vs)

    def _write_codes(self, start, kc, vc, ks, vs):
        n = kc.shape[2]
        self._k[:, :, :, start : start + n] = kc.transpose(2, 3)
        self._v[:, :, start : start + n] = vc
        self._ks[:, :, start : start + n] = ks
        self._vs[:, :, start : start + n] = vs

    def _codes(self, start, stop):
        return (
            self._k[:, :, :, start:stop].transpose(2, 3),
            self._v[:, :, start:stop],
            self._ks[:, :, start:stop],
            self._vs[:, :, start:stop],
        )

    def _read_rows(self, start, stop):
        kc, vc, ks, vs = self._codes(start, stop)
        dtype = self.spec.dtype
        return self._rotate(dequantize_int8(kc, ks)).to(dtype), self._rotate(dequantize_int8(vc, vs)).to(dtype)

    def _save_rows(self, start, stop):
        return tuple(t.clone() for t in self._codes(start, stop))

    def _restore_rows(self, start, saved):
        self._write_codes(start, *saved)

    # -- checks: non-finite input is refused before anything is written ---------------------
    def check_step(self, query, new_key, new_value):
        super().check_step(query, new_key, new_value)
        _check_finite(("query", query), ("new_key", new_key), ("new_value", new_value))

    def prefill(self, keys, values):
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            _check_finite(("prefill key", keys), ("prefill value", values))
        super().prefill(keys, values)

    # -- raw codes, for bit-exact snapshots ------------------------------------------------------
    def export_quantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The resident codes and scales in position order, oldest first, as stored.

        Returns key codes and value codes (B, Hkv, L, D) int8, key scales and value scales
        (B, Hkv, L) in the cache's scale dtype (copies). With ``rotation`` set (the default) the
        codes are of the rotated rows: ``dequantize_int8(codes, scales) @ rotation`` gives the
        stored keys and values back.
        """
        parts = [self._codes(a, b) for a, b in self._runs(self.resident_positions())]
        if not parts:
            s = self.spec
            shape = (s.batch_size, s.num_kv_heads, 0)
            codes = torch.empty(shape + (s.head_dim,), dtype=torch.int8, device=s.device)
            scales = torch.empty(shape, dtype=self.scale_dtype, device=s.device)
            return codes, codes.clone(), scales, scales.clone()
        return tuple(torch.cat([p[i] for p in parts], dim=2) for i in range(4))

    def load_quantized(self, key_codes, value_codes, key_scales, value_scales, tokens_seen: int) -> None:
        """Loads what ``export_quantized`` returned into an empty cache that then has seen
        ``tokens_seen`` tokens; the codes and scales are stored bit-exactly.

        The arrays must hold ``L = policy.resident_length(tokens_seen)`` positions. Raises
        ``ValueError``/``TypeError`` (nothing stored) for anything else.
        """
        s = self.spec
        if self.tokens_seen:
            raise ValueError("load_quantized: the cache already holds tokens")
        if isinstance(tokens_seen, bool) or not isinstance(tokens_seen, int) or tokens_seen < 0:
            raise ValueError(f"load_quantized: tokens_seen must be an int >= 0, got {tokens_seen!r}")
        try:
            n = self.policy.resident_length(tokens_seen)
        except ValueError as exc:  # more tokens than policy none can hold
            raise ValueError(f"load_quantized: {exc}") from None
        codes_shape = (s.batch_size, s.num_kv_heads, n, s.head_dim)
        for name, t in (("key codes", key_codes), ("value codes", value_codes)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int8:
                raise TypeError(f"load_quantized: {name} must be an int8 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if tuple(t.shape) != codes_shape:
                raise ValueError(f"load_quantized: {name} expected shape {codes_shape} (L={n} at T={tokens_seen}), got {tuple(t.shape)}")
            if n and int(t.min()) < -127:
                raise ValueError(f"load_quantized: {name} hold -128, outside the symmetric range [-127, 127]")
        for name, t in (("key scales", key_scales), ("value scales", value_scales)):
            if not isinstance(t, torch.Tensor) or t.dtype != self.scale_dtype:
                raise TypeError(
                    f"load_quantized: {name} must be a {dtype_name(self.scale_dtype)} tensor, got {getattr(t, 'dtype', type(t).__name__)}"
                )
            if tuple(t.shape) != codes_shape[:3]:
                raise ValueError(f"load_quantized: {name} expected shape {codes_shape[:3]}, got {tuple(t.shape)}")
            if n and not bool((torch.isfinite(t) & (t >= 0)).all()):
                raise ValueError(f"load_quantized: {name} must be finite and >= 0")
        offset = 0
        for a, b in self._runs(self.policy.resident(tokens_seen)):
            sl = slice(offset, offset + b - a)
            self._write_codes(a, key_codes[:, :, sl], value_codes[:, :, sl], key_scales[:, :, sl], value_scales[:, :, sl])
            offset += b - a
        self.tokens_seen = tokens_seen

    def export_state(self) -> dict:
        """The stored codes and scales, bit-exact (``encoding`` "int8"), for snapshots."""
        kc, vc, ks, vs = self.export_quantized()
        return {"encoding": self.state_encoding, "key": kc, "value": vc, "key_scale": ks, "value_scale": vs}

    def _load_state(self, tokens_seen: int, state: dict) -> None:
        try:
            self.load_quantized(state["key"], state["value"], state["key_scale"], state["value_scale"], tokens_seen)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"restore: int8 state incomplete or mistyped ({exc})") from None

    # -- attention ------------------------------------------------------------------------------
    def _attend(self, query, runs):
        s = self.spec
        n = s.batch_size * s.num_kv_heads
        q = self._rotate(scaled_query(query, s.num_kv_heads)).contiguous()  # (N, G, D) float32
        k = self._k.view(n, s.head_dim, s.capacity)  # rows stay evenly spaced (padded)
        v = self._v.view(n, s.capacity, s.head_dim)
        ks = _gather(self._ks.view(n, s.capacity), runs)
        vs = _gather(self._vs.view(n, s.capacity), runs)
        if self.kernel.startswith("native"):
            out = self._native.attend(q, k, v, ks, vs, runs, isa=self._isa)
        else:
            kernel = _attend_int_mm if self.kernel == "int_mm" else _attend_blocks
            out = kernel(q, k, v, ks, vs, runs)
        out = self._rotate(out)
        return out.view(s.batch_size, s.num_query_heads, s.head_dim).to(s.dtype)


def _gather(scales: torch.Tensor, runs) -> torch.Tensor:
    """The scales of the attended rows in run order, (N, S) float32 (a view when possible)."""
    if len(runs) == 1:
        a, b = runs[0]
        return scales[:, a:b].to(torch.float32)
    return torch.cat([scales[:, a:b] for a, b in runs], dim=1).to(torch.float32)


def _check_finite(*named: tuple[str, torch.Tensor]) -> None:
    for name, t in named:
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            raise ValueError(
                f"{name}: {int((~finite).sum())} non-finite value(s) (NaN or inf) in shape {tuple(t.shape)}; "
                "the int8 cache cannot store them and nothing was written"
            )


def _mixer(scales: torch.Tensor) -> torch.Tensor:
    """(P, N, G) piece scales -> (N, G, P*G) matrices that sum the pieces of each row back."""
    p, n, g = scales.shape
    eye = torch.eye(g, dtype=torch.float32, device=scales.device)
    return (scales.permute(1, 2, 0).unsqueeze(-1) * eye.view(1, g, 1, g)).reshape(n, g, p * g)


def _attend_int_mm(q, k, v, ks, vs, runs):
    """Scores and weighted sums as exact int8 products; see the module docstring.

    q (N, G, D) float32, already scaled; k (N, D, C) and v (N, C, D) int8 codes; ks, vs (N, S)
    float32 scales of the attended rows in run order. Returns (N, G, D) float32.

    One KV head at a time, so that the int32 products, their float32 sums and the weights'
    pieces (about 26 * G * S bytes) stay in the core's cache between the passes.
    """
    n, g, d = q.shape
    total = ks.shape[1]
    qc, qsc = quantize_int8_residual(q, PIECES, check=False)  # (P, N, G, D), (P, N, G)
    qc = qc.transpose(0, 1).reshape(n, PIECES * g, d)
    qmix = _mixer(qsc)
    scores = torch.empty((n, g, total), dtype=torch.float32, device=q.device)
    for h in range(n):
        if len(runs) == 1:
            a, b = runs[0]
            iscores = torch._int_mm(qc[h], k[h, :, a:b])
        else:  # a product over D: 127 * 127 * D stays far inside int32
            iscores = torch.cat([torch._int_mm(qc[h], k[h, :, a:b]) for a, b in runs], dim=1)
        torch.mm(qmix[h], iscores.to(torch.float32), out=scores[h])
    scores.mul_(ks.unsqueeze(1))
    weights = torch.softmax(scores, dim=-1).mul_(vs.unsqueeze(1))
    out = torch.empty((n, g, d), dtype=torch.float32, device=q.device)
    for h in range(n):
        wc, wsc = quantize_int8_residual(weights[h], PIECES, check=False)  # (P, G, S), (P, G)
        wc = wc.view(PIECES * g, total)
        acc = None
        off = 0
        for a, b in runs:
            for c0, c1 in _chunks(a, b, _INT32_SAFE_ROWS):
                w = c1 - c0
                part = torch._int_mm(wc[:, off : off + w], v[h, c0:c1]).to(torch.float32)
                acc = part if acc is None else acc.add_(part)
                off += w
        torch.mm(_mixer(wsc.unsqueeze(1))[0], acc, out=out[h])
    return out


def _attend_blocks(q, k, v, ks, vs, runs):
    """The same sums with codes widened to float32 a block at a time in a reused workspace."""
    n, g, d = q.shape
    total = ks.shape[1]
    scores = torch.empty((n, g, total), dtype=torch.float32, device=q.device)
    work_k = torch.empty((n, d, min(BLOCK, total)), dtype=torch.float32, device=q.device)
    work_v = torch.empty((n, min(BLOCK, total), d), dtype=torch.float32, device=q.device)
    off = 0
    for a, b in runs:
        for c0, c1 in _chunks(a, b, BLOCK):
            w = c1 - c0
            wk = work_k[:, :, :w]
            wk.copy_(k[:, :, c0:c1])
            torch.bmm(q, wk, out=scores[:, :, off : off + w])
            off += w
    scores.mul_(ks.unsqueeze(1))
    weights = torch.softmax(scores, dim=-1).mul_(vs.unsqueeze(1))
    out = torch.zeros((n, g, d), dtype=torch.float32, device=q.device)
    off = 0
    for a, b in runs:
        for c0, c1 in _chunks(a, b, BLOCK):
            w = c1 - c0
            wv = work_v[:, :w]
            wv.copy_(v[:, c0:c1])
            out.baddbmm_(weights[:, :, off : off + w], wv)
            off += w
    return out


class Int8Backend(Backend):
    """int8 codes plus per-(token, KV head) scales; float tensors in and out."""

    name = "int8"
    capabilities = Capabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        devices=("cpu", "cuda"),
    )

    def __init__(self, scale_dtype: torch.dtype = torch.float32, kernel: str = "auto", rotate: bool = True):
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"int8: scale_dtype must be float32 or float16, got {scale_dtype}")
        if kernel != "auto" and kernel not in KERNELS:
            raise ValueError(f"int8: unknown kernel {kernel!r} (known: auto, {', '.join(KERNELS)})")
        self.scale_dtype = scale_dtype
        self.kernel = kernel
        self.rotate = rotate

    @classmethod
    def probe(cls) -> list[str]:
        # Builds (about a second, once per machine) or loads the native kernel now, while the
        # server starts, rather than in a stream's first step. Without it the torch kernels serve.
        native.available()
        return []

    def cache_nbytes(self, spec: CacheSpec) -> int:
        return int8_nbytes(spec, self.scale_dtype)

    def create_cache(self, spec: CacheSpec) -> LayerCache:
        self.check(spec)
        return Int8Cache(spec, self.scale_dtype, self.kernel, self.rotate)
