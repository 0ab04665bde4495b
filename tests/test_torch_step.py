"""The public step's C++ entry (``backends/csrc/torch_step.cpp``, ``native.load_torch_step``):
the same results as the ctypes path it stands in for, every tensor it does not take handed back
to that path (whose checks name what is wrong), and its build cached."""

from __future__ import annotations

import ctypes
import dataclasses
import weakref
from pathlib import Path

import pytest
import torch

from backends import native, native_build
from backends.contract import CacheSpec, StepOutcome
from backends.cpu import DenseCache
from backends.errors import CacheFullError, InputTypeError, InputValueError
from backends.int8 import Int8Backend
from backends.policy import EvictionPolicy

try:
    native.load()
    native_build.build_torch_step()  # `make install`'s, or built now (~12 s) where pytest runs alone
    native._torch_step.cache_clear()
    native.load_torch_step()
except native.NativeUnavailable as exc:  # pragma: no cover - this machine builds both
    pytest.skip(f"the torch step module cannot be built here: {exc}", allow_module_level=True)

HQ, HKV, D = 8, 2, 32
POLICIES = {
    "none": EvictionPolicy.none(64),
    "strict": EvictionPolicy.strict(5),
    "greedy": EvictionPolicy.greedy(6, 9),
    "sink": EvictionPolicy.sink(7, 2),
}


def _cache(backend: str, dtype: torch.dtype, policy: EvictionPolicy):
    spec = CacheSpec(1, HQ, HKV, D, dtype, policy)
    return Int8Backend().create_cache(spec) if backend == "int8" else DenseCache(spec, "native")


def _spy(cache) -> list:
    """Wraps the cache's C++ entry: each call's return value is appended to the list."""
    fn, ctx, kernel = cache._fast
    seen: list = []
    cache._fast = (lambda *a: seen.append(fn(*a)) or seen[-1], ctx, kernel)
    return seen


def _inputs(gen, dtype, n):
    return [tuple(torch.randn(1, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV)) for _ in range(n)]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    "backend,dtype",
    [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cpu", torch.float16), ("int8", torch.float32)],
)
def test_the_cpp_entry_steps_as_the_ctypes_path_does(backend, dtype, policy):
    """Two caches of one spec, one stepped through the C++ entry and one through ctypes (its
    entry removed), 30 steps: every output bit-identical and every outcome field equal. int8's
    first steps (its calibration, in Python) are included."""
    fast, slow = _cache(backend, dtype, POLICIES[policy]), _cache(backend, dtype, POLICIES[policy])
    assert fast._fast is not None
    slow._fast = None
    seen = _spy(fast)
    for q, k, v in _inputs(torch.Generator().manual_seed(7), dtype, 30):
        a, b = fast.step(q, k, v), slow.step(q, k, v)
        assert torch.equal(a.output, b.output)
        assert dataclasses.replace(a, output=None) == dataclasses.replace(b, output=None)
    assert sum(type(r) is StepOutcome for r in seen) >= 30 - 16  # int8's calibration steps are Python's


def _twins(policy: str = "sink"):
    """A cache with the C++ entry and its ctypes twin, and step(): one step of both on the next
    random inputs, returning the entry's output after checking it against the twin's."""
    fast, slow = _cache("cpu", torch.float32, POLICIES[policy]), _cache("cpu", torch.float32, POLICIES[policy])
    slow._fast = None
    steps = iter(_inputs(torch.Generator().manual_seed(11), torch.float32, 40))

    def step():
        q, k, v = next(steps)
        a, b = fast.step(q, k, v), slow.step(q, k, v)
        assert torch.equal(a.output, b.output) and a.tokens_seen == b.tokens_seen
        return a.output

    return fast, step


def test_an_output_the_caller_let_go_of_is_written_again_and_one_it_holds_never_is():
    """A step's output is a tensor of its own. Once the caller drops it (with the outcome), the
    cache's next step writes into the same tensor again; the outputs the caller keeps are each
    its own and later steps leave them as they were."""
    _, step = _twins()
    first = step().data_ptr()  # dropped at once
    assert [step().data_ptr() for _ in range(3)] == [first] * 3
    kept = [step() for _ in range(4)]
    assert len({t.data_ptr() for t in kept}) == 4 and kept[0].data_ptr() == first
    copies = [t.clone() for t in kept]
    for _ in range(5):
        assert step().data_ptr() not in {t.data_ptr() for t in kept}
    assert all(torch.equal(t, c) for t, c in zip(kept, copies))


