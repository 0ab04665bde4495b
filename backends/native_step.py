"""A layer cache's step as one call into the compiled library (``native.Kernel.step``).

``gqa_step`` plans the step from the cache's descriptor (``native.CacheDesc``: storage, shape,
policy and T), writes the new row, attends and writes the output, all in C. A cache with a
compiled step calls ``_attach_native`` once with its descriptor; the public step,
``batch.step_many`` and ``plane.CacheSet.step`` then all run through it. ``base.LayerCache``
inherits this class; nothing else does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os

import torch

from .contract import StepOutcome
from .errors import CacheFullError, InputValueError

__all__ = ["NativeStep", "OUTPUT_SLAB_BYTES"]

# StepOutcome's fields' slot descriptors, in order: the C++ entry sets them on a StepOutcome it
# allocates (a dataclass __init__ cost ~6 us of a cold step's Python)
OUTCOME_FIELDS = tuple(StepOutcome.__dict__[f.name] for f in dataclasses.fields(StepOutcome))

# A step's output is a tensor the caller keeps. The C++ entry makes it itself, or writes again
# into the one the cache's last step returned once the caller has let go of it
# (csrc/torch_step.cpp). The ctypes path, where one torch.empty_like per step cost ~55 us of a
# cold step's Python (a model's step: the dispatcher's code and data evicted since the layer's
# last one), makes a slab of outputs at once instead, up to this many bytes, and each step takes
# its next row (one unbind for the slab): still distinct memory per step, but a row keeps its
# whole slab alive while the caller holds it (docs/design.md, "A step's output").
OUTPUT_SLAB_BYTES = 64 << 10


class NativeStep:
    """The compiled step of a ``base.LayerCache`` (a mixin: it uses the cache's ``policy``,
    ``spec``, ``row_bytes``, ``check_tensors`` and ``_state``)."""

    _native = None
    _fast = None  # the C++ entry's (function, context, kernel), or None: ctypes alone
    # what the C++ entry's step_spans reads of this cache (batch_bytes.step_bytes): (kernel,
    # gqa_step's address, the descriptor's, the query's bytes), or None: the Python path
    _span = None
    _step_bytes = 0  # row_bytes, read once: a step's bytes_written
    _outputs: list | None = None  # the ctypes path's: the current slab's rows not handed out yet, last first

    def _attach_native(self, kernel, desc) -> None:
        """Makes ``desc`` (a ``native.CacheDesc`` with storage and shape filled in) this cache's
        state: the policy and T written into it, and the buffers of a one-row ``gqa_step``."""
        from . import native  # noqa: PLC0415 (native imports torch only; base is imported first)

        p = self.policy
        desc.policy = native.POLICY[p.kind.value]
        desc.window, desc.sinks, desc.t = p.window, p.sinks, self._t
        if self.__dict__.get("_fail_flag"):
            desc.flags |= native.FLAG_FAIL_AFTER_WRITE
        self._native = kernel
        self._state = desc
        # an int8 cache's row_bytes is computed from its spec and storage: ~15-20 us of a cold
        # step's Python (after the kernel, on the caller's path); it never changes
        self._step_bytes = self.row_bytes
        io = (ctypes.c_void_p * 4)()
        results = (ctypes.c_int64 * len(native.RESULT_COLUMNS_ALL))()
        status = ctypes.c_int32()
        addr = (ctypes.c_void_p * 1)(ctypes.addressof(desc))
        # (kernel.step, the descriptor's address array, io and its address, results and their
        # address, status and its address): what ``_step_native`` passes, computed once
        self._one = (
            kernel.step,
            ctypes.addressof(addr),
            io,
            ctypes.addressof(io),
            results,
            ctypes.addressof(results),
            status,
            ctypes.addressof(status),
            addr,
        )
        # the pool alerted before the checks: a cold step's Python takes about as long as a
        # sleeping worker's wake-up (docs/design.md, "The workers woken before the call"); not
        # asked for a cache too small ever to use the pool (the call itself costs ~14 us cold)
        at = ctypes.addressof(desc)
        self._wake = (kernel.prewake, at) if kernel.may_use_pool(at) else None
        s = self.spec
        self._out_like = torch.empty((s.batch_size, s.num_query_heads, s.head_dim), dtype=s.dtype)
        # the C++ entry (native.load_torch_step), when it is built: the whole public step in one
        # call (step_public: the pool's alert, the output tensor, gqa_step and the StepOutcome),
        # its context, and the kernel it was made for. The context: step()'s (gqa_step's
        # address, then those of the arrays above, and tensors of the step's dtype and shapes),
        # the prewake's address (0: none) and the descriptor's, this cache's output holder (the
        # tensor its last step made, written again once the caller lets go of it), StepOutcome
        # and its fields' slot descriptors, and bytes_written.
        self._fast = self._span = None
        try:
            step_at = ctypes.cast(kernel.step, ctypes.c_void_p).value  # a stand-in's is no C function
            wake_at = ctypes.cast(kernel.prewake, ctypes.c_void_p).value if self._wake is not None else 0
            module = native.load_torch_step()
        except (native.NativeUnavailable, ctypes.ArgumentError):
            return
        kv_like = torch.empty((s.batch_size, s.num_kv_heads, s.head_dim), dtype=s.dtype)
        ctx = (step_at, *self._one[1:8:2], self._out_like, kv_like)
        pctx = (ctx, wake_at or 0, at, [None], StepOutcome, OUTCOME_FIELDS, self._step_bytes)
        self._fast = (module.step_public, pctx, kernel)
        self._span = (kernel, step_at, at, s.batch_size * s.num_query_heads * s.head_dim * s.dtype.itemsize)

    def _step_native(self, query, new_key, new_value) -> StepOutcome | None:
        """The public step in one ``gqa_step`` call; None when this step takes the Python path
        (``python_below``: the int8 cache's calibration)."""
        fast = self._fast
        if fast is not None and self._native is fast[2]:  # a test's stand-in kernel goes through ctypes
            rc = fast[0](fast[1], query, new_key, new_value)
            if type(rc) is StepOutcome:
                return rc
        else:
            wake = self._wake
            if wake is not None:
                wake[0](wake[1])
            rc = None
        _, addrs, io, io_at, res, res_at, status, status_at, _ = self._one
        out = None
        if rc is None:  # no C++ entry, or a tensor it does not take: the checks here, then ctypes
            self.check_native_inputs(query, new_key, new_value)
            out = self.next_output()
            fn = self._native.step  # looked up per step: a test's stand-in kernel takes effect
            q, k, v = query.contiguous(), new_key.contiguous(), new_value.contiguous()
            io[0] = q.data_ptr()
            io[1] = k.data_ptr()
            io[2] = v.data_ptr()
            io[3] = out.data_ptr()
            rc = fn(addrs, 1, io_at, None, None, res_at, 7, status_at, 0, 0)
        if rc:
            self._native.raise_for(rc)
        if status.value:
            if status.value == -errno.EAGAIN:
                return None
            if status.value == -errno.EDOM:  # the library's value check failed: name the tensor
                self.check_tensors(query, new_key, new_value)
            raise self.step_error(status.value)
        r = res[:7]
        return StepOutcome(out, r[0], r[1], r[2], r[3], r[4], self._step_bytes, 0, r[6])

    def next_output(self) -> torch.Tensor:
        """A new output tensor for one step (B, Hq, D) in the cache's dtype: the next row of
        a slab of them (``OUTPUT_SLAB_BYTES``)."""
        outputs = self._outputs
        if not outputs:
            outputs = self.new_slab()
        return outputs.pop()

    def new_slab(self) -> list:
        """A new slab's output rows, the cache's list of them from now on (the next one last)."""
        like = self._out_like
        n = max(1, OUTPUT_SLAB_BYTES // (like.numel() * like.element_size()))
        rows = torch.empty((n, *like.shape), dtype=like.dtype).unbind(0)
        self._outputs = list(rows[::-1])  # handed out in memory order
        return self._outputs

    def check_native_inputs(self, query, new_key, new_value) -> None:
        """The checks of ``check_tensors`` that ``gqa_step`` does not make itself (here: all of
        them); raises as ``check_tensors`` does."""
        self.check_tensors(query, new_key, new_value)

    def step_error(self, status: int) -> Exception:
        """The exception for a row the native step refused with ``status`` (-errno; the cache
        unchanged)."""
        if status == -errno.ENOSPC:
            return CacheFullError(f"cache full: policy none holds {self.policy.capacity} tokens and all are used")
        if status == -errno.EDOM:
            return InputValueError("a non-finite input value (or a key beyond float16's range); nothing was written")
        return RuntimeError(f"native step failed: {os.strerror(-status)}; the cache is unchanged")

    # Tests set it to make the native step fail after its write (the kernel restores the row).
    @property
    def _fail_after_write(self) -> bool:
        return bool(self.__dict__.get("_fail_flag"))

    @_fail_after_write.setter
    def _fail_after_write(self, value: bool) -> None:
        from . import native  # noqa: PLC0415

        self.__dict__["_fail_flag"] = bool(value)
        state = self._state
        if state is not None:
            if value:
                state.flags |= native.FLAG_FAIL_AFTER_WRITE
            else:
                state.flags &= ~native.FLAG_FAIL_AFTER_WRITE
