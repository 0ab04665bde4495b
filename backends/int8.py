"""The int8 backend: KV caches stored as int8 codes plus one scale per (token, KV head).

Streams exchange float tensors (float32, bfloat16, float16); each new token's key and value are
quantized on append, and every output is (B, Hq, D) in the stream dtype. The backend's parts,
one module each:

- ``backends.int8_storage``: the tensors and their layout, the byte counts (``int8_nbytes``;
  264 bytes per position and KV head at D = 128 with float16 scales, 0.516x float16's), the
  coding of rows (``quant.quantize_int8``, absmax / 127 per row) and what input a row can hold.
- ``backends.int8_calibration``: the O key outlier channels per (batch, KV head) kept in
  float16 and their choice from the cache's first keys.
- ``backends.int8_torch``: the torch kernels over codes and scales.
- ``backends.int8_codes``: raw codes in and out (``export_quantized``, ``load_quantized``, the
  snapshot state), bit-exact.
- this module: ``Int8Cache`` (the step: calibration, the native call, the attention) and
  ``Int8Backend`` (registered as "int8" in ``backends.registry``), and the kernel choice.

Outliers. One channel of much larger magnitude sets its token's absmax and coarsens every
other channel of the token. Keys keep their O outlier channels in float16 (LLM.int8()'s
mixed-precision decomposition; ``int8_calibration``). Values are rotated by a normalized
Hadamard matrix H (``quant.hadamard_rotation``; QuaRot's) before quantizing, which spreads an
outlier over the row; the output is rotated back by the same H (symmetric, orthonormal), and
``export`` returns unrotated values. tests/test_int8_backend.py holds the error budget: the
output within 1e-2 of float64 with 4 channels 20x larger.

The key channel order. Keys are stored in a per-(batch, KV head) order of their channels,
(B, Hkv, D) int64 (``Int8Cache.key_channels``): the D - O coded channels, then the O outlier
ones, each ascending. Queries are gathered into that order before the scores; the native
kernel (``backends/csrc/``) receives the order and does the same.

The step. During calibration (fewer than ``CALIBRATION_TOKENS`` keys seen, with outlier
channels) the step runs in Python. After it, with a "native" kernel, the whole step is one
native call (``gqa_step``): the new key reordered and quantized, its outlier channels in
float16, the value rotated and quantized (the same codes as ``quant.quantize_int8``, bit for
bit), the codes written into the ring (after every check and the quantization, so nothing
can fail once they are written), the attention, and the output rotated back in the stream
dtype.

Attention never dequantizes the cache. The key scales are folded into the scores and the value
scales into the attention weights, and both products run on the codes::

    score[s] = (q . kcode[s]) * kscale[s] + q_o . kout[s]      out = sum_s (p[s] * vscale[s]) * vcode[s]

Kernels (``kernel=``, ``KERNELS``):

- ``"native"`` (the default on the CPU where the library builds and loads): ``backends.native``,
  one pass over the codes with an online softmax per block of 64 positions (flash-decoding);
  nothing but the output is written. ``"native-portable"``, ``"native-avx2"``, ``"native-avx512"`` and
  ``"native-avx512dot"`` pick one of its implementations (the default takes the fastest this CPU runs).
- ``"int_mm"`` (the CPU fallback without the native library): exact int8 products
  (``int8_torch.attend_int_mm``).
- ``"blocks"``: codes widened to float32 a block at a time (``int8_torch.attend_blocks``); the
  path on devices other than the CPU.

Every kernel stores the same codes (the value rotation is the native Walsh-Hadamard transform
on the CPU for all of them), so a cache's contents never depend on the kernel. Measurements
and the alternatives tried are in docs/design.md.
"""

from __future__ import annotations

import errno
import functools
import logging
import math

import torch

import quant.int8 as quant_int8

from . import native
from .attention import scaled_query
from .base import LayerCache
from .contract import Backend, CacheSpec, Capabilities
from .errors import InputValueError
from .int8_calibration import CALIBRATION_TOKENS, KEY_OUTLIERS, choose_key_channels, chooses_again, key_outlier_count
from .int8_codes import STATE_ENCODING, check_quantized, join_rows, rows_from_state, state_from_rows
from .int8_storage import FLOAT16_MAX, Int8Rows, Int8Storage, check_values, int8_nbytes
from .int8_torch import attend_blocks, attend_int_mm, gather_scales, has_int_mm

# The backend's public names: Int8Rows, int8_nbytes and key_outlier_count live in its parts
# (int8_storage, int8_calibration) and are re-exported here, where callers have imported them.
__all__ = ["Int8Backend", "Int8Cache", "Int8Rows", "default_kernel", "int8_nbytes", "key_outlier_count"]