@pytest.mark.parametrize("hold", ["view", "numpy", "weak reference", "gradient"])
def test_an_output_still_referred_to_is_not_written_again(hold):
    """The caller drops an output but keeps a view of it, a numpy array on it or a weak
    reference to it, or made it require a gradient: the next step makes a new tensor. A view or
    an array keeps the old memory, which no later step writes."""
    _, step = _twins()
    out = step()
    at, before = out.data_ptr(), out.detach().clone()
    if hold == "view":
        kept = out[0, 1:]
    elif hold == "numpy":
        kept = out.numpy()
    elif hold == "weak reference":
        called = []
        kept = weakref.ref(out, called.append)  # its callback runs inside the step that lets go of it
    else:
        out.requires_grad_()
    del out
    assert step().data_ptr() != at
    if hold in ("view", "numpy"):
        for _ in range(3):
            assert step().data_ptr() != at
        assert torch.equal(torch.as_tensor(kept), before[0, 1:] if hold == "view" else before)
    elif hold == "weak reference":
        assert kept() is None and called == [kept]  # the cache let go of it when it made the new one


def test_tensors_the_entry_does_not_take_go_through_the_checks():
    """A transposed view (not contiguous), a tensor subclass, the wrong dtype and the wrong
    shape: the C++ entry answers None and calls nothing; the first two are stepped by the
    ctypes path with the results of their contiguous plain copies, the last two are refused by
    name with the cache unchanged, as is a sparse tensor. torch's own ``Parameter`` is a plain
    tensor to the entry."""
    gen = torch.Generator().manual_seed(3)
    cache, twin = _cache("cpu", torch.float32, POLICIES["strict"]), _cache("cpu", torch.float32, POLICIES["strict"])
    seen = _spy(cache)
    q, k, v = _inputs(gen, torch.float32, 1)[0]
    q_view = q.reshape(1, D, HQ).clone().transpose(1, 2)  # (1, HQ, D), strides (.., 1, HQ)
    q_view.copy_(q)
    assert not q_view.is_contiguous()
    out = cache.step(q_view, k, v).output
    assert seen == [None] and torch.equal(out, twin.step(q, k, v).output)

    class Sub(torch.Tensor):
        pass

    out = cache.step(q.clone().as_subclass(Sub), k, v).output
    assert seen[-1] is None and torch.equal(out, twin.step(q, k, v).output)
    out = cache.step(torch.nn.Parameter(q.clone(), requires_grad=False), k, v).output  # torch's own
    assert type(seen[-1]) is StepOutcome and torch.equal(out, twin.step(q, k, v).output)
    before = cache.tokens_seen, cache.export()
    with pytest.raises(InputTypeError, match="query: dtype"):
        cache.step(q.double(), k.double(), v.double())
    with pytest.raises(InputValueError, match="new_key"):
        cache.step(q, k[:, :1], v)
    assert seen[-2:] == [None, None] and len(seen) == 5
    assert cache.tokens_seen == before[0] and all(torch.equal(x, y) for x, y in zip(cache.export(), before[1]))
    sparse = q.to_sparse()  # a CPU tensor of the right dtype and shape that has no data pointer
    with pytest.raises(InputTypeError, match="query: a sparse_coo tensor"):
        cache.step(sparse, k, v)
    assert seen[-1] is None and cache.tokens_seen == before[0]
    out = cache.step(q, k, v).output  # and the next plain step is the entry's again
    assert type(seen[-1]) is StepOutcome and torch.equal(out, twin.step(q, k, v).output)


def test_a_row_the_kernel_refuses_is_reported_as_on_the_ctypes_path():
    """A full policy-none cache (the kernel's -ENOSPC) and an int8 step with a NaN (its value
    check, -EDOM): the entry returns 0, and the step raises the same error as the ctypes path,
    with nothing written."""
    gen = torch.Generator().manual_seed(5)
    full = _cache("cpu", torch.float32, EvictionPolicy.none(2))
    seen = _spy(full)
    steps = _inputs(gen, torch.float32, 3)
    for q, k, v in steps[:2]:
        full.step(q, k, v)
    with pytest.raises(CacheFullError):
        full.step(*steps[2])
    assert seen[-1] == 0 and full.tokens_seen == 2
    int8 = _cache("int8", torch.float32, POLICIES["none"])
    for q, k, v in _inputs(gen, torch.float32, 20):  # past the calibration: the native step
        int8.step(q, k, v)
    seen = _spy(int8)
    q, k, v = _inputs(gen, torch.float32, 1)[0]
    k[0, 1, 3] = float("nan")
    before = int8.export()
    with pytest.raises(InputValueError, match="new_key"):
        int8.step(q, k, v)
    assert seen == [0] and int8.tokens_seen == 20
    assert all(torch.equal(x, y) for x, y in zip(int8.export(), before))


