"""The iluvatar profile on an NVIDIA GPU: its conformance target (the profile is emulated).

The iluvatar driver is made active (``driver.activate()``: triton 3.6 cannot be told to skip the
CUDA driver), so kernels compile for ``GPUTarget("iluvatar", <sm>, 32)`` with the iluvatar spec
and run through the CUDA launcher. Checked: the 64-bit atomic add emulated with 32-bit atomics
under real concurrency (many programs, few addresses, carries across the 32-bit boundary), no
bf16 atomics, num_stages <= 2, and the one-source kernel set of tests/test_one_source.py.
"""

import pytest
import test_one_source  # the one-source kernel set (tests/ is on sys.path: conftest.py)
import torch
import triton
import triton.language as tl

import tritonspec
from tritonspec_backends.iluvatar.backend import driver as iluvatar_driver

pytestmark = pytest.mark.gpu


@pytest.fixture
def iluvatar():
    from triton.runtime.driver import driver

    with tritonspec.use_backend("iluvatar"):
        previous = iluvatar_driver.activate()
        try:
            yield driver.active
        finally:
            driver.set_active(previous)


@triton.jit
def add64(out_ptr, val_ptr, idx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.atomic_add(out_ptr + tl.load(idx_ptr + offs, mask=mask), tl.load(val_ptr + offs, mask=mask), mask=mask)


def test_the_active_driver_targets_iluvatar(iluvatar):
    target = iluvatar.get_current_target()
    major, minor = torch.cuda.get_device_capability()
    assert (target.backend, target.arch) == ("iluvatar", major * 10 + minor)


@pytest.mark.parametrize("bins", [1, 3, 64])
def test_int64_atomic_add_under_contention_with_carries(iluvatar, gen, bins):
    n = 1 << 20
    lo = torch.randint(1 << 31, 1 << 32, (n,), generator=gen, dtype=torch.int64)  # low words that carry
    hi = torch.randint(0, 1 << 8, (n,), generator=gen, dtype=torch.int64)
    vals = (hi << 32) + lo
    vals[torch.rand(n, generator=gen) < 0.3] *= -1  # borrows through the high word too
    idx = torch.randint(0, bins, (n,), generator=gen, dtype=torch.int32)
    init = torch.randint(-(1 << 40), 1 << 40, (bins,), generator=gen, dtype=torch.int64)
    init[0] = (1 << 32) - 1
    ref = init.clone().index_add_(0, idx.long(), vals)  # |sum| < 2**61: no int64 overflow
    out = init.cuda()
    for _ in range(3):  # repeat: a lost carry under some interleaving would show up as a mismatch
        out.copy_(init)
        kernel = add64[(n // 1024,)](out, vals.cuda(), idx.cuda(), n, BLOCK=1024)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), ref)
    assert kernel.metadata.target.backend == "iluvatar"
    atoms = [
        tok for line in kernel.asm["ptx"].splitlines() for tok in line.split() if tok.startswith(("atom.", "red."))
    ]
    assert atoms and all(a.endswith(".u32") for a in atoms), atoms


@triton.jit
def add_bf16(ptr, val_ptr):
    offs = tl.arange(0, 32)
    tl.atomic_add(ptr + offs, tl.load(val_ptr + offs))


def test_bf16_atomics_are_rejected(iluvatar):
    x = torch.zeros(32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(Exception, match="bfloat16 is not supported by backend 'iluvatar'"):
        add_bf16[(1,)](x, torch.ones_like(x))


@triton.jit
def matmul(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        acc += tl.dot(
            tl.load(a_ptr + r[:, None] * K + (k + r)[None, :]), tl.load(b_ptr + (k + r)[:, None] * BLOCK + r[None, :])
        )
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], acc)


def test_num_stages_is_capped_and_the_pipelined_result_is_right(iluvatar, gen):
    K = 512
    a = torch.randn(64, K, generator=gen).half().cuda()
    b = torch.randn(K, 64, generator=gen).half().cuda()
    c = torch.full((64, 64), float("nan"), device="cuda")
    kernel = matmul[(1,)](a, b, c, K, BLOCK=64, num_stages=4)
    assert kernel.metadata.num_stages == 2
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("case", list(test_one_source.CASES))
def test_one_source_kernel_set(iluvatar, gen, case):
    test_one_source.CASES[case](triton.jit, "cuda", gen)
