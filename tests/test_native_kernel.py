"""The compiled int8 decode kernel (``backends/csrc/`` via ``backends.native``).

The kernel is called directly on synthetic codes and scales and checked against the float64
oracle on the same codes (it adds no quantization of its own), over each implementation this
CPU runs, head widths that do and don't fill its 64-channel tiles, group sizes around its tile
of 4 query heads, lengths around its 64-position blocks, ring runs that start off the block
grid, and thread counts that split the positions. Then the build: cached by content, and every
way it can fail says why.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backends import native, native_build
from backends.contract import CacheSpec
from backends.cpu import DenseCache
from backends.int8 import Int8Backend, default_kernel
from backends.policy import EvictionPolicy
from quant import hadamard_rotation
from tests.oracle import attention_ref

KERNEL = native.load()  # this project's machines have a C compiler: failing to build is a failure
ISAS = ["portable", "avx2", "avx512", "avx512dot"]
HEAD_DIMS = [16, 48, 80, 128, 256]  # 48, 80: a 64-channel tile plus a 16-channel remainder
GROUPS = [1, 3, 4, 5, 8]  # query heads per KV head, around the tile of 4
# 7, 9: around the short blocks (at most 8 positions); from the test's start (37), 20: a block of
# two groups of 16 positions, 60: 27 then 33 positions, two groups then three
LENGTHS = [1, 7, 9, 20, 60, 63, 64, 65, 1000]
# float32 sums in a different order than float64: relative L2 of the output
RTOL = 1e-5
# The integer paths (avx2's vpmaddwd, avx512dot's vpdpwssd: the query and each block's weights
# in 15 bits, integer products) add that rounding: ~1e-5..1e-4 here, where the int8 cache's own
# codes cost 5e-3..1e-2 against the original data; the bound and why it is negligible there:
# docs/design.md, "int8 by integer dot products".
RTOL_INTEGER = 2e-4
INTEGER_ISAS = ("avx2", "avx512dot")


def _rtol(isa: str = "auto") -> float:
    """The bound for an implementation ("auto": the fastest this CPU runs)."""
    if isa == "auto":
        isa = KERNEL.isas(128)[-1]
    return RTOL_INTEGER if isa in INTEGER_ISAS else RTOL


def _isa_param(isa: str, d: int = 128):
    usable = isa in KERNEL.isas(d)
    return pytest.param(
        isa, marks=pytest.mark.skipif(not usable, reason=f"this CPU cannot run the {isa} path at D={d}")
    )


def _cpu_field(name: str) -> str | None:
    """A field of /proc/cpuinfo's first processor ("vendor_id", "cpu family"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(row for row in f if row.split(":")[0].strip() == name).partition(":")[2].strip()
    except (OSError, StopIteration):
        return None