def test_without_the_module_the_caches_step_through_ctypes(monkeypatch):
    """``GQA_TORCH_STEP=0``, or a module not built, leaves a new cache without the entry (and
    nothing is compiled for it); its steps are the ctypes path's, with the same results."""
    monkeypatch.setenv("GQA_TORCH_STEP", "0")
    assert native._torch_step.__wrapped__() == (None, "disabled by GQA_TORCH_STEP=0")
    monkeypatch.setenv("GQA_TORCH_STEP", "1")
    monkeypatch.setattr(native, "torch_step_path", lambda: Path("/nonexistent/_gqa_torch_step.so"))
    module, reason = native._torch_step.__wrapped__()  # never compiles: a missing module is a reason
    assert module is None and "not built" in reason and "python -m backends.native build" in reason

    def unavailable():
        raise native.NativeUnavailable("no C++ compiler")

    monkeypatch.setattr(native, "load_torch_step", unavailable)
    plain = _cache("cpu", torch.bfloat16, POLICIES["sink"])
    monkeypatch.undo()
    entry = _cache("cpu", torch.bfloat16, POLICIES["sink"])
    assert plain._fast is None and entry._fast is not None
    for q, k, v in _inputs(torch.Generator().manual_seed(9), torch.bfloat16, 12):
        assert torch.equal(plain.step(q, k, v).output, entry.step(q, k, v).output)


def test_the_entry_refuses_a_malformed_context():
    """Its own arguments are checked (a TypeError naming them), not trusted."""
    step = native.load_torch_step().step
    q = torch.zeros(1, HQ, D)
    with pytest.raises(TypeError, match="ctx is a 7-tuple"):
        step((1, 2), q, q, q, q)
    with pytest.raises(TypeError, match="tensors"):
        step((1, 2, 3, 4, 5, "q", "kv"), q, q, q, q)
    with pytest.raises(ValueError, match="null address"):
        step((0, 2, 3, 4, 5, q, q), q, q, q, q)
    public = native.load_torch_step().step_public
    ctx = _cache("cpu", torch.float32, POLICIES["strict"])._fast[1]
    with pytest.raises(TypeError, match="pctx is"):
        public(ctx[:3], q, q, q)
    with pytest.raises(TypeError, match="pctx is"):
        public((*ctx[:3], "rows", *ctx[4:]), q, q, q)
    with pytest.raises(TypeError, match="pctx is"):
        public((*ctx[:3], [], *ctx[4:]), q, q, q)
    with pytest.raises(TypeError, match="descriptor that cannot set"):
        public((*ctx[:5], (StepOutcome.__init__,) * 9, ctx[6]), q, q, q)


def test_torch_step_module_is_built_once_and_cached(tmp_path, monkeypatch):
    """The module is named by its source, torch's version and Python's ABI: asked again, the
    cached file is returned without compiling; with no C++ compiler the reason is said in one
    line."""
    built = Path(native.load_torch_step().__file__)
    mtime = built.stat().st_mtime_ns
    assert native_build.build_torch_step(built.parent) == built and built.stat().st_mtime_ns == mtime
    assert torch.__version__.encode() not in built.name.encode()  # a hash, not a readable key
    monkeypatch.setenv("CXX", str(tmp_path / "no-c++"))
    with pytest.raises(native.NativeUnavailable, match="cannot run the C compiler"):
        native_build.build_torch_step(tmp_path)
    assert not list(tmp_path.glob("*.so"))


def test_the_entry_alerts_the_pool_where_the_python_path_would():
    """The entry calls gqa_prewake first (its address in the context) for a cache whose steps
    can use the pool, as the ctypes path does before its checks; for one too small, nothing."""
    spec = CacheSpec(1, 32, 8, 64, torch.float32, EvictionPolicy.none(1200))
    big, small = DenseCache(spec, "native"), _cache("cpu", torch.float32, POLICIES["strict"])
    prewake = ctypes.cast(big._native.prewake, ctypes.c_void_p).value
    assert big._wake is not None and big._fast[1][1:3] == (prewake, ctypes.addressof(big._state))
    assert small._wake is None and small._fast[1][1] == 0


def test_the_entry_calls_the_kernel_it_was_made_for():
    """A cache's entry holds gqa_step's own address; a stand-in kernel put on the cache later
    (as the fault tests do) is called through ctypes, not bypassed by the entry."""
    cache = _cache("cpu", torch.float32, POLICIES["strict"])
    kernel = cache._native
    assert cache._fast[1][0][0] == ctypes.cast(kernel.step, ctypes.c_void_p).value and cache._fast[2] is kernel

    class StandIn:
        def __init__(self, real):
            self.real, self.calls = real, 0

        def __getattr__(self, name):
            return getattr(self.real, name)

        def step(self, *args):
            self.calls += 1
            return self.real.step(*args)

    cache._native = StandIn(kernel)
    seen = _spy(cache)
    q, k, v = _inputs(torch.Generator().manual_seed(1), torch.float32, 1)[0]
    assert cache.step(q, k, v).tokens_seen == 1
    assert cache._native.calls == 1 and seen == []
