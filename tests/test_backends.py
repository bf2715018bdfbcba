"""Vendor backends under third_party/: what each spec specializes, tested on a CPU.

Language semantics run in the interpreter (conftest sets TRITON_INTERPRET=1) under the backend's
spec (``use_backend``); compiler-side behaviour is checked by compiling offline for the backend's
target (``JITFunction`` wraps plain functions, since ``triton.jit`` interprets here).
"""

import functools
import os
import pathlib
import re
import stat
import sys

import pytest
from helpers import ASCEND, CUDA, ILUVATAR, compile_for, py_random
from offline import run_checks, run_without_interpreter
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import libdevice as cuda_libdevice

import tritonspec
from tritonspec import PROVIDERS
from tritonspec_backends.ascend.backend import compiler as ascend_compiler
from tritonspec_backends.ascend.backend.driver import AscendDriver
from tritonspec_backends.iluvatar.backend import driver as iluvatar_driver
from tritonspec_backends.iluvatar.backend.compiler import IluvatarBackend
from tritonspec_backends.iluvatar.backend.spec import configs as iluvatar_configs
from tritonspec_backends.nvidia.backend.spec import configs as nvidia_configs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests: interpreted kernels (TRITON_INTERPRET=1)"
)

# Offline compiles run in one subprocess without TRITON_INTERPRET: under the interpreter, tl's own
# @jit helpers (tl.zeros, ...) are interpreted functions and cannot be traced by the compiler.
COMPILE_CHECKS = {}


def compile_check(fn):
    """Register ``fn`` (no arguments; raises on failure) to run in the compiler subprocess."""
    COMPILE_CHECKS[fn.__name__] = fn
    return fn


def run_compile_checks():
    run_checks(COMPILE_CHECKS)


@pytest.fixture(scope="module")
def compiled():
    return run_without_interpreter("test_backends", "run_compile_checks", timeout=600)


# ------------------------------------------------------------------------------------------------
# registration: every backend's spec and where it really runs
# ------------------------------------------------------------------------------------------------

IN_TREE = sorted(
    p.parents[2].name for p in (pathlib.Path(__file__).parents[1] / "third_party").glob("*/backend/spec/__init__.py")
)


@pytest.mark.parametrize("backend", IN_TREE)
def test_spec_providers_load_and_say_where_they_run(backend):
    """Every in-tree backend package is an entry point of this distribution and declares its identity."""
    provider = PROVIDERS.get(backend)
    assert provider is not None and provider.origin == "entry point" and provider.distribution == "tritonspec"
    assert provider.module.__name__ == f"tritonspec_backends.{backend}.backend.spec"
    info = provider.info
    assert info.runs in ("real", "emulated", "compile-only") and info.note
    assert info.targets or info.devices, "a backend must be reachable by a compile target or a device type"
    for target in info.targets:
        assert tritonspec.specialization.resolve.backend_for_target(target) == backend


def test_new_triton_backends_are_discovered_next_to_the_stock_ones():
    from triton.backends import backends
    from triton.backends.nvidia.compiler import CUDABackend

    assert backends["iluvatar"].compiler is IluvatarBackend
    assert backends["ascend"].compiler is ascend_compiler.AscendBackend
    assert backends["nvidia"].compiler is CUDABackend  # the stock CUDA backend, not a second one
    assert [b for b, v in backends.items() if v.compiler.supports_target(CUDA)] == ["nvidia"]
    assert [b for b, v in backends.items() if v.compiler.supports_target(ILUVATAR)] == ["iluvatar"]


def test_nvidia_spec_changes_nothing_but_launch_configs_and_hoppers_own_kernels():
    provider = PROVIDERS.get("nvidia")
    assert sorted(provider.exports) == [
        "attention_backward",
        "attention_forward",
        "backend_info",
        "kernel_config",
        "moe_experts_gemm",
        "moe_weight_grad",
    ]


def test_iluvatar_driver_is_active_only_when_selected(monkeypatch):
    monkeypatch.delenv("TRITON_DEFAULT_BACKEND", raising=False)
    assert not iluvatar_driver.selected()
    assert not iluvatar_driver.IluvatarDriver.is_active()  # no selection: never a second active driver
    with tritonspec.use_backend("iluvatar"):
        assert iluvatar_driver.selected()
        # active only where a CUDA GPU exists as well
        assert iluvatar_driver.IluvatarDriver.is_active() == torch.cuda.is_available()
    tritonspec.set_default_backend("iluvatar")  # TRITONSPEC_DEFAULT_BACKEND=iluvatar sets this at import
    try:
        assert iluvatar_driver.selected()
    finally:
        tritonspec.set_default_backend(None)


# ------------------------------------------------------------------------------------------------
# iluvatar: 64-bit atomic add from 32-bit atomics, no bf16 atomics, <= 2 stages, its configs
# ------------------------------------------------------------------------------------------------


