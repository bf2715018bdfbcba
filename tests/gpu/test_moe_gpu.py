"""The experts' grouped GEMM of Hopper's spec (``moe_experts_gemm``) at a Mixtral-class shape: it takes the
forward's gate/up and down GEMMs and the backward's, every output element is written, and the op's output and
all its gradients equal the portable kernels' bit for bit (the same products summed in the same order), so
the float64 checks of those kernels hold for it too; the output is checked against float64 here as well.

Run with TRITONSPEC_TEST_DEVICE=cuda on an sm90 GPU; the CPU suite checks the op's side of the hook.
"""

import pytest
import torch

from tritonspec.ops import moe as moe_mod
from numerics import assert_close, poisoned_allocations
from tritonspec.ops.moe import moe_experts, moe_experts_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _run(x, ids, w, gate_up, down, dout):
    with torch.no_grad():
        inference = moe_experts(x, ids, w, gate_up, down)
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    out = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3])
    out.backward(dout)
    return [inference, out.detach()] + [t.grad for t in leaves]


@pytest.mark.skipif(not _sm90(), reason="Hopper's own kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hopper_grouped_gemm_equals_the_portable_kernels(dtype, monkeypatch):
    T, H, I, E, k = 1024, 2048, 16384, 4, 2  # 512 rows an expert, experts of 2^25 elements: taken
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEV)
    w = torch.rand(T, k, generator=gen).softmax(-1).to(DEV, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H**-0.5).to(DEV, dtype)
    down = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(DEV, dtype)
    dout = torch.randn(T, H, generator=gen).to(DEV, dtype)
    asked = []
    backend_gemm = moe_mod._backend_gemm

    def recording(*args, **kwargs):
        run = backend_gemm(*args, **kwargs)
        asked.append(run is not None)
        return run

    monkeypatch.setattr(moe_mod, "_backend_gemm", recording)
    with poisoned_allocations():
        hopper = _run(x, ids, w, gate_up, down, dout)
    # gate/up and down twice (inference, then saving for the backward), then the backward's two GEMMs
    assert asked == [True] * 6
    monkeypatch.setattr(moe_mod, "_backend_gemm", lambda *args, **kwargs: None)
    portable = _run(x, ids, w, gate_up, down, dout)
    for name, a, b in zip(("inference", "out", "dx", "dweights", "dgate_up", "ddown"), hopper, portable):
        assert torch.equal(a, b), name
    ref = moe_experts_ref(x.double(), ids, w.double(), gate_up.double(), down.double())
    assert_close(hopper[0], ref, "out", dtype)