# The library whose AVX-512 paths run emulated on AVX2 (tests/test_avx512_emulated.py) has them all.
EMULATED_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags as Linux names them (with the emulated AVX-512 ones where the
    library emulates them), or None off Linux or off x86-64."""
    field = _cpu_field("flags")
    if field is None:
        return None
    flags = set(field.split())
    emulated = os.environ.get("GQA_KERNEL_EMULATE_AVX512") == "1" and {"avx2", "fma", "f16c"} <= flags
    return flags | (EMULATED_AVX512 if emulated else set())


@pytest.mark.skipif(_cpu_flags() is None, reason="no /proc/cpuinfo flags (not Linux on x86-64)")
def test_each_isa_runs_exactly_where_the_cpu_has_its_instructions():
    # avx512dot needs VNNI only (its int8 block); an Ice Lake without BF16 runs it, its bfloat16
    # caches taking the AVX-512 block (isa.c)
    flags = _cpu_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    want = ["portable"] + ["avx2"] * avx2 + ["avx512"] * avx512 + ["avx512dot"] * (avx512 and "avx512_vnni" in flags)
    assert KERNEL.isas(128) == want
    assert KERNEL.isas(8) == ["portable"] + ["avx2"] * avx2  # AVX-512 blocks: D a multiple of 16
    assert KERNEL.isas(4) == ["portable"]


@pytest.mark.skipif(_cpu_flags() is None, reason="no /proc/cpuinfo flags (not Linux on x86-64)")
def test_auto_takes_the_fastest_path_and_bfloat16s_by_cpu():
    """ "auto" is the fastest path this CPU runs, but a bfloat16 cache takes vdpbf16ps (avx512dot)
    only on AMD's Zen 4 (family 25, 19h), where it was measured the faster way; Intel's Xeons
    issue one vdpbf16ps a cycle against two FMAs, and there the widening block (avx512) wins
    (docs/design.md, "bfloat16's block by CPU"); other CPUs take the widening block too."""
    best = KERNEL.isas(128)[-1]
    for dtype in (torch.float32, torch.float16, torch.int8):
        assert KERNEL.auto_isa(128, dtype) == best
    zen4 = _cpu_field("vendor_id") == "AuthenticAMD" and _cpu_field("cpu family") == "25"
    dot = best == "avx512dot" and "avx512_bf16" in _cpu_flags() and zen4
    want = "avx512" if best == "avx512dot" and not dot else best
    assert KERNEL.auto_isa(128, torch.bfloat16) == want
    assert KERNEL.auto_isa(8, torch.bfloat16) == KERNEL.isas(8)[-1]


def _problem(n, g, d, capacity, gen):
    q = torch.randn(n, g, d, generator=gen) / d**0.5
    k = torch.randint(-127, 128, (n, d, capacity), generator=gen, dtype=torch.int8)
    v = torch.randint(-127, 128, (n, capacity, d), generator=gen, dtype=torch.int8)
    ks = torch.rand(n, capacity, generator=gen) * 0.02
    vs = torch.rand(n, capacity, generator=gen) * 0.02
    return q, k, v, ks, vs


def _reference(q, k, v, ks, vs, runs, ko=None):
    """float64 attention over the dequantized codes of the runs, in run order; ``ko`` (N, O, C)
    float16 key channels follow the coded ones, unscaled."""
    pos = np.concatenate([np.arange(a, b) for a, b in runs])
    keys = k.double().numpy().transpose(0, 2, 1)[:, pos] * ks.double().numpy()[:, pos, None]
    if ko is not None:
        keys = np.concatenate([keys, ko.double().numpy().transpose(0, 2, 1)[:, pos]], axis=2)
    keys = keys[None]
    values = (v.double().numpy()[:, pos] * vs.double().numpy()[:, pos, None])[None]
    n, g, _ = q.shape
    # attention_ref scales by 1/sqrt(D); the kernel takes q already scaled
    qd = q.double().numpy().reshape(1, n * g, -1) * q.shape[-1] ** 0.5
    return attention_ref(qd, keys, values, n * g, n)[0].reshape(n, g, -1), pos


def _rel(out, ref):
    return float(np.linalg.norm(out.double().numpy() - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("isa", [_isa_param(i) for i in ISAS])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"D{d}" for d in HEAD_DIMS])
@pytest.mark.parametrize("g", GROUPS, ids=[f"G{g}" for g in GROUPS])
def test_matches_oracle_across_widths_and_groups(g, d, isa):
    gen = torch.Generator().manual_seed(d * 10 + g)
    q, k, v, ks, vs = _problem(2, g, d, 300, gen)
    runs = [(0, 300)]
    ref, pos = _reference(q, k, v, ks, vs, runs)
    out = KERNEL.attend(q, k, v, ks, vs, runs, isa=isa)
    assert out.shape == (2, g, d) and out.dtype == torch.float32
    assert _rel(out, ref) <= _rtol(isa)


@pytest.mark.parametrize("scales", [torch.float32, torch.float16], ids=["f32-scales", "f16-scales"])
@pytest.mark.parametrize("isa", [_isa_param(i) for i in ISAS])
@pytest.mark.parametrize("length", LENGTHS, ids=[f"S{s}" for s in LENGTHS])
def test_matches_oracle_across_lengths_runs_and_threads(length, isa, scales):
    gen = torch.Generator().manual_seed(length)
    n, g, d, capacity = 1, 4, 128, 1200
    q, k, v, ks, vs = _problem(n, g, d, capacity, gen)
    ks, vs = ks.to(scales), vs.to(scales)  # the reference dequantizes with the stored values
    # one run starting off the 64-position grid; the same positions as a wrapped ring's two runs
    start = 37
    run_sets = [[(start, start + length)]]
    if length > 1:
        cut = start + length // 2
        run_sets.append([(cut, start + length), (start, cut)])
    for runs in run_sets:
        ref, pos = _reference(q, k, v, ks, vs, runs)
        for threads in (1, 2, 3):  # one KV head: more threads means splits of the positions
            out = KERNEL.attend(q, k, v, ks, vs, runs, isa=isa, threads=threads)
            assert _rel(out, ref) <= _rtol(isa), (runs, threads)


@pytest.mark.parametrize("isa", [_isa_param(i) for i in ISAS])
@pytest.mark.parametrize("outliers", [1, 4])
def test_float16_key_outlier_channels_add_to_the_scores(outliers, isa):
    """q's last O channels meet the float16 rows ko (unscaled); the first D - O the codes."""
    gen = torch.Generator().manual_seed(outliers)
    n, g, d, c = 2, 4, 128, 200
    q, k, v, ks, vs = _problem(n, g, d, c, gen)
    k = k[:, : d - outliers].contiguous()
    ko = (torch.randn(n, outliers, c, generator=gen) * 20).half()
    runs = [(7, 180)]
    ref, _ = _reference(q, k, v, ks, vs, runs, ko)
    out = KERNEL.attend(q, k, v, ks, vs, runs, ko, isa=isa)
    assert _rel(out, ref) <= _rtol(isa)


