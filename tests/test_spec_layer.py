"""The spec layer over stock Triton: hook table, resolution, injectors, install points, cache keys."""

import importlib
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
from helpers import CUDA, HIP, compile_for, make_spec, no_interpreter, set_interpreting
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

import tritonspec
from tritonspec import PROVIDERS, SpecError, SpecHookError
from tritonspec.specialization import check, install, resolve
from tritonspec.specialization.points import jit_caches
from tritonspec.specialization.inject import restore as restore_injections
from tritonspec.text_tables import parse_tables


# -- kernels (plain functions: wrapped as compiled JITFunctions or interpreted via triton.jit) --


def _atomic64(ptr, val_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.atomic_add(ptr + offs, tl.load(val_ptr + offs, mask=mask), mask=mask)


def _load_cm(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, cache_modifier=".spec"))


def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


def _arange48(out_ptr):
    offs = tl.arange(0, 48)
    tl.store(out_ptr + offs, offs)


def _bf16_atomic(ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.atomic_add(ptr + offs, tl.full([BLOCK], 1.0, tl.bfloat16))


COPY_SIG = ({"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128})


# -- spec functions used by test specs ------------------------------------------------------------


def xchg_instead_of_add(semantic, ptr, val, mask, sem, scope):
    """Observable stand-in for an int64 lowering: atomic exchange instead of add."""
    return semantic.atomic_xchg(ptr, val, mask, sem, scope)


def always_true():
    return True


def always_false():
    return False


def raising_cache_modifier(cm):
    raise KeyError("boom")


# ---------------------------------------------------------------------------------------------------


def test_every_hook_is_declared_once_with_an_install_point():
    points = {p.name for p in install.INSTALL_POINTS} | check.OWN_POINTS
    for hook in tritonspec.HOOKS.values():
        assert hook.point in points, hook
        assert hook.doc and hook.default


def test_points_in_tritonspecs_own_code_name_what_consults_them():
    """Own points come from the hook table: each must name a module of tritonspec or an attribute of one."""
    assert {"tritonspec.launch_config", "tritonspec.ops.attention", "tritonspec.ops.moe"} <= check.OWN_POINTS
    for point in check.OWN_POINTS:
        try:
            importlib.import_module(point)
        except ImportError:
            parent, name = point.rsplit(".", 1)
            assert hasattr(importlib.import_module(parent), name), point


def test_undeclared_hook_names_are_errors_with_suggestions(registry):
    with pytest.raises(SpecError, match="'num_stage_cap' is not a declared.*did you mean 'num_stages_cap'"):
        tritonspec.spec("num_stage_cap")
    with pytest.raises(SpecError, match="did you mean 'atomic_add_int64'"):
        tritonspec.spec_func("atomic_add_int46")
    bad = make_spec("bad_spec", atomic_add_int46=xchg_instead_of_add)
    with pytest.raises(SpecError, match="backend 'typo'.*'atomic_add_int46'.*did you mean 'atomic_add_int64'"):
        tritonspec.register_spec("typo", bad)
    missing = types.ModuleType("missing_spec")
    missing.__all__ = ["num_stages_cap"]
    with pytest.raises(SpecError, match="names 'num_stages_cap', which it does not define"):
        tritonspec.register_spec("missing", missing)
    with pytest.raises(TypeError, match="module must be a module"):
        tritonspec.register_spec("x", object())


def test_falsy_specialized_results_are_distinguishable(registry):
    tritonspec.register_spec("falsy", make_spec("falsy_spec", atomic_disable_bf16=always_false))
    with tritonspec.use_backend("falsy"):
        assert tritonspec.spec("atomic_disable_bf16") is False  # specialized to False ...
        assert tritonspec.spec_func("atomic_disable_bf16") is not None  # ... and spec_func says so
        assert tritonspec.spec_func("do_bench") is None  # not specialized
        assert tritonspec.spec("do_bench") is None


def test_resolution_order(registry, monkeypatch):
    for name in ("a", "b"):
        tritonspec.register_spec(name, make_spec(f"{name}_spec"))
    # targets and device types come from each backend's own declaration
    for name, targets, devices in (
        ("nvidia", ("cuda",), ("cuda",)),
        ("amd", ("hip",), ("cuda",)),
        ("cpu", (), ("cpu",)),
    ):
        info = tritonspec.BackendInfo(runs="real", targets=targets, devices=devices)
        tritonspec.register_spec(name, make_spec(f"{name}_spec", backend_info=info))
    no_interpreter(monkeypatch)
    assert resolve.current_backend("cuda") == "nvidia"
    assert resolve.current_backend("hip") == "amd"
    assert resolve.current_backend("iluvatar") == "iluvatar"
    with resolve.compiling_for("hip"):
        assert resolve.current_backend() == "amd"
    set_interpreting(monkeypatch, True)
    assert resolve.current_backend() == "cpu"
    tritonspec.set_default_backend("b")
    assert resolve.current_backend("cuda") == "b"
    with tritonspec.use_backend("a"):
        assert resolve.current_backend("cuda") == "a"
        with tritonspec.use_backend("b"):
            assert resolve.current_backend("hip") == "b"
        assert resolve.current_backend() == "a"
    with pytest.raises(SpecError, match="no spec registered for backend 'nope'"):
        with tritonspec.use_backend("nope"):
            pass


def test_driver_spec_is_used_only_when_a_driver_exists(registry, monkeypatch):
    from triton.runtime.driver import driver

    no_interpreter(monkeypatch)
    assert driver._active is None and driver._default is None
    assert tritonspec.spec("num_stages_cap") is None
    assert driver._active is None and driver._default is None, "resolving must never create a driver"

    class FakeDriver:  # FlagTree style: the driver carries its spec module
        spec = make_spec("flagtree_style", num_stages_cap=lambda: 7)

        def get_current_target(self):
            return GPUTarget("fakegpu", 1, 32)

    monkeypatch.setattr(driver, "_active", FakeDriver())
    from triton.runtime.driver import spec, spec_func  # FlagTree-compatible import path

    assert spec("num_stages_cap") == 7
    assert spec_func("num_stages_cap")() == 7


def test_spec_errors_name_backend_and_hook(registry):
    tritonspec.register_spec("raiser", make_spec("raiser_spec", ext_str_to_load_cache_modifier=raising_cache_modifier))
    with tritonspec.use_backend("raiser"):
        with pytest.raises(
            Exception, match="backend .raiser. spec hook .ext_str_to_load_cache_modifier. raised"
        ) as info:
            compile_for(_load_cm, {"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 32})
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    assert any(isinstance(e, SpecHookError) for e in chain)  # Triton's CompilationError wraps it


def test_a_hook_is_wrapped_once_per_spec_function(registry):
    """Ops look hooks up on every call: the error-naming wrapper is built once, and a new spec
    function (re-registration) gets its own."""
    tritonspec.register_spec("wrapped", make_spec("wrapped_spec", do_bench=lambda *a, **k: 1.0))
    first = resolve.lookup("do_bench", backend="wrapped")
    assert resolve.lookup("do_bench", backend="wrapped") is first
    tritonspec.register_spec("wrapped", make_spec("wrapped_spec", do_bench=lambda *a, **k: 2.0))
    second = resolve.lookup("do_bench", backend="wrapped")
    assert second is not first and second() == 2.0 and first() == 1.0


def test_injectors_install_and_restore_exact_objects(registry):
    from triton.language import core, math, semantic, standard

    orig = {"tl.exp": tl.exp, "math.exp": math.exp, "tl.maximum": tl.maximum}

    @core.builtin
    def my_twice(x, _semantic=None):
        return _semantic.mul(x, 2)

    @core.builtin
    def exp(x, _semantic=None):
        return _semantic.mul(x, 3)

    def ext_semantic_my_neg(self, x):
        return self.minus(x)

    spec = make_spec(
        "inj_spec",
        my_twice=my_twice,
        exp=exp,
        ext_semantic_my_neg=ext_semantic_my_neg,
        core_ext_spec_func_list=["my_twice"],
        math_ext_base_func_list=["exp"],
        semantic_ext_spec_func_list=["my_neg"],
    )
    spec.__all__ = ["core_ext_spec_func_list", "math_ext_base_func_list", "semantic_ext_spec_func_list"]
    tritonspec.register_spec("inj", spec)
    with tritonspec.use_backend("inj"):
        assert tl.my_twice is my_twice and core.my_twice is my_twice
        assert tl.exp is exp and math.exp is exp
        assert semantic.TritonSemantic.my_neg is ext_semantic_my_neg
        assert not hasattr(standard, "my_twice")
    assert not hasattr(tl, "my_twice") and not hasattr(core, "my_twice")
    assert not hasattr(semantic.TritonSemantic, "my_neg")
    assert tl.exp is orig["tl.exp"] and math.exp is orig["math.exp"] and tl.maximum is orig["tl.maximum"]


def test_injector_collisions_are_errors(registry):
    @tl.core.builtin
    def maximum(x, y, _semantic=None):
        return x

    clash = make_spec("clash_spec", maximum=maximum, core_ext_spec_func_list=["maximum"])
    clash.__all__ = ["core_ext_spec_func_list"]
    tritonspec.register_spec("clash", clash)
    with pytest.raises(SpecError, match="'maximum' already exists.*core_ext_base_func_list"):
        with tritonspec.use_backend("clash"):
            pass
    assert tl.maximum is not maximum
    fresh = make_spec("fresh_spec", brand_new=maximum, math_ext_base_func_list=["brand_new"])
    fresh.brand_new = maximum
    fresh.__all__ = ["math_ext_base_func_list"]
    tritonspec.register_spec("fresh", fresh)
    with pytest.raises(SpecError, match="'brand_new' does not exist in triton.language.math"):
        with tritonspec.use_backend("fresh"):
            pass
    restore_injections()


def test_vendor_spec_round_trip_compiled_and_interpreted(registry):
    """One FlagTree-style spec module changes semantics identically in compiled and interpreted kernels."""
    vendor = make_spec(
        "vendor_spec", atomic_add_int64=xchg_instead_of_add, arange_disable_check_power_of_two=always_true
    )
    tritonspec.register_spec("vendor", vendor)
    sig = {"ptr": "*i64", "val_ptr": "*i64", "n": "i32", "BLOCK": "constexpr"}
    stock = compile_for(_atomic64, sig, {"BLOCK": 32}).asm["ttir"]
    assert "atomic_rmw add" in stock
    with tritonspec.use_backend("vendor"):
        ttir = compile_for(_atomic64, sig, {"BLOCK": 32}).asm["ttir"]
    assert "atomic_rmw exch" in ttir and "atomic_rmw add" not in ttir

    # interpreted: the same spec turns the add into an exchange (the test session interprets)
    kernel = triton.jit(_atomic64)
    base = torch.randint(-(2**40), 2**40, (20,), dtype=torch.int64)
    val = torch.randint(-(2**40), 2**40, (20,), dtype=torch.int64)
    out = base.clone()
    kernel[(1,)](out, val, 20, BLOCK=32)
    assert torch.equal(out, base + val)
    out = base.clone()
    with tritonspec.use_backend("vendor"):
        kernel[(1,)](out, val, 20, BLOCK=32)
    assert torch.equal(out, val)

    # predicate hook: tl.arange(0, 48) is an error in stock, allowed by the vendor
    interp = triton.jit(_arange48)
    buf = torch.full((48,), -1, dtype=torch.int32)
    with pytest.raises(Exception, match="power of 2"):
        interp[(1,)](buf)
    with tritonspec.use_backend("vendor"):
        interp[(1,)](buf)
    assert torch.equal(buf, torch.arange(48, dtype=torch.int32))


def test_bf16_atomic_predicate(registry):
    tritonspec.register_spec("nobf16", make_spec("nobf16_spec", atomic_disable_bf16=always_true))
    sig = ({"ptr": "*bf16", "BLOCK": "constexpr"}, {"BLOCK": 32})
    assert "atomic_rmw fadd" in compile_for(_bf16_atomic, *sig).asm["ttir"]
    with tritonspec.use_backend("nobf16"):
        with pytest.raises(Exception, match="bfloat16 is not supported by backend 'nobf16'"):
            compile_for(_bf16_atomic, *sig)


def test_cache_keys_separate_spec_sets(registry):
    """The same kernel compiled under spec A, then B, gives different cache entries and binaries."""
    from triton._C.libtriton import ir

    def cg(cm):
        return ir.CACHE_MODIFIER.CG if cm == ".spec" else None

    def cs(cm):
        return ir.CACHE_MODIFIER.CS if cm == ".spec" else None

    tritonspec.register_spec("spec_a", make_spec("spec_a", ext_str_to_load_cache_modifier=cg))
    tritonspec.register_spec("spec_b", make_spec("spec_b", ext_str_to_load_cache_modifier=cs))
    sig = ({"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 128})
    with tritonspec.use_backend("spec_a"):
        a = compile_for(_load_cm, *sig)
    with tritonspec.use_backend("spec_b"):
        b = compile_for(_load_cm, *sig)
    with tritonspec.use_backend("spec_a"):
        a2 = compile_for(_load_cm, *sig)
    assert a.hash != b.hash and a.hash == a2.hash
    assert "ld.global.cg" in a.asm["ptx"], [l for l in a.asm["ttir"].splitlines() if "load" in l]
    assert re.search(r"cache_?[mM]odifier = cs", b.asm["ttir"])  # 3.6: cacheModifier = cs; 3.9: cache_policy<...>
    assert a.asm["ptx"] != b.asm["ptx"]
    assert a.asm["cubin"] != b.asm["cubin"]


def test_jit_in_memory_caches_follow_the_selection(registry):
    """A JITFunction's device caches are kept per selection (stock Triton keys them by device only)."""
    tritonspec.register_spec("sel", make_spec("sel_spec"))
    fn = JITFunction(_copy)
    assert isinstance(fn.device_caches, jit_caches.SelectionCaches)
    caches = jit_caches.SelectionCaches(object)  # the factory Triton passes is create_binder (needs a GPU)
    outside = caches["dev0"]
    assert caches["dev0"] is outside and list(caches) == ["dev0"]
    with tritonspec.use_backend("sel"):
        inside = caches["dev0"]
        assert inside is not outside
    assert caches["dev0"] is outside
    with tritonspec.use_backend("sel"):
        assert caches["dev0"] is inside


def test_pipeline_stages_hook_runs_for_each_target(registry, monkeypatch):
    monkeypatch.setattr(triton.knobs.compilation, "always_compile", True)  # stages run on cache misses only
    seen = []

    def pipeline_stages(backend, stages, options, language, capability):
        seen.append(type(backend).__name__)
        ttir = stages["ttir"]
        stages["ttir"] = lambda src, metadata: ttir(src, metadata)

    tritonspec.register_spec("pipe", make_spec("pipe_spec", pipeline_stages=pipeline_stages))
    with tritonspec.use_backend("pipe"):
        compile_for(_copy, *COPY_SIG, target=CUDA)
        compile_for(_copy, *COPY_SIG, target=HIP)
    assert seen == ["CUDABackend", "HIPBackend"]


def test_num_stages_cap_and_autotuner_pruning_and_do_bench(registry):
    def prune(configs, named_args):
        return [c for c in configs if c.num_warps <= 4]

    def do_bench(fn, *args, **kwargs):
        return 42.0

    tritonspec.register_spec("rt", make_spec("rt_spec", num_stages_cap=2, get_pruned_configs=prune, do_bench=do_bench))
    with tritonspec.use_backend("rt"):
        assert compile_for(_copy, *COPY_SIG).metadata.num_stages == 2
        assert triton.testing.do_bench(lambda: None) == 42.0
        configs = [triton.Config({"BLOCK": 64}, num_warps=w) for w in (2, 4, 8)]
        tuner = triton.autotune(configs=configs, key=["n"])(JITFunction(_copy))
        tuner.nargs = {"n": 10}
        assert [c.num_warps for c in tuner.prune_configs({})] == [2, 4]
    assert compile_for(_copy, *COPY_SIG).metadata.num_stages == 3


def test_interpreter_libdevice_hook(registry):
    from triton.runtime.interpreter import TensorHandle

    lib = types.ModuleType("np_libdevice")

    @tl.core.extern
    def tanh(arg0, _semantic=None):
        x = _semantic.to_tensor(arg0)
        return tl.tensor(TensorHandle(np.tanh(x.handle.data), x.dtype.scalar), x.type)

    lib.tanh = tanh

    @triton.jit
    def k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(y_ptr + offs, libdevice.tanh(tl.load(x_ptr + offs, mask=mask)), mask=mask)

    tritonspec.register_spec("npdev", make_spec("npdev_spec", interpreter_libdevice=lib))
    x = torch.randn(50)
    y = torch.full((50,), float("nan"))
    with tritonspec.use_backend("npdev"):
        k[(1,)](x, y, 50, BLOCK=64)
    torch.testing.assert_close(y.double(), torch.tanh(x.double()), rtol=1e-6, atol=1e-6)


def test_get_cc_hook(registry, monkeypatch, tmp_path):
    """The backend's host compiler builds launcher stubs (3.9: _find_compiler; 3.6: $CC inside _build)."""
    import shutil
    import triton.runtime.build as build

    monkeypatch.delenv("CC", raising=False)
    marker = tmp_path / "used"
    cc = tmp_path / "vendor-cc"
    cc.write_text(f'#!/bin/sh\necho used > {marker}\nexec {shutil.which("gcc") or shutil.which("cc")} "$@"\n')
    cc.chmod(0o755)
    tritonspec.register_spec("cc", make_spec("cc_spec", get_cc=lambda: str(cc)))
    src = f"""#include <Python.h>
static struct PyModuleDef m = {{PyModuleDef_HEAD_INIT, "ccprobe", NULL, -1, NULL}};
PyMODINIT_FUNC PyInit_ccprobe(void) {{ return PyModule_Create(&m); }}
/* {os.urandom(8).hex()} */
"""
    with tritonspec.use_backend("cc"):
        build.compile_module_from_src(src, "ccprobe")
    assert marker.exists(), "the spec's compiler was not used"


def test_deactivate_restores_stock_triton_and_reactivates():
    from triton.language.semantic import TritonSemantic

    patched = TritonSemantic.__dict__["atomic_add"]
    original = patched.__wrapped__
    compile_before = triton.compile
    tritonspec.deactivate()
    try:
        assert TritonSemantic.__dict__["atomic_add"] is original
        assert triton.compile is compile_before.__wrapped__
        assert not hasattr(sys.modules["triton.runtime.driver"], "spec")
    finally:
        tritonspec.activate()
    assert TritonSemantic.__dict__["atomic_add"] is not original
    assert hasattr(sys.modules["triton.runtime.driver"], "spec")


STOCK_IR = r"""
import hashlib, json, sys
sys.path.insert(0, {testdir!r})
import triton
from triton.backends.compiler import GPUTarget
from helpers import compile_for
import test_spec_layer as t
k = compile_for(t._copy, *t.COPY_SIG, target=GPUTarget(*{target!r}))
print(json.dumps({{s: hashlib.sha256(str(k.asm[s]).encode()).hexdigest() for s in {stages!r}}}))
"""


@pytest.mark.parametrize(
    "target,stages",
    [
        (("cuda", 90, 32), ("ttir", "ttgir", "llir", "ptx")),
        (("hip", "gfx942", 64), ("ttir", "ttgir", "llir", "amdgcn")),
    ],
)
def test_ir_is_byte_identical_to_stock_when_nothing_is_specialized(target, stages):
    import json

    code = STOCK_IR.format(testdir=os.path.dirname(__file__), target=target, stages=stages)
    out = {}
    for disable in ("1", "0"):
        env = dict(os.environ, TRITONSPEC_DISABLE=disable, TRITON_INTERPRET="0", TRITON_ALWAYS_COMPILE="1")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out[disable] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["0"] == out["1"]


ACTIVATION = r"""
import sys
import triton
print("tritonspec" in sys.modules, hasattr(sys.modules["triton.runtime.driver"], "spec"))
"""


def test_import_triton_alone_installs_the_hooks_unless_disabled():
    for disable, expected in (("0", "True"), ("1", "False")):
        env = dict(os.environ, TRITONSPEC_DISABLE=disable)
        proc = subprocess.run([sys.executable, "-c", ACTIVATION], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[1] == expected.split()[-1], proc.stdout


def test_points_that_cannot_apply_are_reported_not_raised():
    def boom(module):
        raise AttributeError("TritonSemantic has no attribute 'gone'")

    future = install.InstallPoint("test.future", "triton.language", boom, min_version=(99, 0))
    broken = install.InstallPoint("test.broken", "triton.language", boom)
    try:
        install._run(future, tl)
        install._run(broken, tl)
        assert install.STATUS["test.future"] == "n/a: needs triton >= 99.0"
        assert install.STATUS["test.broken"].startswith("failed: AttributeError")
    finally:
        install.STATUS.pop("test.future", None)
        install.STATUS.pop("test.broken", None)


def test_check_command_passes_and_claims_only_what_it_did():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    proc = subprocess.run(
        [sys.executable, "-m", "tritonspec.cli", "check"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout
    for name, provider in PROVIDERS.providers().items():  # every provider, with where it runs and its distribution
        assert any(
            line.split()[:6] == [name, provider.info.runs, "entry", "point", "of", "tritonspec"]
            for line in proc.stdout.splitlines()
            if line.strip()
        ), name
    # no binary is claimed that was not built; the reason is named
    samples = {row[0]: row for row in parse_tables(proc.stdout)["Sample kernels"]}
    assert samples["ascend"][2] == "ok (source,ttir); npubin: not built (bishengir-compile not on PATH)", samples
    # a hook compiled kernels cannot honour says so
    arange = [line for line in proc.stdout.splitlines() if line.startswith("arange_disable_check_power_of_two")]
    assert arange and "interpreter only" in arange[0]
    # Triton's FP-fusion warning does not interleave with the tables (check sets the knob itself)
    assert "TRITON_DEFAULT_FP_FUSION is unset" not in proc.stderr


def _exp_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.exp(tl.load(x_ptr + offs)))


def test_cross_compiling_uses_the_target_backends_injections(registry):
    """Compiling for hip in the same process applies the amd spec's tl injections, and only then."""

    @tl.core.builtin
    def exp(x, _semantic=None):
        return _semantic.mul(x, x, False)

    amd = make_spec(
        "amd_inject_spec",
        exp=exp,
        math_ext_base_func_list=["exp"],
        backend_info=tritonspec.BackendInfo(runs="compile-only", targets=("hip",)),
    )
    amd.__all__ = ["math_ext_base_func_list", "backend_info"]
    tritonspec.register_spec("amd", amd)
    stock_exp = tl.exp
    sig = ({"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 64})
    hip_ttir = compile_for(_exp_kernel, *sig, target=HIP).asm["ttir"]
    cuda_ttir = compile_for(_exp_kernel, *sig, target=CUDA).asm["ttir"]
    assert "math.exp" not in hip_ttir and "arith.mulf" in hip_ttir
    assert "math.exp" in cuda_ttir and "arith.mulf" not in cuda_ttir
    assert tl.exp is stock_exp


@pytest.mark.parametrize(
    "override,match",
    [
        (
            {"BLOCK_N": 2**40},
            "BLOCK_N=1099511627776 must be at most 1048576 \\(the most elements a Triton tensor holds\\)",
        ),
        ({"BLOCK_M": 2**31}, "BLOCK_M=2147483648 must be at most 1048576"),
        ({"BLOCK_N": -64}, "BLOCK_N=-64 must be >= 1"),
        ({"BLOCK_N": 96}, "BLOCK_N=96 must be a power of two"),
        ({"num_warps": 1024}, "num_warps=1024 must be at most 32"),
        ({"maxnreg": 4096}, "maxnreg=4096 must be at most 255"),
        ({"num_stages": 2**32}, "num_stages=4294967296 must be at most 2147483647"),
    ],
)
def test_a_launch_config_out_of_tritons_range_fails_where_it_is_looked_up(registry, override, match):
    """Named with backend, hook, kernel and key, before anything launches (not "arange must fit in int32"
    from inside the interpreter); as a function and as a ConfigTable alike."""
    from tritonspec import ConfigTable, LaunchConfigError, ops

    x, w = torch.randn(3, 64), torch.randn(64)
    hooks = {
        "fn": lambda kernel, **problem: dict(override),
        "table": ConfigTable({"rms_norm_fwd": lambda kernel, **problem: dict(override)}),
    }
    for name, hook in hooks.items():
        tritonspec.register_spec(f"huge-{name}", make_spec(f"huge_{name}_spec", kernel_config=hook))
        with tritonspec.use_backend(f"huge-{name}"):
            with pytest.raises(
                LaunchConfigError, match=f"^backend 'huge-{name}' kernel_config\\('rms_norm_fwd'\\): " + match
            ):
                ops.rms_norm(x, w)