def _atomic_add_kernel(out_ptr, old_ptr, val_ptr, idx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    old = tl.atomic_add(out_ptr + tl.load(idx_ptr + offs, mask=mask), tl.load(val_ptr + offs, mask=mask), mask=mask)
    tl.store(old_ptr + offs, old, mask=mask)


def _atomic_add_scalar(out_ptr, val):
    tl.atomic_add(out_ptr, val)


def _wrap64(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def carry_heavy_int64(n, rng):
    """int64 values whose low words overflow often when summed, with negatives and small values."""
    out = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            v = (rng.randrange(1 << 20) << 32) | rng.randrange(0xF0000000, 1 << 32)  # low word near 2**32
        elif kind == 1:
            v = -rng.randrange(1, 1 << 40)  # high word 0xFFFFFFFF: carries into it wrap
        else:
            v = rng.randrange(1, 1 << 33)
        out.append(v)
    return out


def test_iluvatar_int64_atomic_add_is_exact_across_the_32bit_boundary():
    rng = py_random()
    n, bins = 300, 5
    vals = carry_heavy_int64(n, rng)
    idx = [rng.randrange(bins) for _ in range(n)]
    init = [(1 << 32) - 3, -1, (1 << 62) + 0xFFFFFFFF, rng.randrange(-(1 << 62), 1 << 62), 0]
    out = torch.tensor(init, dtype=torch.int64)
    old = torch.full((n,), -7, dtype=torch.int64)
    with tritonspec.use_backend("iluvatar"):
        triton.jit(_atomic_add_kernel)[(triton.cdiv(n, 64),)](
            out, old, torch.tensor(vals), torch.tensor(idx), n, BLOCK=64
        )
    expect = list(init)
    for v, i in zip(vals, idx):
        expect[i] = _wrap64(expect[i] + v)
    assert out.tolist() == expect
    # the interpreter runs programs one after another, so the returned words form a consistent
    # snapshot here: element j saw the running sum of everything added before it
    running, seen = list(init), []
    for v, i in zip(vals, idx):
        seen.append(running[i])
        running[i] = _wrap64(running[i] + v)
    assert old.tolist() == seen


def test_iluvatar_int64_atomic_add_on_a_scalar_pointer():
    out = torch.tensor([(1 << 32) - 1], dtype=torch.int64)
    with tritonspec.use_backend("iluvatar"):
        triton.jit(_atomic_add_scalar)[(3,)](out, (1 << 32) + 1)
    assert out.item() == (1 << 32) - 1 + 3 * ((1 << 32) + 1)


def test_iluvatar_int64_atomic_add_has_no_64bit_atomic_in_the_ir(compiled):
    assert compiled["check_iluvatar_int64_atomic_ir"] == "ok"


@compile_check
def check_iluvatar_int64_atomic_ir():
    sig = {"out_ptr": "*i64", "old_ptr": "*i64", "val_ptr": "*i64", "idx_ptr": "*i32", "n": "i32", "BLOCK": "constexpr"}
    ilu = compile_for(_atomic_add_kernel, sig, {"BLOCK": 64}, target=ILUVATAR)
    stock = compile_for(_atomic_add_kernel, sig, {"BLOCK": 64}, target=CUDA)

    def rmw(k):
        return [line for line in k.asm["ttir"].splitlines() if "tt.atomic_rmw" in line]

    assert len(rmw(ilu)) == 2 and all("tensor<64xi32>" in line for line in rmw(ilu))
    assert len(rmw(stock)) == 1 and "tensor<64xi64>" in rmw(stock)[0]

    def atoms(k):
        return [line.split()[1] for line in k.asm["ptx"].splitlines() if " atom." in line]

    assert atoms(ilu) == ["atom.global.gpu.acq_rel.add.u32"] * 2
    assert atoms(stock) == ["atom.global.gpu.acq_rel.add.u64"]


def _atomic_bf16(ptr, val_ptr):
    offs = tl.arange(0, 16)
    tl.atomic_add(ptr + offs, tl.load(val_ptr + offs))


@compile_check
def check_iluvatar_bf16_atomics_compile():
    sig = {"ptr": "*bf16", "val_ptr": "*bf16"}
    compile_for(_atomic_bf16, sig, target=CUDA)  # stock sm90 has bf16 atomic add
    with pytest.raises(Exception, match="bfloat16 is not supported by backend 'iluvatar'"):
        compile_for(_atomic_bf16, sig, target=ILUVATAR)


def test_iluvatar_rejects_bf16_atomics_where_cuda_accepts_them(compiled):
    assert compiled["check_iluvatar_bf16_atomics_compile"] == "ok"
    x = torch.zeros(16, dtype=torch.bfloat16)
    with tritonspec.use_backend("iluvatar"), pytest.raises(Exception, match="bfloat16 is not supported"):
        triton.jit(_atomic_bf16)[(1,)](x, torch.ones(16, dtype=torch.bfloat16))


def _matmul_loop(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + r[:, None] * K + (k + r)[None, :])
        b = tl.load(b_ptr + (k + r)[:, None] * BLOCK + r[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], acc)


def test_iluvatar_caps_num_stages_at_two(compiled):
    assert compiled["check_iluvatar_num_stages_cap"] == "ok"


@compile_check
def check_iluvatar_num_stages_cap():
    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "K": "i32", "BLOCK": "constexpr"}
    assert compile_for(_matmul_loop, sig, {"BLOCK": 64}, num_stages=4, target=CUDA).metadata.num_stages == 4
    assert compile_for(_matmul_loop, sig, {"BLOCK": 64}, num_stages=4, target=ILUVATAR).metadata.num_stages == 2
    assert compile_for(_matmul_loop, sig, {"BLOCK": 64}, num_stages=1, target=ILUVATAR).metadata.num_stages == 1


def test_iluvatar_prunes_autotune_configs_that_clamp_to_the_same_kernel():
    configs = [triton.Config({"B": 64}, num_warps=4, num_stages=s) for s in (2, 3, 4)]
    configs += [triton.Config({"B": 64}, num_warps=8, num_stages=5), triton.Config({"B": 128}, num_stages=1)]
    kept = iluvatar_configs.get_pruned_configs(configs, {})
    assert [(c.kwargs["B"], c.num_warps, c.num_stages) for c in kept] == [(64, 4, 2), (64, 8, 2), (128, 4, 1)]
    assert [c.num_stages for c in configs] == [2, 3, 4, 5, 1]  # the caller's configs are untouched


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_iluvatar_attention_configs_fit_its_limits(head_dim):
    from tritonspec import kernel_table as kt

    problem = dict(head_dim=head_dim, causal=True, dtype="torch.bfloat16", seq_q=512, seq_k=512, group=1)
    flags = dict(num_stages=4, num_warps=8, BLOCK_M=128, BLOCK_N=128, TMA=True)
    defaults = [
        kt.AttentionForward(**flags, WARP_SPECIALIZE=True),
        kt.AttentionBackwardKV(**flags, DQ_ATOMIC=True, DQ_TMA_REDUCE=True),
        kt.AttentionBackwardQ(**flags),
        kt.AttentionPreprocess(BLOCK_M=128, num_warps=8, num_stages=4),
    ]
    with tritonspec.use_backend("iluvatar"):
        for default in defaults:
            cfg = tritonspec.launch_config(type(default), "cuda", default, **problem)
            assert cfg.num_stages <= 2, default.kernel
            if not isinstance(cfg, kt.AttentionPreprocess):
                assert cfg.TMA is False and cfg.BLOCK_M <= 64 and cfg.BLOCK_N <= 64, default.kernel
        row = tritonspec.launch_config(
            kt.RMSNormForward,
            "cuda",
            kt.RMSNormForward(num_warps=16, BLOCK_N=4096, BLOCK_M=1),
            N=4096,
            dtype="torch.float16",
        )
        assert row == kt.RMSNormForward(num_warps=8, num_stages=1, BLOCK_N=4096, BLOCK_M=1)


def test_iluvatar_host_compiler(monkeypatch):
    spec = PROVIDERS.get("iluvatar").module
    monkeypatch.setenv("ILUVATAR_CC", "/opt/corex/bin/clang")
    assert spec.get_cc() == "/opt/corex/bin/clang"
    monkeypatch.delenv("ILUVATAR_CC")
    monkeypatch.setenv("COREX_HOME", "/nonexistent")
    assert spec.get_cc() is None  # no CoreX SDK: Triton's own choice stands


# ------------------------------------------------------------------------------------------------
# nvidia: capability-aware launch parameters, and Hopper's own attention forward
# ------------------------------------------------------------------------------------------------


def test_nvidia_kernel_config_depends_on_the_sm():
    cfg = nvidia_configs.kernel_config
    assert cfg("rms_norm_fwd", arch=70, N=8192) == {"num_warps": 8}
    assert cfg("rope", arch=75, heads_q=32) == {"num_warps": 4}
    assert cfg("rms_norm_fwd", arch=90, N=8192) is None  # the op's default
    assert cfg("somebody_elses_kernel", arch=90) is None


def test_nvidia_attention_config_uses_the_h100_table_on_sm90():
    problem = dict(head_dim=128, causal=True, dtype="torch.bfloat16", seq_q=4096, seq_k=4096, group=1)
    cfg = nvidia_configs.kernel_config("attention_fwd", arch=90, **problem)
    assert cfg == nvidia_configs.TABLES["attention_fwd"][(128, True)]
    sm80 = nvidia_configs.kernel_config("attention_fwd", arch=80, **problem)
    assert sm80 == nvidia_configs.SM80["attention_fwd"][128]
    assert nvidia_configs.kernel_config("attention_fwd", arch=75, **problem) is None
    assert nvidia_configs.kernel_config("attention_fwd", arch=90, **dict(problem, dtype="torch.float32")) is None


def test_vendor_tables_name_only_declared_kernels_and_valid_fields():
    """A table by kernel cannot carry a dead entry (a 'matmul' no kernel has) or a misspelled one, and
    every entry of the shipped tables is a valid config of its kernel."""
    from tritonspec import ConfigTable, LaunchConfigError, kernel_table

    with pytest.raises(LaunchConfigError, match="'matmul' is not a declared kernel"):
        ConfigTable({"matmul": lambda kernel, **p: None})
    with pytest.raises(LaunchConfigError, match="'rms_norm_fw' is not a declared kernel; did you mean 'rms_norm_fwd'"):
        ConfigTable({"rms_norm_fw": lambda kernel, **p: None})
    types_ = kernel_table.config_types()
    for table in (nvidia_configs.TABLES,):
        for kernel, entries in table.items():
            for cfg in entries.values():
                types_[kernel](**cfg)  # raises on an unknown or invalid field


def test_sm80_and_amd_tables_apply_to_their_parts_only_and_give_valid_configs():
    """The A100 table answers for sm80-89 only, the CDNA one for gfx9 parts only (not RDNA's gfx11, nor a
    device it cannot name); each answer overrides the op's own default into a valid config (the resources
    they compile to are ``tritonspec check --kernels``'s to judge)."""
    import importlib

    from tritonspec_backends.amd.backend.spec import configs as amd_configs

    # the modules (tritonspec.ops binds the op functions over their names)
    attention_op, moe_op = (importlib.import_module(f"tritonspec.ops.{m}") for m in ("attention", "moe"))

    big = dict(tokens_per_expert=512, H=4096, I=14336, E=8, dtype="torch.bfloat16")
    defaults = {
        "moe_up": moe_op._up_default(512),
        "moe_rows": moe_op._rows_default(512),
        "moe_weight_grad": moe_op._weight_grad_default(512),
        "attention_fwd": attention_op._fwd_default(128),
        "attention_bwd_dkdv": attention_op._dkdv_default(128),
        "attention_bwd_dq": attention_op._dq_default(128),
    }
    attn = dict(head_dim=128, causal=True, dtype="torch.bfloat16", seq_q=4096, seq_k=4096, group=4)
    for table, arch, others in (
        (nvidia_configs.kernel_config, 80, (75, 90, None)),
        (amd_configs.kernel_config, "gfx942", ("gfx1100", None)),
        (amd_configs.kernel_config, "gfx90a", ()),
    ):
        for kernel, default in defaults.items():
            problem = attn if kernel.startswith("attention") else big
            override = table(kernel, arch=arch, **problem)
            assert override, (arch, kernel)
            default.override(override)  # raises on an unknown or invalid field
            for other in others:
                assert table(kernel, **({"arch": other} if other else {}), **problem) in (
                    None,
                    table(kernel, arch=90, **problem),
                )
    # CDNA: 64-wide wavefronts, so half the warps for the same threads; K loops in 2 stages
    assert amd_configs.kernel_config("rms_norm_fwd", arch="gfx942", N=4096) == {"num_warps": 4}
    assert amd_configs.kernel_config("moe_rows", arch="gfx942", **big)["num_stages"] == 2
    assert amd_configs.kernel_config("rms_norm_fwd", arch="gfx1100", N=4096) is None


def test_hopper_attention_kernels_compile_for_sm90(compiled):
    assert compiled["check_hopper_attention_kernels_compile"] == "ok"


@compile_check
def check_hopper_attention_kernels_compile():
    """The Gluon kernels with the descriptors the hooks build: 12 warps (two consumer warpgroups, a
    producer warp rounded up to a warpgroup; 16 with the forward's three at d=64 without the mask),
    registers moved between partitions, async wgmma, within the SM's 227 KB of shared memory; both at
    head dims 128 and 64 (the backward with its own swizzle), with and without key bounds."""
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import (
        backward as backward_sm90,
        forward as forward_sm90,
        launchers as launchers_sm90,
        schedule as schedule_sm90,
    )
    from triton.experimental.gluon._runtime import GluonASTSource

    def sig(names, descriptors, **scalars):
        kinds = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        out = {
            name: f"tensordesc<{kinds[d.base.dtype]}[{','.join(map(str, d.block_shape))}],{d.layout!r}>"
            for name, d in zip(names, descriptors)
        }
        return {**out, **scalars, "CAUSAL": "constexpr", "BOUNDS": "constexpr", "STAGES": "constexpr"}

    i32 = dict.fromkeys(("HQ", "GROUP", "SEQ_Q", "SEQ_K", "SEQ_PAD", "BOUNDS_HI"), "i32")
    cases = []
    for dtype, d, causal, bounds in (
        (torch.bfloat16, 128, True, False),
        (torch.float16, 128, False, False),
        (torch.bfloat16, 64, False, False),
        (torch.bfloat16, 128, True, True),
        (torch.float16, 64, True, True),  # (also the causal tiles at d=64: key bounds tile as causal does)
    ):
        t = torch.empty(1, 2, 256, d, dtype=dtype)
        dqa = torch.empty(1, 2, 256, d, dtype=torch.float32)
        rows = torch.empty(1, 2, 256, dtype=torch.float32)
        fwd = tuple(
            launchers_sm90._descriptor(t, rows, d)
            for rows in (schedule_sm90.HALF_M, schedule_sm90.BLOCK_N, schedule_sm90.BLOCK_N, schedule_sm90.HALF_M)
        )
        cases.append(
            (
                forward_sm90._attn_fwd_ws_kernel,
                causal,
                bounds,
                schedule_sm90.fwd_warpgroups(d, causal),
                sig(
                    ("q_desc", "k_desc", "v_desc", "o_desc"),
                    fwd,
                    LSE="*fp32",
                    SCHED="*i32",
                    KB="*i32",
                    TILES="*i32",
                    qk_scale="fp32",
                    WGS="constexpr",
                    **i32,
                ),
            )
        )
        if not causal and d == 64:
            continue  # the backward's d=64 tiles are the causal case's
        bwd = launchers_sm90._bwd_descriptors(t, t, t, t, t, t, dqa, rows, rows)
        names = ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "dqa_desc", "lse_desc", "delta_desc")
        cases.append(
            (
                backward_sm90._attn_bwd_ws_kernel,
                causal,
                bounds,
                2,
                sig(names, bwd, KB="*i32", QT="*i32", PAIRS="*i32", HKV="i32", qk_scale="fp32", sm_scale="fp32", **i32),
            )
        )
    for fn, causal, bounds, consumers, signature in cases:
        constexprs = {"CAUSAL": causal, "BOUNDS": bounds, "STAGES": schedule_sm90.STAGES}
        if "WGS" in signature:
            constexprs["WGS"] = consumers
        kernel = triton.compile(
            GluonASTSource(fn, signature, constexprs=constexprs),
            target=CUDA,
            options={"num_warps": 4, "maxnreg": schedule_sm90.maxnreg(consumers + 1)},
        )
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.num_warps == 4 * (consumers + 1) and kernel.metadata.shared <= 227 * 1024
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)  # the producer warp's budget
        assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1" in ptx
        if fn is backward_sm90._attn_bwd_ws_kernel:  # dQ leaves as bulk reduce-adds, not per-element atomics
            assert "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add" in ptx
            assert not re.search(r"\b(red|atom)\.global", ptx)
        assert kernel.asm["cubin"]