@pytest.mark.parametrize("isa", [_isa_param(isa, 576) for isa in INTEGER_ISAS])
def test_more_than_512_coded_channels_take_the_float_block(isa):
    """int32 sums of more channel pairs could overflow: an integer path hands such heads to its
    ISA's float block, whose float32 rounding (RTOL) the integer path's 15 bits would not meet."""
    gen = torch.Generator().manual_seed(5)
    n, g, d, c = 1, 4, 576, 150
    q, k, v, ks, vs = _problem(n, g, d, c, gen)
    runs = [(0, c)]
    ref, _ = _reference(q, k, v, ks, vs, runs)
    assert _rel(KERNEL.attend(q, k, v, ks, vs, runs, isa=isa), ref) <= RTOL


def test_padded_key_rows():
    """Key rows a line apart beyond C, as the cache has them."""
    gen = torch.Generator().manual_seed(2)
    n, g, d, c = 3, 2, 64, 200
    q, _, v, ks_ring, vs_ring = _problem(n, g, d, c, gen)
    k = torch.randint(-127, 128, (n, d, 256), generator=gen, dtype=torch.int8)[..., :c]
    runs = [(10, 150)]
    ref, pos = _reference(q, k.contiguous(), v, ks_ring, vs_ring, runs)
    out = KERNEL.attend(q, k, v, ks_ring, vs_ring, runs)
    assert _rel(out, ref) <= _rtol()