log = logging.getLogger(__name__)

# "native" runs the compiled kernel (``backends.native``) with the fastest implementation this
# CPU has; "native-<isa>" picks one (the tests run each).
NATIVE_ISAS = ("portable", "avx2", "avx512", "avx512dot")
KERNELS = ("native", *(f"native-{isa}" for isa in NATIVE_ISAS), "int_mm", "blocks")


def default_kernel(device) -> str:
    """ "native" on the CPU where it builds and loads, else "int_mm" there, else "blocks"."""
    if torch.device(device).type != "cpu":
        return "blocks"
    ok, reason = native.available()
    if ok:
        return "native"
    fallback = "int_mm" if has_int_mm() else "blocks"
    _warn_fallback(reason, fallback)
    return fallback


@functools.cache
def _log_kernel() -> None:
    """Says once which kernel int8 caches on the CPU get (the fallback's warning says why)."""
    if default_kernel("cpu") == "native":
        kernel = native.load()
        log.info("int8: native kernel %s (%s)", kernel.path, ", ".join(kernel.isas(128)))


@functools.cache
def _warn_fallback(reason: str, fallback: str) -> None:
    log.warning("int8: the native kernel is unavailable (%s); using the %s kernel, 2-3x slower", reason, fallback)


class Int8Cache(Int8Storage):
    """One layer's cache as int8 codes plus per-(token, KV head) scales, in a ring
    (``Int8Storage``), with the outlier channels chosen as ``int8_calibration`` says.

    ``kernel``: "auto" (``default_kernel(spec.device)``) or one of ``KERNELS``; a "native"
    kernel runs on the CPU only (``ValueError`` elsewhere) and raises
    ``native.NativeUnavailable`` where the library does not load or (for "native-<isa>") where
    this CPU lacks the ISA. ``scale_dtype`` float16 or float32; ``rotate`` stores values
    rotated; ``key_outliers`` caps O (``key_outlier_count``).
    """

    state_encoding = STATE_ENCODING

    def __init__(
        self,
        spec: CacheSpec,
        scale_dtype: torch.dtype = torch.float16,
        kernel: str = "auto",
        rotate: bool = True,
        key_outliers: int = KEY_OUTLIERS,
    ):
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
        super().__init__(spec, scale_dtype, rotate, key_outliers, key_blocks=self._native is not None)
        if self._native is not None:
            self._attach_native(self._native, self._make_desc())
            self._sync_native()

    # -- what the native step needs to know of the Python side ---------------------------------
    # While the outlier channels are being chosen (the calibration keys kept), steps below
    # CALIBRATION_TOKENS take the Python path: the descriptor's python_below says so to the
    # library; its key order follows every new choice.
    @property
    def _calibration(self):
        return self.__dict__.get("_calibration_keys")

    @_calibration.setter
    def _calibration(self, value) -> None:
        self.__dict__["_calibration_keys"] = value
        self._sync_native()

    def _set_key_channels(self, order: torch.Tensor) -> None:
        super()._set_key_channels(order)
        self._sync_native()

    def _sync_native(self) -> None:
        state = self._state
        if state is None:
            return
        state.python_below = CALIBRATION_TOKENS if self._calibration is not None else 0
        order = self._key_order if self._key_order.is_contiguous() else self._key_order.contiguous()
        self._order_kept = order  # the descriptor points into it
        state.order = order.data_ptr()

    @property
    def calibrated(self) -> bool:
        """Whether the outlier channels are final (after ``CALIBRATION_TOKENS`` keys)."""
        return self._calibration is None

    # -- the outlier channels: chosen from the keys themselves ------------------------------
    def _calibrate(self, t: int) -> None:
        """After ``t`` tokens (t <= CALIBRATION_TOKENS, all of them calibration rows): choose
        the outlier channels from them and re-encode the resident ones exactly."""
        cal = self._calibration[:, :, :t]
        self._set_key_channels(choose_key_channels(cal, self.outliers))
        for r in self.policy.resident(t):
            for p in r:  # values do not depend on the choice: only keys are written again
                self._write_keys(self.row_of(p), cal[:, :, p : p + 1])
        if t == CALIBRATION_TOKENS:
            self._calibration = None

    def _write_token(self, position, row, key, value):
        if self._calibration is None or position >= CALIBRATION_TOKENS:
            self._write_rows(row, key, value)
            return
        self._calibration[:, :, position] = key[:, :, 0].to(torch.float32)
        self._write_rows(row, key, value)  # with the current channels
        t = position + 1
        if chooses_again(t):  # from every key so far
            self._calibrate(t)

    def prefill(self, keys, values):
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            check_values("prefill key", keys, FLOAT16_MAX)
            check_values("prefill value", values)
        super().prefill(keys, values)

    def _store_resident(self, t, keys, values):
        """A prefill's resident keys (already checked) choose the outlier channels; below
        CALIBRATION_TOKENS tokens they are kept for the choices still to come."""
        if self.outliers and keys.shape[2]:
            self._set_key_channels(choose_key_channels(keys, self.outliers))
            if t >= CALIBRATION_TOKENS:
                self._calibration = None
            else:
                positions = [p for r in self.policy.resident(t) for p in r]
                self._calibration[:, :, positions] = keys.to(torch.float32)
        super()._store_resident(t, keys, values)

    def _save_rows(self, start, stop):
        saved = tuple(t.clone() for t in self._codes(start, stop))
        if self._calibration is None:
            return saved, None
        # a step below CALIBRATION_TOKENS may re-encode every calibration row: keep them all
        m = min(self.spec.capacity, CALIBRATION_TOKENS)
        return saved, (tuple(t.clone() for t in self._codes(0, m)), self._key_order.clone(), self._calibration.clone())

    def _restore_rows(self, start, saved):
        rows, calibration = saved
        if calibration is not None:
            cal_rows, order, cal = calibration
            self._write_codes(0, Int8Rows(*cal_rows))
            self._set_key_channels(order)
            self._calibration = cal
        self._write_codes(start, Int8Rows(*rows))

    # -- raw codes, for bit-exact snapshots ------------------------------------------------------
    def export_quantized(self) -> Int8Rows:
        """The resident positions in position order, oldest first, exactly as stored (copies).

        Keys are in ``key_channels`` order; values are of the rotated rows (with ``rotation``
        set, the default): ``dequantize_int8(value_codes, value_scales) @ rotation`` gives them
        back.
        """
        parts = [self._codes(a, b) for a, b in self._runs(self.resident_positions())]
        if not parts:
            parts = [self._codes(0, 0)]
        return join_rows(parts)

    def load_quantized(
        self, rows: Int8Rows, key_channels: torch.Tensor, tokens_seen: int, calibration: torch.Tensor | None = None
    ) -> None:
        """Loads what ``export_quantized`` and ``key_channels`` returned into an empty cache that
        then has seen ``tokens_seen`` tokens; everything is stored bit-exactly.

        The rows must hold ``L = policy.resident_length(tokens_seen)`` positions.
        ``calibration`` (B, Hkv, min(T, CALIBRATION_TOKENS), D) float32 carries the first keys
        while the outlier channels are not final, so that a restored cache chooses exactly as
        the original would; without it they are final. Raises ``ValueError``/``TypeError``
        (nothing stored) for anything else.
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
        rows = check_quantized(
            rows,
            key_channels,
            calibration,
            spec=s,
            outliers=self.outliers,
            scale_dtype=self.scale_dtype,
            n=n,
            tokens_seen=tokens_seen,
        )
        cal_len = min(tokens_seen, CALIBRATION_TOKENS)
        self._set_key_channels(key_channels.to(self.spec.device).contiguous())
        offset = 0
        for a, b_ in self._runs(self.policy.resident(tokens_seen)):
            self._write_codes(a, Int8Rows(*(t[:, :, offset : offset + b_ - a] for t in rows)))
            offset += b_ - a
        if calibration is None:
            self._calibration = None
        else:
            self._calibration[:, :, :cal_len] = calibration
        self.tokens_seen = tokens_seen

    def export_state(self) -> dict:
        """The stored codes, scales, outlier channels and their order, bit-exact (``encoding``
        "int8"), plus the calibration keys while the channels are not final; for snapshots."""
        calibration = None
        if self._calibration is not None:
            calibration = self._calibration[:, :, : min(self.tokens_seen, CALIBRATION_TOKENS)].clone()
        return state_from_rows(self.export_quantized(), self.key_channels, calibration)

    def _load_state(self, tokens_seen: int, state: dict) -> None:
        try:
            rows, key_channels, calibration = rows_from_state(state)
            self.load_quantized(rows, key_channels, tokens_seen, calibration)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"restore: int8 state incomplete or mistyped ({exc})") from None

    # -- the whole step in one native call (after calibration) -----------------------------------
    def _make_desc(self) -> native.CacheDesc:
        s = self.spec
        n, d, o = s.batch_size * s.num_kv_heads, s.head_dim, self.outliers
        x = native.CacheDesc()
        x.enc, x.io = native.ENC["int8"], native.DTYPE_ENC[s.dtype]
        x.flags = native.ISA[self._isa] << native.FLAG_ISA_SHIFT
        if self.scale_dtype == torch.float16:
            x.flags |= native.FLAG_HALF_SCALES
        elif quant_int8.bitsandbytes_quantizer() is not None:  # quantize_int8's rounding with float32 scales
            x.flags |= native.FLAG_RECIPROCAL
        if self._rotated:
            x.flags |= native.FLAG_ROTATE
        x.n, x.g, x.d, x.c = n, s.group_size, d, s.capacity
        x.kstride, x.dk, x.no, x.scale_stride = self._keys.head_stride, d - o, o, s.capacity
        x.qscale = 1.0 / math.sqrt(d)
        x.k, x.v, x.ks, x.vs = self._k.data_ptr(), self._v.data_ptr(), self._ks.data_ptr(), self._vs.data_ptr()
        x.ko = self._ko.data_ptr() if o else None
        x.saved = self._saved_row.data_ptr()
        return x

    def check_tensors(self, query, new_key, new_value):
        super().check_tensors(query, new_key, new_value)
        check_values("query", query)
        check_values("new_key", new_key, FLOAT16_MAX)
        check_values("new_value", new_value)

    def check_native_inputs(self, query, new_key, new_value):
        # gqa_step checks the values itself (-EDOM: finite, keys within float16's range) before
        # it writes anything, and the step then names the tensor by check_tensors: three torch
        # reductions (~80 us of a step from a cold cache) are saved on every step that passes
        super().check_tensors(query, new_key, new_value)

    def step_error(self, status: int) -> Exception:
        if status == -errno.ERANGE:
            return InputValueError(
                "value: a row's absmax needs a scale beyond float16's range; use float32 scales (nothing was written)"
            )
        return super().step_error(status)

    # -- attention ------------------------------------------------------------------------------
    def _attend(self, query, runs):
        s = self.spec
        n, d, o = s.batch_size * s.num_kv_heads, s.head_dim, self.outliers
        q = scaled_query(query, s.num_kv_heads)  # (N, G, D) float32
        q = q.gather(2, self._key_order.view(n, 1, d).expand_as(q))  # in the stored key order
        v = self._v.view(n, s.capacity, d)
        ko = self._ko.view(n, o, s.capacity)
        ks, vs = self._ks.view(n, s.capacity), self._vs.view(n, s.capacity)
        if self.kernel.startswith("native"):  # reads float16 scales itself, by row
            out = self._native.attend(q, self._keys, v, ks, vs, runs, ko if o else None, isa=self._isa)
        else:
            ks, vs = gather_scales(ks, runs), gather_scales(vs, runs)
            bias = None
            if o:  # the outlier channels' scores, in float
                kov = torch.cat([ko[:, :, a:b] for a, b in runs], dim=2).to(torch.float32)
                bias = torch.bmm(q[:, :, d - o :], kov)
            k = self._k.view(n, d - o, s.capacity)  # transposed, rows evenly spaced (padded)
            kernel = attend_int_mm if self.kernel == "int_mm" else attend_blocks
            out = kernel(q[:, :, : d - o].contiguous(), k, v, ks, vs, runs, bias)
        out = self._rotate(out)
        return out.view(s.batch_size, s.num_query_heads, d).to(s.dtype)


class Int8Backend(Backend):
    """int8 codes plus per-(token, KV head) scales; float tensors in and out."""

    name = "int8"
    capabilities = Capabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        devices=("cpu", "cuda"),
    )

    def __init__(
        self,
        scale_dtype: torch.dtype = torch.float16,
        kernel: str = "auto",
        rotate: bool = True,
        key_outliers: int = KEY_OUTLIERS,
    ):
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"int8: scale_dtype must be float32 or float16, got {scale_dtype}")
        if kernel != "auto" and kernel not in KERNELS:
            raise ValueError(f"int8: unknown kernel {kernel!r} (known: auto, {', '.join(KERNELS)})")
        if isinstance(key_outliers, bool) or not isinstance(key_outliers, int) or key_outliers < 0:
            raise ValueError(f"int8: key_outliers must be an int >= 0, got {key_outliers!r}")
        self.scale_dtype = scale_dtype
        self.kernel = kernel
        self.rotate = rotate
        self.key_outliers = key_outliers

    @classmethod
    def probe(cls) -> list[str]:
        # Builds (once per machine) or loads the native kernel now, while the server starts,
        # rather than in a stream's first step. Without it the torch kernels serve.
        _log_kernel()
        return []

    def cache_nbytes(self, spec: CacheSpec) -> int:
        kernel = default_kernel(spec.device) if self.kernel == "auto" else self.kernel
        return int8_nbytes(spec, self.scale_dtype, self.key_outliers, key_blocks=kernel.startswith("native"))

    def create_cache(self, spec: CacheSpec) -> LayerCache:
        self.check(spec)
        return Int8Cache(spec, self.scale_dtype, self.kernel, self.rotate, self.key_outliers)