def test_hopper_experts_gemm_compiles_for_sm90(compiled):
    assert compiled["check_hopper_experts_gemm_compile"] == "ok"


def _experts_gemm_tile(dtype, block) -> str:
    """The signature entry of a host descriptor of ``block`` tiles, as Hopper's experts' GEMMs build them."""
    from tritonspec_backends.nvidia.backend.spec import moe_sm90

    kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return f"tensordesc<{kind}[{block[0]},{block[1]}],{moe_sm90._layout(tuple(block), dtype)!r}>"


def _experts_gemm_pipeline(m) -> dict:
    """The K loop's constexprs both experts' GEMMs share: tile order, ring depth, loads ahead, wgmmas in flight."""
    return dict(GROUP=m.GROUP_M, STAGES=m.STAGES, AHEAD=m.AHEAD, IN_FLIGHT=m.IN_FLIGHT, num_warps=8)


@compile_check
def check_hopper_experts_gemm_compile():
    """The experts' grouped GEMM in its four forms (gate/up with and without the saved pre-activations, plain
    with K-major and with N-major weights), with the descriptors the hook builds: one 64 x 256 wgmma a
    warpgroup and K step, within the SM's 227 KB of shared memory."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from tritonspec_backends.nvidia.backend.spec import moe_sm90

    m = moe_sm90
    bn2 = 2 * m.BLOCK_N
    for dtype, gate_up, store_gu, k_major in (
        (torch.bfloat16, True, True, True),
        (torch.float16, True, False, True),
        (torch.bfloat16, False, False, True),
        (torch.float16, False, False, False),
    ):
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        desc = functools.partial(_experts_gemm_tile, dtype)
        b_block = [m.BLOCK_N, m.BLOCK_K] if gate_up else ([bn2, m.BLOCK_K] if k_major else [m.BLOCK_K, bn2])
        c_block = [m.BLOCK_M, m.BLOCK_N if gate_up else bn2]
        constexprs = dict(
            GATE_UP=gate_up,
            STORE_GU=store_gu,
            K_MAJOR=k_major,
            B_LAYOUT=m._layout((bn2, m.BLOCK_K) if k_major else (m.BLOCK_K, bn2), dtype),
            C_LAYOUT=m._layout((m.BLOCK_M, bn2), dtype),
            **_experts_gemm_pipeline(m),
        )
        signature = {
            "a_desc": desc([m.BLOCK_M, m.BLOCK_K]),
            "b_desc": desc(b_block),
            "c_desc": desc(c_block),
            "u_desc": desc(c_block),
            "h_desc": desc(c_block),
            "BLOCK_EXPERT": "*i32",
            "N": "i32",
            "K": "i32",
            "num_m": "i32",
            **dict.fromkeys(constexprs, "constexpr"),
        }
        kernel = triton.compile(
            GluonASTSource(m._moe_gemm_sm90_kernel, signature, constexprs=constexprs),
            target=CUDA,
            options={"num_warps": 8},
        )
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
        ptx_type = {"bf16": "bf16", "fp16": "f16"}[kind]
        assert f"wgmma.mma_async.sync.aligned.m64n256k16.f32.{ptx_type}.{ptx_type}" in ptx
        assert "wgmma.wait_group.sync.aligned 1" in ptx  # one wgmma left in flight
        assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) and kernel.asm["cubin"]  # TMA stores


def test_hopper_weight_gradients_compile_for_sm90(compiled):
    assert compiled["check_hopper_weight_grad_compile"] == "ok"


@compile_check
def check_hopper_weight_grad_compile():
    """The experts' weight gradients with either operand gathered (d down_proj gathers dout's rows, d gate_up_proj
    x's), with the descriptors the hook builds: one 64 x 256 wgmma a warpgroup and K step reading the sorted
    operand transposed, the gathered rows as 16-byte cp.async copies, within 227 KB of shared memory."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from tritonspec_backends.nvidia.backend.spec import moe_sm90

    m = moe_sm90
    for dtype, gather in ((torch.bfloat16, 1), (torch.float16, 2)):
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        desc = functools.partial(_experts_gemm_tile, dtype)
        constexprs = dict(GATHER=gather, G_LAYOUT=m._gather_layout(), **_experts_gemm_pipeline(m))
        signature = {
            "l_desc": desc([m.BLOCK_K, m.WG_BLOCK_M]),
            "r_desc": desc([m.BLOCK_K, m.WG_BLOCK_N]),
            "dw_desc": desc([m.WG_BLOCK_M, m.WG_BLOCK_N]),
            "SRC": f"*{kind}",
            "stride_src": "i32",
            "ROW_PAIR": "*i32",
            "EXPERT_START": "*i32",
            "EXPERT_ROWS": "*i32",
            "M": "i32",
            "N": "i32",
            "TOP_K": "i32",
            **dict.fromkeys(constexprs, "constexpr"),
        }
        aligned = {(i,): [["tt.divisibility", 16]] for i in (3, 4, 5)}  # as launches specialize them
        kernel = triton.compile(
            GluonASTSource(m._moe_weight_grad_sm90_kernel, signature, constexprs=constexprs, attrs=aligned),
            target=CUDA,
            options={"num_warps": 8},
        )
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
        ptx_type = {"bf16": "bf16", "fp16": "f16"}[kind]
        wgmma = re.findall(
            rf"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.{ptx_type}\.{ptx_type} .*, (\d), (\d);", ptx
        )
        assert wgmma and set(wgmma) == {("1", "1")}  # A read transposed (M-major), B N-major
        assert "wgmma.wait_group.sync.aligned 1" in ptx  # one wgmma left in flight
        assert re.search(r"cp\.async\.cg\.shared\.global \[.*\], \[.*\], 0x10", ptx)  # 16-byte gathers
        assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) and kernel.asm["cubin"]  # the TMA store