def test_zero_rows_and_peaked_scores_stay_finite():
    n, g, d, c = 1, 4, 64, 130
    gen = torch.Generator().manual_seed(4)
    q, k, v, ks, vs = _problem(n, g, d, c, gen)
    ks[:, :40] = 0.0  # all-zero rows (scale 0)
    vs[:, :40] = 0.0
    q *= 1000.0  # scores in the thousands: exp() must not overflow
    runs = [(0, c)]
    ref, _ = _reference(q, k, v, ks, vs, runs)
    for isa in KERNEL.isas(d):
        out = KERNEL.attend(q, k, v, ks, vs, runs, isa=isa)
        assert bool(torch.isfinite(out).all())
        assert _rel(out, ref) <= _rtol(isa), isa


def test_bad_arguments_are_refused():
    gen = torch.Generator().manual_seed(1)
    q, k, v, ks, vs = _problem(1, 2, 32, 50, gen)
    with pytest.raises(ValueError, match="float32"):
        KERNEL.attend(q.double(), k, v, ks, vs, [(0, 50)])
    with pytest.raises(ValueError, match="scales"):
        KERNEL.attend(q, k, v, ks.double(), vs.double(), [(0, 50)])
    with pytest.raises(ValueError, match="scales"):
        KERNEL.attend(q, k, v, ks.half(), vs, [(0, 50)])
    with pytest.raises(ValueError, match="scales"):
        KERNEL.attend(q, k, v, ks[:, :10], vs[:, :10], [(0, 50)])
    with pytest.raises(ValueError, match="k must be"):  # positions not contiguous
        KERNEL.attend(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, ks, vs, [(0, 50)])
    with pytest.raises(ValueError, match="q has 32 channels"):
        KERNEL.attend(q, k[:, :30], v, ks, vs, [(0, 50)])
    with pytest.raises(ValueError, match="ko must be float16"):
        KERNEL.attend(q, k[:, :30].contiguous(), v, ks, vs, [(0, 50)], torch.zeros(1, 2, 50))
    with pytest.raises(RuntimeError, match="Invalid argument"):  # a run beyond the capacity
        KERNEL.attend(q, k, v, ks, vs, [(0, 60)])
    if "avx512" not in KERNEL.isas(24):  # D = 24 is not a multiple of 16
        q24, k24, v24, ks24, vs24 = _problem(1, 2, 24, 50, gen)
        with pytest.raises(RuntimeError, match="not supported"):
            KERNEL.attend(q24, k24, v24, ks24, vs24, [(0, 50)], isa="avx512")


