"""One kernel source, every backend: the same kernels compile for every registered target and run.

The kernels below are plain functions, written once. They are compiled offline for cuda sm90,
hip gfx942, iluvatar and ascend (in one subprocess without TRITON_INTERPRET, where ``tl``'s own
@jit helpers are compilable), and run in the interpreter under each backend's spec, checked
against float64 references. ``tests/gpu/test_iluvatar_gpu.py`` runs the same ``CASES`` on a GPU
under the iluvatar profile.
"""

import os

import pytest
from helpers import ASCEND, CUDA, HIP, ILUVATAR, compile_for
from offline import run_checks, run_without_interpreter
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

import tritonspec

# ------------------------------------------------------------------------------------------------
# the kernels (one source)
# ------------------------------------------------------------------------------------------------


def elementwise(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.where(x > 0, alpha * x, x * tl.sigmoid(y)) + tl.exp(y), mask=mask)


def reduction(x_ptr, sum_ptr, max_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0)
    tl.store(sum_ptr + row, tl.sum(x, axis=0))
    tl.store(max_ptr + row, tl.max(tl.where(mask, x, float("-inf")), axis=0))


def dot(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(
            a_ptr + rm[:, None] * K + (k + rk)[None, :], mask=(rm[:, None] < M) & (k + rk < K)[None, :], other=0.0
        )
        b = tl.load(
            b_ptr + (k + rk)[:, None] * N + rn[None, :], mask=(k + rk < K)[:, None] & (rn[None, :] < N), other=0.0
        )
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def atomics(bins_ptr, hist_ptr, x_ptr, total_ptr, big_ptr, big_sum_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.atomic_add(hist_ptr + tl.load(bins_ptr + offs, mask=mask), 1, mask=mask)  # int32
    tl.atomic_add(total_ptr + tl.load(bins_ptr + offs, mask=mask), tl.load(x_ptr + offs, mask=mask), mask=mask)
    tl.atomic_add(
        big_sum_ptr + tl.load(bins_ptr + offs, mask=mask), tl.load(big_ptr + offs, mask=mask), mask=mask
    )  # int64: emulated with 32-bit atomics on iluvatar


def libdevice_math(x_ptr, out_ptr, flags_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, libdevice.tanh(x) + libdevice.exp(x), mask=mask)
    tl.store(flags_ptr + offs, libdevice.isnan(x).to(tl.int32) + 2 * libdevice.isinf(x).to(tl.int32), mask=mask)


SIGNATURES = {
    "elementwise": (
        {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"},
        {"BLOCK": 128},
    ),
    "reduction": (
        {"x_ptr": "*fp32", "sum_ptr": "*fp32", "max_ptr": "*fp32", "n_cols": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 64},
    ),
    "dot": (
        {
            "a_ptr": "*fp16",
            "b_ptr": "*fp16",
            "c_ptr": "*fp32",
            "M": "i32",
            "N": "i32",
            "K": "i32",
            "BM": "constexpr",
            "BN": "constexpr",
            "BK": "constexpr",
        },
        {"BM": 32, "BN": 32, "BK": 32},
    ),
    "atomics": (
        {
            "bins_ptr": "*i32",
            "hist_ptr": "*i32",
            "x_ptr": "*fp32",
            "total_ptr": "*fp32",
            "big_ptr": "*i64",
            "big_sum_ptr": "*i64",
            "n": "i32",
            "BLOCK": "constexpr",
        },
        {"BLOCK": 64},
    ),
    "libdevice_math": (
        {"x_ptr": "*fp32", "out_ptr": "*fp32", "flags_ptr": "*i32", "n": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 64},
    ),
}
KERNELS = {
    "elementwise": elementwise,
    "reduction": reduction,
    "dot": dot,
    "atomics": atomics,
    "libdevice_math": libdevice_math,
}

# ------------------------------------------------------------------------------------------------
# runs with float64 (or exact integer) references; ``jit`` wraps a plain function as a kernel
# ------------------------------------------------------------------------------------------------


def run_elementwise(jit, device, gen):
    n = 300
    x, y = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
    out = torch.full((n,), float("nan"), device=device)
    jit(elementwise)[(triton.cdiv(n, 128),)](x, y, out, n, 1.5, BLOCK=128)
    xd, yd = x.double(), y.double()
    ref = torch.where(xd > 0, 1.5 * xd, xd * torch.sigmoid(yd)) + yd.exp()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def run_reduction(jit, device, gen):
    rows, cols = 5, 37
    x = torch.randn(rows, cols, generator=gen).to(device)
    s = torch.full((rows,), float("nan"), device=device)
    m = torch.full((rows,), float("nan"), device=device)
    jit(reduction)[(rows,)](x, s, m, cols, BLOCK=64)
    torch.testing.assert_close(s.double(), x.double().sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.double(), x.double().amax(1), rtol=0, atol=0)


def run_dot(jit, device, gen):
    M, N, K = 40, 48, 72  # not multiples of the 32x32x32 tiles: masks matter
    a = torch.randn(M, K, generator=gen).half().to(device)
    b = torch.randn(K, N, generator=gen).half().to(device)
    c = torch.full((M, N), float("nan"), device=device)
    jit(dot)[(triton.cdiv(M, 32), triton.cdiv(N, 32))](a, b, c, M, N, K, BM=32, BN=32, BK=32)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-3, atol=1e-2)


def run_atomics(jit, device, gen, n=500, bins=7):
    idx = torch.randint(0, bins, (n,), generator=gen, dtype=torch.int32)
    x = torch.randn(n, generator=gen)
    # int64 addends whose low words are >= 2**31 so sums carry across the 32-bit boundary, and negatives
    big = (torch.randint(0, 1 << 20, (n,), generator=gen, dtype=torch.int64) << 32) + torch.randint(
        1 << 31, 1 << 32, (n,), generator=gen, dtype=torch.int64
    )
    big[::3] = -big[::3]
    hist = torch.zeros(bins, dtype=torch.int32)
    total = torch.zeros(bins)
    big_sum = torch.full((bins,), (1 << 32) - 1, dtype=torch.int64)
    ref_big = big_sum.clone().index_add_(0, idx.long(), big)
    args = [t.to(device) for t in (idx, hist, x, total, big, big_sum)]
    jit(atomics)[(triton.cdiv(n, 64),)](*args, n, BLOCK=64)
    _, hist, _, total, _, big_sum = (t.cpu() for t in args)
    assert torch.equal(hist, torch.bincount(idx.long(), minlength=bins).int())
    torch.testing.assert_close(
        total.double(),
        torch.zeros(bins, dtype=torch.float64).index_add_(0, idx.long(), x.double()),
        rtol=1e-5,
        atol=1e-4,
    )
    assert torch.equal(big_sum, ref_big)


def run_libdevice_math(jit, device, gen):
    n = 100
    x = torch.randn(n, generator=gen) * 3
    x[[4, 50]] = float("nan")
    x[[9, 77]] = torch.tensor([float("inf"), float("-inf")])
    out = torch.full((n,), float("nan"))
    flags = torch.full((n,), -1, dtype=torch.int32)
    x_d, out_d, flags_d = x.to(device), out.to(device), flags.to(device)
    jit(libdevice_math)[(triton.cdiv(n, 64),)](x_d, out_d, flags_d, n, BLOCK=64)
    finite = torch.isfinite(x)
    xd = x.double()
    torch.testing.assert_close(out_d.cpu()[finite].double(), (xd.tanh() + xd.exp())[finite], rtol=2e-6, atol=2e-6)
    assert flags_d.cpu().tolist() == (torch.isnan(x).int() + 2 * torch.isinf(x).int()).tolist()


CASES = {
    "elementwise": run_elementwise,
    "reduction": run_reduction,
    "dot": run_dot,
    "atomics": run_atomics,
    "libdevice_math": run_libdevice_math,
}

# ------------------------------------------------------------------------------------------------
# every registered backend target, offline
# ------------------------------------------------------------------------------------------------

TARGETS = {"cuda": CUDA, "hip": HIP, "iluvatar": ILUVATAR, "ascend": ASCEND}
BINARY = {"cuda": "cubin", "hip": "hsaco", "iluvatar": "cubin", "ascend": "npubin"}
# the libdevice symbols each target's module map must produce for tanh (fp32)
TANH_SYMBOL = {"cuda": "__nv_tanhf", "hip": "__ocml_tanh_f32", "iluvatar": "__nv_tanhf", "ascend": "__hmf_tanhf"}


def _compile_check(name, target_name):
    def check():
        signature, constexprs = SIGNATURES[name]
        k = compile_for(KERNELS[name], signature, constexprs, target=TARGETS[target_name])
        assert "ttir" in k.asm and BINARY[target_name] in k.asm, sorted(k.asm)
        ttir = k.asm["ttir"]
        if name == "atomics":  # iluvatar: no 64-bit atomic; everyone else: the stock one
            i64 = [line for line in ttir.splitlines() if "tt.atomic_rmw" in line and "xi64>" in line]
            assert (not i64) if target_name == "iluvatar" else len(i64) == 1, i64
        if name == "libdevice_math":
            assert f'symbol = "{TANH_SYMBOL[target_name]}"' in ttir, "libdevice not mapped"

    return check


def compile_everything():
    """Compile every kernel for every target; report {"kernel@target": "ok" | error}."""
    run_checks({f"{name}@{t}": _compile_check(name, t) for t in TARGETS for name in SIGNATURES})


@pytest.fixture(scope="module")
def compiled():
    return run_without_interpreter("test_one_source", "compile_everything", timeout=900)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_compiles_for_every_target(compiled, kernel, target):
    assert compiled[f"{kernel}@{target}"] == "ok", compiled[f"{kernel}@{target}"]


# ------------------------------------------------------------------------------------------------
# the same kernels in the interpreter, under each backend's spec
# ------------------------------------------------------------------------------------------------

# nvidia / amd specs have no interpreter libdevice: interpreted libdevice is the cpu / vendor specs' job
INTERPRETED = [
    (b, k)
    for b in ("cpu", "iluvatar", "ascend", "nvidia", "amd")
    for k in CASES
    if not (k == "libdevice_math" and b in ("nvidia", "amd"))
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter run (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("backend,kernel", INTERPRETED)
def test_runs_in_the_interpreter(backend, kernel, gen):
    if backend == "cpu":  # the default for interpreted kernels
        assert tritonspec.current_backend() == "cpu"
        CASES[kernel](triton.jit, "cpu", gen)
    else:
        with tritonspec.use_backend(backend):
            CASES[kernel](triton.jit, "cpu", gen)