def test_hopper_weight_gradients_decline_what_they_were_not_measured_on():
    """Taken: exactly one operand gathered (both sorted: the portable TMA kernel is as fast), whole tiles of a
    contiguous dw, K steps inside the sort's blocks, 128 rows an expert or more; and only on a CUDA device."""
    from tritonspec_backends.nvidia.backend.spec import moe_sm90 as m

    E, T, k, H, I = 4, 256, 2, 256, 256
    R = E * 128 + T * k  # 1024 sort rows: 256 an expert
    bf = dict(dtype=torch.bfloat16)
    dout, g = torch.empty(T, H, **bf), torch.empty(R, I, **bf)
    ddown = torch.empty(E, H, I, **bf)

    def taken(lhs=dout, rhs=g, dw=ddown, rows=R, block_m=128, gather_l=True, gather_r=False):
        return m._weight_grad_taken(lhs, rhs, dw, rows, block_m, gather_l, gather_r)

    assert taken()  # d down_proj: dout's rows gathered, g sorted
    assert taken(
        torch.empty(R, 2 * I, **bf), torch.empty(T, H, **bf), torch.empty(E, 2 * I, H, **bf), R, 128, False, True
    )
    assert not taken(lhs=torch.empty(R, H, **bf), gather_l=False)  # both sorted
    assert not taken(gather_r=True)  # both gathered
    assert not taken(dw=torch.empty(E, I, H, **bf).transpose(1, 2))  # strided dw (GPT-OSS's layout)
    assert not taken(rhs=torch.empty(R, 64, **bf), dw=torch.empty(E, H, 64, **bf))  # half a 256-column tile
    assert not taken(block_m=32)  # a 64-row step would run into the next expert's rows
    assert not taken(rows=E * 64)  # 64 rows an expert
    assert not taken(lhs=dout.float(), rhs=g.float(), dw=ddown.float())
    sort = (torch.zeros(R, dtype=torch.int32), torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.int32))
    assert m.moe_weight_grad(dout, g, ddown, *sort, 128, gather_l=True, gather_r=False, top_k=k) is False  # CPU