@pytest.mark.parametrize("d", [1, 2, 12, 64, 128])
def test_hadamard_is_the_rotation_product(d):
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    want = x.double() @ hadamard_rotation(d, torch.float64)
    got = KERNEL.hadamard(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(KERNEL.hadamard(got).double(), x.double(), atol=1e-5, rtol=1e-5)  # H H = I


def _butterfly(x: np.ndarray, block: int) -> np.ndarray:
    """The fast Walsh-Hadamard transform in float32, in the scalar loop's order of operations."""
    y = x.astype(np.float32).copy()
    for b0 in range(0, y.shape[-1], block):
        length = 1
        while length < block:
            for i in range(b0, b0 + block, 2 * length):
                a, b = y[..., i : i + length].copy(), y[..., i + length : i + 2 * length].copy()
                y[..., i : i + length], y[..., i + length : i + 2 * length] = a + b, a - b
            length *= 2
        y[..., b0 : b0 + block] *= np.float32(1.0 / np.sqrt(np.float32(block), dtype=np.float32))
    return y


@pytest.mark.parametrize("d", [1, 4, 8, 16, 24, 48, 64, 128, 256])
def test_hadamard_has_the_scalar_transforms_bits(d):
    """Every path this CPU takes (8 or 16 lanes a register, spans within one and across them)
    adds and subtracts as the scalar loop does, so the bits are the same."""
    x = torch.randn(7, d, generator=torch.Generator().manual_seed(100 + d))
    want = _butterfly(x.numpy(), d & -d)
    assert np.array_equal(KERNEL.hadamard(x).numpy().view(np.int32), want.view(np.int32))


# -- the build -------------------------------------------------------------------------------------


def _stand_in_tree(tmp_path, monkeypatch, files: dict[str, str]) -> Path:
    """A small source tree (file name -> text) in place of the kernel's csrc/: the build steps
    are the same, and the kernel's own build (35-60 s) is the one every other test loads."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for name, text in files.items():
        (csrc / name).write_text(text)
    monkeypatch.setattr(native_build, "CSRC", csrc)
    return csrc


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    """The cache key is every source's content (a stand-in tree of two files and a header)."""
    csrc = _stand_in_tree(
        tmp_path,
        monkeypatch,
        {
            "gqa_internal.h": "#define GQA_TWO 2\n",
            "a.c": '#include "gqa_internal.h"\nint gqa_a(int x) { return x * GQA_TWO; }\n',
            "b.c": '#include "gqa_internal.h"\nint gqa_b(int x) { return x + GQA_TWO; }\n',
        },
    )
    out = tmp_path / "out"
    first = native_build.build(out)
    mtime = first.stat().st_mtime_ns
    assert native_build.build(out) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    header = csrc / "gqa_internal.h"  # a header is part of the key, not only the .c files
    header.write_text(header.read_text() + "\n/* changed */\n")
    second = native_build.build(out)
    assert second != first and second.exists()
    assert len(list(out.glob("*.so"))) == 2  # no temporaries left


def test_the_test_build_shares_every_object_that_ignores_the_hooks(tmp_path, monkeypatch):
    """Only a source that tests GQA_TEST_HOOKS compiles with it (every source, once a header
    does); the test build reuses the production build's other objects from the object cache."""
    csrc = _stand_in_tree(
        tmp_path,
        monkeypatch,
        {
            "gqa_internal.h": "int gqa_plain(void);\n",
            "plain.c": '#include "gqa_internal.h"\nint gqa_plain(void) { return 7; }\n',
            "hooks.c": "#ifdef GQA_TEST_HOOKS\nint gqa_test_hooks(void) { return 1; }\n#endif\n",
        },
    )
    monkeypatch.delenv("GQA_KERNEL_SANITIZE", raising=False)
    out = tmp_path / "out"

    def build(hooks: bool) -> ctypes.CDLL:
        monkeypatch.setenv("GQA_KERNEL_TEST_HOOKS", "1" if hooks else "0")
        return ctypes.CDLL(str(native_build.build(out)))

    def objects(stem: str) -> int:
        return len(list((out / "objects").glob(f"{stem}-*.o")))

    production = build(hooks=False)
    assert not hasattr(production, "gqa_test_hooks") and production.gqa_plain() == 7
    test = build(hooks=True)
    assert test.gqa_test_hooks() == 1 and test.gqa_plain() == 7
    assert objects("plain") == 1 and objects("hooks") == 2  # plain.c compiled once for both
    # a header that tests the define gives it to every source
    (csrc / "gqa_internal.h").write_text("#ifdef GQA_TEST_HOOKS\n#define SEVEN 70\n#else\n#define SEVEN 7\n#endif\n")
    (csrc / "plain.c").write_text('#include "gqa_internal.h"\nint gqa_plain(void) { return SEVEN; }\n')
    assert build(hooks=False).gqa_plain() == 7 and build(hooks=True).gqa_plain() == 70


def test_the_production_library_has_no_test_hooks(monkeypatch):
    """The failure injection is compiled into the test build only (the tests load it:
    tests/conftest.py); the production library ignores FLAG_FAIL_AFTER_WRITE."""
    assert native.load().test_hooks  # this process: the test build
    monkeypatch.delenv("GQA_KERNEL_TEST_HOOKS", raising=False)
    monkeypatch.delenv("GQA_KERNEL_SANITIZE", raising=False)
    production = native.Kernel(native.build())  # make install's build, in the shared cache
    assert "testhooks" not in production.path.name and not production.test_hooks
    assert not production.stamps and not native.load().stamps  # stamps: tests/bench/stamp_profile.py's build only
    monkeypatch.setattr(native, "load", lambda: production)
    cache = DenseCache(CacheSpec(1, 2, 1, 16, torch.float32, EvictionPolicy.none(4)), "native")
    assert cache._native is production
    cache._fail_after_write = True
    out = cache.step(torch.ones(1, 2, 16), torch.ones(1, 1, 16), torch.ones(1, 1, 16))  # not refused
    assert out.tokens_seen == 1 and torch.equal(out.output, torch.ones(1, 2, 16))


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GQA_KERNEL_CACHE", str(tmp_path / "k"))
    assert native_build.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("GQA_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_build.cache_dir() == tmp_path / "xdg" / "gqa-serve"


def test_missing_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.NativeUnavailable, match="cannot run the C compiler"):
        native_build.build(tmp_path / "cache")


def test_compiler_errors_are_reported(tmp_path, monkeypatch):
    _stand_in_tree(tmp_path, monkeypatch, {"broken.c": "int f(void) { return undeclared_name; }\n"})
    with pytest.raises(native.NativeUnavailable, match="undeclared_name"):
        native_build.build(tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir()]  # the failed output was removed


def test_unwritable_cache_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(native.NativeUnavailable, match="not writable"):
        native_build.build(blocker / "sub")


def test_backend_falls_back_to_torch_kernels_without_the_native_one(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: (False, "no C compiler"))
    assert default_kernel("cpu") == "int_mm"
    assert default_kernel("meta") == "blocks"
    monkeypatch.undo()
    assert default_kernel("cpu") == "native"
    assert Int8Backend().create_cache(_spec()).kernel == "native"


def test_the_server_log_says_which_kernel_serves(monkeypatch, caplog):
    from backends import int8

    caplog.set_level("INFO", logger="backends.int8")
    int8._log_kernel.cache_clear()
    assert Int8Backend.probe() == []
    assert "int8: native kernel" in caplog.text and str(KERNEL.path) in caplog.text
    caplog.clear()
    monkeypatch.setattr(native, "available", lambda: (False, "no C compiler (test)"))
    int8._warn_fallback.cache_clear()
    assert default_kernel("cpu") == "int_mm"
    assert "unavailable (no C compiler (test)); using the int_mm kernel" in caplog.text
    int8._warn_fallback.cache_clear()
    int8._log_kernel.cache_clear()


def _spec():
    return CacheSpec(1, 4, 2, 32, torch.float32, EvictionPolicy.none(16))


def test_prebuild_command(tmp_path):
    """``python -m backends.native build DIR``: the library's path in DIR and the paths it runs
    here, then the torch step module's path; usage and a missing compiler as one line. DIR
    already holds both builds (the ones this process loaded, by their content names), so nothing
    compiles: the builds themselves are ``test_build_is_cached_by_content``'s and
    ``test_torch_step_module_is_built_once_and_cached``'s."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    loaded = native.load().path
    shutil.copy(loaded, tmp_path / loaded.name)
    module = Path(native.load_torch_step().__file__)
    shutil.copy(module, tmp_path / module.name)
    done = subprocess.run(
        [sys.executable, "-m", "backends.native", "build", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{tmp_path / loaded.name} (") and "portable" in done.stdout, done.stdout
    assert done.stdout.splitlines()[1] == str(tmp_path / module.name), done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([loaded.name, module.name])
    bad = subprocess.run([sys.executable, "-m", "backends.native"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr
    no_cc = subprocess.run(
        [sys.executable, "-m", "backends.native", "build", str(tmp_path / "other")],
        capture_output=True,
        text=True,
        env={**env, "CC": str(tmp_path / "no-cc")},
        timeout=60,
    )
    assert no_cc.returncode == 1 and "cannot run the C compiler" in no_cc.stderr and "Traceback" not in no_cc.stderr
