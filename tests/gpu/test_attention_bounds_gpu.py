"""Attention with key bounds and sinks on a CUDA GPU at model shapes, against float64.

Tolerance model as tests/gpu/test_attention_gpu.py: within a small multiple of the error of PyTorch's SDPA
with the equivalent dense mask, in the same dtype, plus one ulp of the output's magnitude. Runs as the
nvidia spec ships: on sm90 Hopper's own kernels take the bounds (the ``tl`` kernels take the sinks).
"""

import pytest
from helpers import leaf
import torch
import torch.nn.functional as F

from tritonspec.ops.attention import attention, attention_ref, causal_key_bounds, key_bounds_from_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _grads(fn, q, k, v, do, sinks, sinks_grad=True):
    q, k, v = (leaf(t) for t in (q, k, v))
    sinks = None if sinks is None else leaf(sinks)
    out = fn(q, k, v, sinks)
    leaves = (q, k, v) + (() if sinks is None or not sinks_grad else (sinks,))
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


def _sdpa(keep):
    """SDPA with the dense mask (and sinks as an extra key with a zero value), in the inputs' dtype."""

    def run(q, k, v, sinks):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        mask = keep
        if sinks is not None:  # the sink: one more key whose score is the sink's logit and whose value is 0
            b, h, s, d = q.shape
            extra = torch.zeros(b, h, 1, d, device=q.device, dtype=q.dtype)
            k = torch.cat((k, extra), 2)
            v = torch.cat((v, extra), 2)
            mask = torch.zeros(b, h, s, k.shape[2], device=q.device, dtype=torch.float32)
            mask[..., :-1].masked_fill_(~keep, float("-inf"))
            mask[..., -1] = sinks.detach().float()[None, :, None]
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.nan_to_num(0.0)

    return run


def _check(bounds, B, HQ, HKV, S, D, dtype, with_sinks=False):
    g = torch.Generator(device="cuda").manual_seed(S + D + B)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dtype)  # noqa: E731
    q, k, v, do = mk(B, S, HQ, D).transpose(1, 2), mk(B, S, HKV, D).transpose(1, 2), mk(B, S, HKV, D), mk(B, HQ, S, D)
    v = v.transpose(1, 2)
    sinks = torch.randn(HQ, device="cuda", generator=g) if with_sinks else None
    keys = torch.arange(S, device="cuda")
    keep = ((keys >= bounds[0][..., None]) & (keys < bounds[1][..., None]))[:, None]
    real = keep.any(-1)  # queries that see a key: SDPA's fully masked rows are NaN
    ours = _grads(lambda q, k, v, s: attention(q, k, v, key_bounds=bounds, sinks=s), q, k, v, do, sinks)
    ref = _grads(
        lambda q, k, v, s: attention_ref(q, k, v, key_bounds=bounds, sinks=s),
        *(t.double() for t in (q, k, v, do)),
        None if sinks is None else sinks.double(),
    )
    sdpa = _grads(_sdpa(keep), q, k, v, do.masked_fill(~real[..., None], 0), sinks, sinks_grad=False)
    for name, o, r, s in zip(("out", "dq", "dk", "dv", "dsinks"), ours, ref, (*sdpa, None)):
        assert torch.isfinite(o).all(), f"{name}: non-finite values"
        err = (o.double() - r).abs().max().item()
        # dsinks sums a term per row: within a percent of its magnitude (SDPA gives no gradient to compare with)
        err_sdpa = (s.double() - r).abs().max().item() if s is not None else 0.01 / 3 * r.abs().max().item()
        bound = 3 * err_sdpa + _EPS[dtype] * max(1.0, r.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} (SDPA's error {err_sdpa:.3e})"


def _padded(lengths, S, left):
    lengths = torch.tensor(lengths)
    pos = torch.arange(S)
    tokens = pos[None] >= (S - lengths)[:, None] if left else pos[None] < lengths[:, None]
    keep = (pos[:, None] >= pos[None, :])[None] & tokens[:, None, :] & tokens[:, :, None]
    return key_bounds_from_mask(keep.cuda())


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded(D, dtype):
    _check(_padded([1500, 2048, 700, 1], 2048, left=True), 4, 16, 4, 2048, D, dtype)
    _check(_padded([2048, 1111], 2048, left=False), 2, 8, 8, 2048, D, dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_packed(D):
    cu = torch.tensor([0, 1000, 1001, 2900, 2900, 4096], device="cuda")
    _check(causal_key_bounds(cu_seqlens=cu), 1, 32, 8, 4096, D, torch.bfloat16)


@pytest.mark.parametrize("D", [64, 128])
def test_sliding_window_with_sinks(D):
    bounds = causal_key_bounds(seq_len=4096, window=1000, device="cuda").expand(2, 2, 4096).contiguous()
    _check(bounds, 2, 16, 2, 4096, D, torch.bfloat16, with_sinks=True)


@pytest.mark.parametrize("D", [64, 128])
def test_sliding_window_and_arbitrary_intervals(D):
    bounds = causal_key_bounds(seq_len=3000, window=700, device="cuda").expand(2, 2, 3000).contiguous()
    _check(bounds, 2, 16, 4, 3000, D, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(D)
    lo = torch.randint(0, 3000, (2, 3000), device="cuda", generator=g)
    hi = (lo + torch.randint(-300, 3000, (2, 3000), device="cuda", generator=g)).clamp(0, 3000)
    _check(torch.stack((lo, hi)), 2, 16, 4, 3000, D, torch.float16)


def test_hopper_kernels_take_key_bounds():
    """On an H100 the warp-specialized kernels run key bounds (forward and backward), not the tl kernels."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper's kernels run on sm90")
    from tritonspec_backends.nvidia.backend.spec.attention_sm90 import launchers
    from tritonspec.ops.attention import _padded_bounds, _padded_rows

    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    bounds = _padded_bounds(causal_key_bounds(seq_len=1000, window=300, device="cuda").expand(2, 2, 1000), 1000)
    lse = _padded_rows(2, 8, 1000, float("inf"), q.device)
    assert launchers.attention_forward(q, q, q, torch.empty_like(q), lse, False, 0.1, bounds=bounds)
    dk, dv = torch.empty_like(q), torch.empty_like(q)
    assert launchers.attention_backward(q, q, q, q, dk, dv, lse, False, 0.1, bounds=bounds)