def test_hopper_descriptors():
    """The requested block of rows, the tensor's own strides (HF's transposed layout too), and the
    swizzled layout get_default_for gives, though built once per (rows, dtype)."""
    from triton.experimental.gluon import language as gl
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import (
        launchers as launchers_sm90,
        schedule as schedule_sm90,
    )

    for dtype, gl_dtype in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        t = torch.randn(1, 300, 2, 128).to(dtype).transpose(1, 2)
        for rows in (schedule_sm90.HALF_M, schedule_sm90.BLOCK_N):
            desc = launchers_sm90._descriptor(t, rows)
            assert desc.block_shape == [1, 1, rows, schedule_sm90.HEAD_DIM] and list(desc.strides) == list(t.stride())
            assert desc.layout == gl.NVMMASharedLayout.get_default_for([1, 1, rows, schedule_sm90.HEAD_DIM], gl_dtype)


def _schedule_lists(schedule, ctas):
    offsets = schedule[: ctas + 1]
    assert offsets[0] == ctas + 1 and offsets[-1] == len(schedule) - 1  # ... then one spare entry
    return [schedule[offsets[c] : offsets[c + 1]] for c in range(ctas)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "batch_heads, group, tiles, seq_k, ctas, kv_per_section",
    [
        (128, 4, 16, 2048, 132, 32),
        (32, 4, 64, 8192, 132, 8),
        (256, 1, 16, 2048, 132, 32),
        (24, 8, 5, 600, 7, 1),
        (3, 1, 2, 200, 5, 2),
    ],
)
def test_hopper_forward_schedule(batch_heads, group, tiles, seq_k, ctas, kv_per_section, causal):
    """The persistent forward's work list takes every query tile once; heads go section by section
    (whole GQA groups); causal tiles go longest first to the least loaded CTA, so at the GQA model shapes
    (one section) the busiest CTA holds at most two key blocks more than the mean (pairing tiles n-1-u and u into 1024
    equal units left it 4 over at 4x32x2048 and 1x32x8192 on 132 SMs)."""
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import schedule as schedule_sm90

    rows = 128
    schedule = schedule_sm90.fwd_schedule(batch_heads, group, tiles, rows, seq_k, causal, ctas, kv_per_section)
    lists = _schedule_lists(schedule, ctas)
    assert sorted(code for work in lists for code in work) == list(range(batch_heads * tiles))
    section = kv_per_section * group
    keys = [min(seq_k, (code % tiles + 1) * rows) if causal else seq_k for code in range(batch_heads * tiles)]
    blocks = [-(-n // schedule_sm90.BLOCK_N) for n in keys]  # each tile's key blocks
    for work in lists:
        sections = [code // tiles // section for code in work]
        assert sections == sorted(sections)
        if causal:  # within a section, longest first
            for a, b in zip(work, work[1:]):
                assert a // tiles // section < b // tiles // section or blocks[a] >= blocks[b]
    load = [sum(blocks[code] for code in work) for work in lists]
    if causal:
        cost = [sum(blocks[code] + 1 for code in work) for work in lists]
        assert max(cost) - min(cost) <= max(blocks) + 1  # list scheduling's bound
        if batch_heads * tiles >= 8 * ctas and batch_heads <= section:
            assert max(load) <= sum(load) / ctas + 2
    else:
        assert max(map(len, lists)) - min(map(len, lists)) <= 1


def _random_bounds(kind: str, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Key intervals (2, batch, seq) of one kind: packed causal sequences, right padding, a sliding window,
    or arbitrary intervals (empty ones included)."""
    rows = torch.arange(seq)
    lo, hi = torch.zeros(batch, seq, dtype=torch.int64), torch.zeros(batch, seq, dtype=torch.int64)
    for b in range(batch):
        if kind == "packed":
            cuts = torch.randint(0, seq, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen)
            starts = torch.zeros(seq, dtype=torch.int64)
            starts[cuts] = 1
            lo[b] = torch.cummax(torch.where(starts.bool(), rows, 0), 0).values
            hi[b] = rows + 1
        elif kind == "padded":
            n = int(torch.randint(0, seq + 1, (), generator=gen))
            lo[b], hi[b] = 0, torch.where(rows < n, rows + 1, 0)
        elif kind == "window":
            lo[b], hi[b] = (rows - int(torch.randint(1, seq, (), generator=gen)) + 1).clamp(min=0), rows + 1
        else:
            lo[b] = torch.randint(0, seq, (seq,), generator=gen)
            hi[b] = (lo[b] + torch.randint(-20, seq, (seq,), generator=gen)).clamp(0, seq)
    from tritonspec.ops.attention import _padded_bounds

    return _padded_bounds(torch.stack((lo, hi)), seq)


@pytest.mark.parametrize("kind", ["packed", "padded", "window", "arbitrary"])
def test_hopper_block_tables_under_key_bounds(kind):
    """Under key bounds, the forward walks, per query tile, every key block any of its rows sees, and leaves
    the mask out only on blocks every row sees whole; the backward, per key tile, every q block that sees
    one of its keys, and leaves the mask out only on blocks whose rows all see all its keys; its CTAs take
    every key tile once, in pairs of about equal work."""
    from tritonspec.ops.attention import query_block_table
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import schedule as schedule_sm90

    gen = torch.Generator().manual_seed(sum(map(ord, kind)))
    seq, batch = 700, 3
    bounds = _random_bounds(kind, batch, seq, gen)
    keys = torch.arange(seq)
    pad = bounds.shape[-1]
    sees = (keys >= bounds[0, :, :, None]) & (keys < bounds[1, :, :, None])  # (batch, padded rows, keys)
    sees = torch.nn.functional.pad(sees, (0, 1024 - seq))  # whole blocks: keys past seq_k are never seen
    rows, bn = 128, schedule_sm90.BLOCK_N
    table = schedule_sm90.key_block_table(bounds, seq, rows, bn)
    assert table.shape == (batch, -(-seq // rows), 4) and table.dtype == torch.int32
    for b in range(batch):
        for t, (first, a, c, n) in enumerate(table[b].tolist()):
            block = sees[b, t * rows : (t + 1) * rows].view(rows, -1, bn)  # (rows, key blocks, bn)
            seen = block.any(2).any(0).nonzero().flatten().tolist()
            assert n >= 1 and 0 <= a <= c <= n and (a < c or a == c == 0)  # the walk starts at block a < n
            if seen:
                assert first == seen[0] and first + n == seen[-1] + 1
            for j in range(first + a, first + c):
                assert block[:, j].all()
    for block_m in (64, 128):
        tn = 2 * schedule_sm90.BWD_HALF_N
        qt = query_block_table(bounds, seq, seq, block_m, tn)
        assert qt.shape == (batch, -(-seq // tn), 4)
        for b in range(batch):
            for t, (first, a, c, n) in enumerate(qt[b].tolist()):
                tile = sees[b, : pad // block_m * block_m, t * tn : (t + 1) * tn].reshape(-1, block_m, tn)
                reached = tile.any(2).any(1).nonzero().flatten().tolist()
                assert 0 <= a <= c <= n
                assert (first, n) == ((reached[0], reached[-1] + 1 - reached[0]) if reached else (0, 0))
                for j in range(first + a, first + c):
                    assert tile[j].all()
        pairs = schedule_sm90.tile_pairs(qt)  # every key tile once; pairs' work about equal
        n_t = qt.shape[1]
        assert pairs.shape == (batch, -(-n_t // 2), 2)
        for b in range(batch):
            tiles = pairs[b].flatten().tolist()
            assert sorted(set(tiles)) == list(range(n_t)) and len(tiles) - n_t == n_t % 2
            work = [qt[b, i, 3] + (qt[b, j, 3] if j != i else 0) for i, j in pairs[b].tolist()]
            assert max(work) - min(work) <= qt[b, :, 3].max()


@pytest.mark.parametrize("d", [64, 96, 128])
def test_hopper_backward_tiles(d):
    """The backward's tiles follow the op's padded head dim (dqa's), and each warpgroup's dQ reads half
    of it from the K tile: that slice must start on a swizzle atom, so K's (and dK's, staged in K's
    tile) swizzle spans at most half a row."""
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import (
        launchers as launchers_sm90,
        schedule as schedule_sm90,
    )

    t = torch.randn(1, 2, 100, d).to(torch.bfloat16)
    pad = 64 if d == 64 else 128
    rows = torch.zeros(1, 2, 256)
    q, k, v, do, dk, dv, dqa, lse, delta = launchers_sm90._bwd_descriptors(
        t, t, t, t, t, t, torch.zeros(1, 2, 100, pad), rows, rows
    )
    assert [x.block_shape[-1] for x in (q, k, v, do, dk, dv)] == [pad] * 6 and dqa.block_shape[-1] == pad // 2
    block_m = schedule_sm90.BWD_BLOCK_M_D64 if d == 64 else schedule_sm90.BWD_BLOCK_M  # d=64: longer steps, same bytes
    assert q.block_shape[2] == do.block_shape[2] == dqa.block_shape[2] == block_m
    assert lse.block_shape == delta.block_shape == [1, block_m]  # one q block's rows
    for tile in (k, dk):
        assert tile.layout.swizzle_byte_width <= pad // 2 * t.element_size()
    assert dk.layout == k.layout


def test_hopper_attention_kernels_decline_off_gpu():
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import launchers as launchers_sm90

    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    o, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    assert not launchers_sm90.eligible(q, q, 0.1, q, o)
    assert launchers_sm90.attention_forward(q, q, q, o, lse, True, 0.1) is False
    assert launchers_sm90.attention_backward(q, q, q, o, o, o, lse, True, 0.1) is False


def test_hopper_experts_gemm_reads_weights_in_their_storage_order_and_declines_off_gpu():
    """Hopper's grouped GEMM reads each weight as the 2-D tensor its storage is: K-major (the gate/up weight, the
    forward's down projection) or N-major (the backward's), the latter only with whole K tiles an expert (a tile
    must not run into the next expert's rows); gate/up only K-major; anything else, and any CPU tensor, declines."""
    from tritonspec_backends.nvidia.backend.spec import moe_sm90

    E, H, I = 4, 256, 192
    gate_up = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)  # Hugging Face's (E, 2I, H)
    down = torch.empty(E, H, I, dtype=torch.bfloat16)
    cases = [
        (gate_up.transpose(1, 2), True, (True, [E * 2 * I, H], [moe_sm90.BLOCK_N, moe_sm90.BLOCK_K])),
        (down.transpose(1, 2), False, (True, [E * H, I], [2 * moe_sm90.BLOCK_N, moe_sm90.BLOCK_K])),
        (down, False, (False, [E * H, I], [moe_sm90.BLOCK_K, 2 * moe_sm90.BLOCK_N])),  # the backward's d h
        (gate_up, False, (False, [E * 2 * I, H], [moe_sm90.BLOCK_K, 2 * moe_sm90.BLOCK_N])),  # dx
        (gate_up, True, None),  # gate and up must be rows of K
        (torch.empty(E, 96, I, dtype=torch.bfloat16), False, None),  # N-major, K = 96: half a K tile
        (torch.empty(E, I, 2 * H, dtype=torch.bfloat16)[:, :, ::2], False, None),  # strided
    ]
    for b, gate_up_mode, expected in cases:
        got = moe_sm90._weight_tiles(b, gate_up_mode)
        if expected is None:
            assert got is None, (b.shape, b.stride(), gate_up_mode)
        else:
            desc, k_major = got
            assert (k_major, list(desc.shape), list(desc.block_shape)) == expected
    c = torch.empty(8 * 128, I, dtype=torch.bfloat16)
    assert moe_sm90.moe_experts_gemm(down, c, torch.zeros(8, dtype=torch.int32), gate_up=False) is None


def test_hopper_backward_plans_take_the_problem_before_the_accumulator_exists(monkeypatch):
    """A planned problem is taken without eligible() (its key fixed all that reads but the addresses),
    and its runner relaunches the plan on the call's tensors, the op's dqa and delta included; an
    unaligned tensor is still declined, and a dqa of another layout gets a launch of its own."""
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import launchers as launchers_sm90

    def tensors(offset=0):
        buffers = [torch.empty(2 * 256 * 128 + offset, dtype=torch.bfloat16) for _ in range(6)]
        return [b[offset:].view(1, 2, 256, 128) for b in buffers]

    q, k, v, do, dk, dv = tensors()
    lse, delta, dqa = torch.empty(1, 2, 256), torch.zeros(1, 2, 256), torch.zeros(1, 2, 256, 128)
    descs = [
        launchers_sm90._rebased(d, None) for d in launchers_sm90._bwd_descriptors(q, k, v, do, dk, dv, dqa, lse, delta)
    ]
    relaunched, launched, checked = [], [], []

    def plan(*descriptors):
        relaunched.append(descriptors)
        return True

    key = launchers_sm90._problem_key(True, 0.1, q, k, v, do, dk, dv, lse)
    layout = (dqa.shape, dqa.stride(), delta.shape, delta.stride())
    monkeypatch.setattr(launchers_sm90, "_BWD_PLANS", {key: (plan, descs, layout)})
    monkeypatch.setattr(launchers_sm90, "eligible", lambda *args: checked.append(args) or False)
    monkeypatch.setattr(launchers_sm90, "_launch_bwd", lambda *args: launched.append(args))

    run = launchers_sm90.attention_backward(q, k, v, do, dk, dv, lse, True, 0.1)
    assert callable(run) and not checked and not relaunched  # nothing runs before the op has dqa and delta
    run(dqa, delta)
    ((*call, kb, qt, pairs),) = relaunched
    assert all(d.base is t for d, t in zip(call, (q, k, v, do, dk, dv, dqa, lse, delta), strict=True))
    assert [d.block_shape for d in call] == [d.block_shape for d in descs]  # the plan's tiles, rebased
    assert kb is qt is pairs is lse  # no key bounds: the kernel's key-bound pointers are unused
    assert not launched

    run(torch.zeros(1, 2, 256, 64), delta)  # not the layout the plan was built for
    assert len(relaunched) == 1 and len(launched) == 1

    unaligned = tensors(offset=1)  # same shapes and strides, 2-byte-aligned addresses: TMA cannot take them
    assert launchers_sm90.attention_backward(*unaligned, lse, True, 0.1) is False and len(checked) == 1


# ------------------------------------------------------------------------------------------------
# cpu: libdevice in interpreted kernels (numpy, CUDA's dtype rules)
# ------------------------------------------------------------------------------------------------

UNARY = ["exp", "exp2", "log", "log2", "tanh", "erf", "rsqrt", "sigmoid", "sqrt", "log1p", "expm1"]
REFS = {
    "exp": torch.exp,
    "exp2": torch.exp2,
    "log": torch.log,
    "log2": torch.log2,
    "tanh": torch.tanh,
    "erf": torch.erf,
    "rsqrt": torch.rsqrt,
    "sigmoid": torch.sigmoid,
    "sqrt": torch.sqrt,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
}


@triton.jit
def _libdevice_unary(x_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    tl.store(out_ptr + 0 * N + r, libdevice.exp(x))
    tl.store(out_ptr + 1 * N + r, libdevice.exp2(x))
    tl.store(out_ptr + 2 * N + r, libdevice.log(x))
    tl.store(out_ptr + 3 * N + r, libdevice.log2(x))
    tl.store(out_ptr + 4 * N + r, libdevice.tanh(x))
    tl.store(out_ptr + 5 * N + r, libdevice.erf(x))
    tl.store(out_ptr + 6 * N + r, libdevice.rsqrt(x))
    tl.store(out_ptr + 7 * N + r, libdevice.sigmoid(x))
    tl.store(out_ptr + 8 * N + r, cuda_libdevice.sqrt(x))  # the vendor module is served too
    tl.store(out_ptr + 9 * N + r, cuda_libdevice.log1p(x))
    tl.store(out_ptr + 10 * N + r, cuda_libdevice.expm1(x))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
def test_cpu_libdevice_unary_math(gen, dtype, tol):
    n = 32
    x = (torch.rand(n, generator=gen, dtype=torch.float64) * 3 + 0.05).to(dtype)
    out = torch.full((len(UNARY), n), float("nan"), dtype=dtype)
    _libdevice_unary[(1,)](x, out, N=n)
    for i, name in enumerate(UNARY):
        torch.testing.assert_close(out[i].double(), REFS[name](x.double()), rtol=tol, atol=tol, msg=name)


@triton.jit
def _libdevice_binary(x_ptr, y_ptr, out_ptr, flags_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    y = tl.load(y_ptr + r)
    tl.store(out_ptr + 0 * N + r, libdevice.pow(x, y))
    tl.store(out_ptr + 1 * N + r, libdevice.pow(x, 3))  # powi: an int exponent
    tl.store(out_ptr + 2 * N + r, libdevice.fast_dividef(x, y))
    tl.store(out_ptr + 3 * N + r, libdevice.div_rn(x, y))
    tl.store(flags_ptr + 0 * N + r, libdevice.isnan(x / y).to(tl.int32))
    tl.store(flags_ptr + 1 * N + r, libdevice.isinf(x / y).to(tl.int32))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_cpu_libdevice_binary_math_and_predicates(gen):
    n = 32
    x = torch.rand(n, generator=gen) * 2 + 0.1
    y = torch.randn(n, generator=gen)
    x[3], y[3] = 0.0, 0.0  # nan
    y[5] = 0.0  # inf
    out = torch.full((4, n), float("nan"))
    flags = torch.full((2, n), -1, dtype=torch.int32)
    _libdevice_binary[(1,)](x, y, out, flags, N=n)
    xd, yd = x.double(), y.double()
    ok = torch.ones(n, dtype=torch.bool)
    ok[[3, 5]] = False
    torch.testing.assert_close(out[0].double(), xd.pow(yd), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(out[1].double(), xd.pow(3), rtol=2e-6, atol=1e-6)
    for i in (2, 3):
        torch.testing.assert_close(out[i][ok].double(), (xd / yd)[ok], rtol=2e-6, atol=1e-6)
    assert flags[0].tolist() == torch.isnan(x / y).int().tolist()
    assert flags[1].tolist() == torch.isinf(x / y).int().tolist()


def test_cpu_libdevice_keeps_cuda_dtype_rules():
    x = torch.rand(32).half()
    with pytest.raises(Exception, match=r"libdevice.exp has no variant for argument dtypes \(fp16"):
        _libdevice_unary[(1,)](x, torch.empty(len(UNARY), 32).half(), N=32)


# ------------------------------------------------------------------------------------------------
# ascend: language extensions, NPU math rules, arange without the power-of-two rule
# ------------------------------------------------------------------------------------------------


def _slices(x_ptr, ext_ptr, ins_ptr, elem_ptr, off, N: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r[:, None] * N + r[None, :])
    s = tl.extract_slice(x, (off, 1), (S0, S1), (2, 2))
    tl.store(ext_ptr + tl.arange(0, S0)[:, None] * S1 + tl.arange(0, S1)[None, :], s)
    y = tl.insert_slice(x, s * 10.0, (1, off), (S0, S1), (1, 2))
    tl.store(ins_ptr + r[:, None] * N + r[None, :], y)
    tl.store(elem_ptr, tl.get_element(x, (off, 5)))


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3)])  # 3: not a power of two, fine under ascend's arange
def test_ascend_slices_match_torch_indexing(gen, sizes):
    n, off = 8, 1
    s0, s1 = sizes
    x = torch.randn(n, n, generator=gen)
    ext = torch.full((s0, s1), float("nan"))
    ins = torch.full((n, n), float("nan"))
    elem = torch.full((1,), float("nan"))
    with tritonspec.use_backend("ascend"):
        triton.jit(_slices)[(1,)](x, ext, ins, elem, off, N=n, S0=s0, S1=s1)
    ref_ext = x[off : off + 2 * s0 : 2, 1 : 1 + 2 * s1 : 2]
    ref_ins = x.clone()
    ref_ins[1 : 1 + s0, off : off + 2 * s1 : 2] = ref_ext * 10.0
    assert torch.equal(ext, ref_ext) and torch.equal(ins, ref_ins) and elem.item() == x[off, 5].item()


def _bad_slice(x_ptr, out_ptr):
    r = tl.arange(0, 8)
    s = tl.extract_slice(tl.load(x_ptr + r), (6,), (2,), (2,))
    tl.store(out_ptr + tl.arange(0, 2), s)


def _bad_sizes(x_ptr, out_ptr):
    r = tl.arange(0, 8)
    s = tl.extract_slice(tl.load(x_ptr + r), (0,), (2, 2), (1,))
    tl.store(out_ptr + tl.arange(0, 2), s)


def test_ascend_slice_arguments_are_checked():
    x, out = torch.randn(8), torch.empty(2)
    with tritonspec.use_backend("ascend"):
        with pytest.raises(Exception, match="extract_slice: along dim 0 the slice 6:9:2 leaves the tensor"):
            triton.jit(_bad_slice)[(1,)](x, out)
        with pytest.raises(Exception, match="extract_slice: sizes has 2 entries but the tensor has rank 1"):
            triton.jit(_bad_sizes)[(1,)](x, out)


def _gather_rows(src_ptr, idx_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    src = tl.load(src_ptr + r[:, None] * N + r[None, :])
    idx = tl.load(idx_ptr + r[:, None] * N + r[None, :])
    tl.store(out_ptr + r[:, None] * N + r[None, :], tl.gather(src, idx, 0))


def test_ascend_gather_replaces_mainline_with_the_npu_dtype_rule(gen):
    n = 8
    src = torch.randn(n, n, generator=gen)
    idx = torch.randint(0, n, (n, n), generator=gen, dtype=torch.int32)
    out = torch.full((n, n), float("nan"))
    mainline = tl.gather
    with tritonspec.use_backend("ascend"):
        assert tl.gather is not mainline
        triton.jit(_gather_rows)[(1,)](src, idx, out, N=n)
        with pytest.raises(Exception, match="gather \\(ascend\\): src dtype must be fp16, bf16 or fp32, got int32"):
            triton.jit(_gather_rows)[(1,)](idx, idx, idx.clone(), N=n)
    assert torch.equal(out, torch.gather(src, 0, idx.long()))
    assert tl.gather is mainline  # leaving the backend restores mainline's object
    assert not hasattr(tl, "extract_slice") and not hasattr(tl.math, "isnan")


def _npu_math(x_ptr, out_ptr, flags_ptr, N: tl.constexpr):
    r = tl.arange(0, N)  # N = 10: no power-of-two rule on ascend
    x = tl.load(x_ptr + r)
    tl.store(out_ptr + r, tl.exp(x) + libdevice.tanh(x).to(x.dtype))
    tl.store(flags_ptr + r, tl.math.isnan(x).to(tl.int32) + 2 * tl.math.isinf(x).to(tl.int32))


def test_ascend_math_runs_fp16_and_flags_nan_inf(gen):
    n = 10
    x = torch.randn(n, generator=gen).half()
    x[2], x[7] = float("nan"), float("-inf")
    out = torch.full((n,), float("nan")).half()
    flags = torch.full((n,), -1, dtype=torch.int32)
    with tritonspec.use_backend("ascend"):
        triton.jit(_npu_math)[(1,)](x, out, flags, N=n)
    finite = torch.isfinite(x)
    xd = x.double()
    torch.testing.assert_close(out[finite].double(), (xd.exp() + xd.tanh())[finite], rtol=2e-3, atol=2e-3)
    assert flags.tolist() == (torch.isnan(x).int() + 2 * torch.isinf(x).int()).tolist()


def _exp_only(x_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(out_ptr + r, tl.exp(tl.load(x_ptr + r)))


def test_ascend_exp_dtype_rule_differs_from_mainline():
    x16, x64 = torch.rand(16).half(), torch.rand(16).double()
    with pytest.raises(Exception, match=r"Expected dtype \['fp32', 'fp64'\] but got fp16"):
        triton.jit(_exp_only)[(1,)](x16, x16.clone(), N=16)  # mainline: no fp16 exp
    with tritonspec.use_backend("ascend"):
        with pytest.raises(
            Exception, match="exp \\(ascend\\): argument dtype must be one of fp16, bf16, fp32, got fp64"
        ):
            triton.jit(_exp_only)[(1,)](x64, x64.clone(), N=16)


def test_ascend_ir_binds_the_npu_symbols_and_odd_aranges_fail_at_trace_time(compiled):
    assert compiled["check_ascend_ir"] == "ok"


@compile_check
def check_ascend_ir():
    sig = {"x_ptr": "*fp16", "out_ptr": "*fp16", "flags_ptr": "*i32", "N": "constexpr"}
    ttir = compile_for(_npu_math, sig, {"N": 16}, target=ASCEND).asm["ttir"]
    for symbol in ("__hmf_isnan", "__hmf_isinf", "__hmf_tanhDh"):  # tanh of fp16
        assert f'symbol = "{symbol}"' in ttir
    assert "math.exp" in ttir and "tensor<16xf16>" in ttir
    # ascend lifts the power-of-two rule, but stock Triton's tt.make_range verifier (C++) still
    # demands one, so a compiled kernel fails while it is traced, naming hook, backend and reason
    # (not later, in the MLIR parser, with "error encountered during parsing").
    with pytest.raises(
        Exception,
        match="tl.arange\\(0, 10\\): backend 'ascend' specializes "
        "'arange_disable_check_power_of_two', which applies to interpreted "
        "kernels only: .*powers of two",
    ):
        compile_for(_npu_math, sig, {"N": 10}, target=ASCEND)


def _scale(x_ptr, out_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(out_ptr + r, tl.load(x_ptr + r) * 2.0)


def _launch(kernel, *args):
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(AscendDriver())
    try:
        kernel[(1, 1, 1)](*args)
    finally:
        driver.set_active(previous)


@compile_check
def check_ascend_without_toolchain():
    import tempfile

    with tempfile.TemporaryDirectory() as empty:
        os.environ["PATH"] = empty  # surely no bishengir-compile
        kernel = compile_for(_scale, {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr"}, {"N": 16}, target=ASCEND)
    assert "tt.func public @_scale" in kernel.asm["ttir"] and kernel.metadata.npu_toolchain is None
    with pytest.raises(ascend_compiler.AscendToolchainError, match="`bishengir-compile` was not on PATH"):
        _launch(kernel, torch.zeros(16), torch.zeros(16))


def test_ascend_without_toolchain_compiles_ttir_and_launch_names_the_tool(compiled):
    assert compiled["check_ascend_without_toolchain"] == "ok"


@compile_check
def check_ascend_with_toolchain():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tool = pathlib.Path(tmp) / "bishengir-compile"
        tool.write_text(
            f"#!{sys.executable}\nimport sys\nsrc = open(sys.argv[1]).read()\n"
            "assert 'tt.func' in src and sys.argv[2] == '-o'\n"
            "open(sys.argv[3], 'wb').write(b'NPUBIN:' + str(len(src)).encode())\n"
        )
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
        os.environ["PATH"] = tmp
        kernel = compile_for(_scale, {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr"}, {"N": 16}, target=ASCEND)
        assert kernel.metadata.npu_toolchain == str(tool)
    assert kernel.asm["npubin"].startswith(b"NPUBIN:")
    with pytest.raises(NotImplementedError, match="compile-only and has no NPU runtime launcher"):
        _launch(kernel, torch.zeros(16), torch.zeros(16))


def test_ascend_hands_ttir_to_the_toolchain_when_present(compiled):
    assert compiled["check_ascend_with_toolchain"] == "ok"


@pytest.mark.parametrize("tokens_per_expert", [1, 256])
def test_iluvatar_moe_configs_fit_its_limits(tokens_per_expert):
    from tritonspec import kernel_table as kt
    from tritonspec.ops import moe

    problem = dict(tokens_per_expert=tokens_per_expert, H=2048, I=768, E=128, dtype="torch.bfloat16")
    defaults = [
        moe._up_default(tokens_per_expert),
        moe._rows_default(tokens_per_expert),
        moe._weight_grad_default(tokens_per_expert),
        moe._COMBINE_DEFAULT,
    ]
    with tritonspec.use_backend("iluvatar"):
        for default in defaults:
            cfg = tritonspec.launch_config(type(default), "cuda", default, **problem)
            assert cfg.num_stages <= 2 and cfg.num_warps <= 4, default.kernel
            if isinstance(cfg, kt.MoEUp):
                assert cfg.BLOCK_M <= 64
