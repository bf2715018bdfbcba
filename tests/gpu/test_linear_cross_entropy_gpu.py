"""The fused LM head + cross-entropy on a CUDA GPU: compiled Triton and cuBLAS chunks (not the interpreter),
vocabularies larger than a row block, several chunks, bf16 as models train, against the float64 reference.

Run with TRITONSPEC_TEST_DEVICE=cuda; tests/test_linear_cross_entropy.py covers the options on the CPU.
"""

import pytest
import torch

from numerics import poisoned_allocations
from tritonspec.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(n, h, v, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = torch.randn(n, h, device=DEV, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=DEV, generator=g) * h**-0.5).to(dtype)
    bias = (0.1 * torch.randn(v, device=DEV, generator=g)).to(dtype)
    labels = torch.randint(0, v, (n,), device=DEV, generator=g)
    labels[torch.rand(n, device=DEV, generator=g) < 0.1] = -100
    return hidden, weight, bias, labels


def _grads(fn, tensors, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in tensors[:3]]
    loss = fn(*leaves[:2], tensors[3], bias=leaves[2], **kwargs)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("n,h,v", [(1000, 512, 32003), (4096, 1024, 128256), (3000, 2048, 151936)])
@pytest.mark.parametrize(
    "options", [{}, {"softcap": 30.0, "label_smoothing": 0.1}, {"reduction": "sum"}, {"num_items_in_batch": 4321}]
)
def test_bf16_against_float64(n, h, v, options):
    x = _inputs(n, h, v, torch.bfloat16, seed=n + v)
    with poisoned_allocations():
        loss, grads = _grads(linear_cross_entropy, x, **options)
    ref, ref_grads = _grads(
        linear_cross_entropy_ref, [t.double() if t.is_floating_point() else t for t in x], **options
    )
    # bf16 logits (as lm_head rounds them) and bf16 gradients: a few bf16 ulps at each tensor's magnitude
    assert torch.isfinite(loss) and abs(loss.double() - ref).item() <= 2e-2 * max(1.0, ref.abs().item())
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        err = (g.double() - r).abs().max().item()
        assert err <= 2e-2 * r.abs().max().item(), f"d{name}: max error {err:.3e} vs magnitude {r.abs().max():.3e}"
