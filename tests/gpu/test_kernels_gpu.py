"""RMSNorm / SwiGLU / RoPE on a CUDA GPU: model-sized shapes, compiled Triton (not the interpreter),
the triton_op path under Inductor (static and dynamic shapes), 64-bit indexing.

Run with TRITONSPEC_TEST_DEVICE=cuda; the CPU test files run there too and cover the dtype matrix.
"""

import pytest
from helpers import leaf
import torch

from tritonspec.ops import _library, add_rms_norm, rms_norm, rope, swiglu
from numerics import RTOL, assert_close, poisoned_allocations
from tritonspec.ops.rms_norm import MAX_FUSED_N, add_rms_norm_ref, rms_norm_ref
from tritonspec.ops.rope import ROPE, rope_ref
from tritonspec.ops.swiglu import SWIGLU, swiglu_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _grads(out, ref, inputs, refs):
    dy = torch.randn(out.shape, device=DEV).to(out.dtype)
    out.backward(dy)
    ref.backward(dy.double())
    return [(a.grad, b.grad) for a, b in zip(inputs, refs)]


def test_uses_triton_op_on_gpu():
    assert _library.USE_TRITON_OP == hasattr(torch.library, "triton_op")


@pytest.mark.parametrize("n", [1, 3, 127, 4096, 8192, MAX_FUSED_N, MAX_FUSED_N + 1, 65537, 131072])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_hidden_sizes(n, dtype):
    torch.manual_seed(n)
    m = max(1, min(257, (1 << 22) // n))
    x = torch.randn(m, n, device=DEV).to(dtype)
    w = (1 + 0.5 * torch.randn(n, device=DEV)).to(dtype)
    eps = 1.0 if n == 1 else 1e-6  # see test_rms_norm: N=1's gradient is ill-conditioned at tiny eps
    xl, wl = leaf(x), leaf(w)
    with poisoned_allocations():
        y = rms_norm(xl, wl, eps)
        x64, w64 = leaf(x.double()), leaf(w.double())
        ref = rms_norm_ref(x64, w64, eps)
        dy = torch.randn(y.shape, device=DEV).to(y.dtype)
        y.backward(dy)
        ref.backward(dy.double())
        dx, rdx, dw, rdw = xl.grad, x64.grad, wl.grad, w64.grad
    assert_close(y, ref, "y")
    assert_close(dx, rdx, "dx")
    xhat = rms_norm_ref(x.double(), torch.ones(n, device=DEV, dtype=torch.float64), eps)
    assert_close(dw, rdw, "dweight", scale=(dy.double().abs() * xhat.abs()).sum(0).max().item())


def test_add_rms_norm_model_shape():
    x, r = (torch.randn(2, 1024, 4096, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    xl, rl, wl = leaf(x), leaf(r), leaf(w)
    y, s = add_rms_norm(xl, rl, wl)
    x64, r64, w64 = leaf(x.double()), leaf(r.double()), leaf(w.double())
    ry, rs = add_rms_norm_ref(x64, r64, w64)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    torch.autograd.backward((y, s), (dy, ds))
    torch.autograd.backward((ry, rs), (dy.double(), ds.double()))
    for name, a, b in [("y", y, ry), ("s", s, rs), ("dx", xl.grad, x64.grad), ("dres", rl.grad, r64.grad)]:
        assert_close(a, b, name)
    xhat = rms_norm_ref(rs.detach(), torch.ones(4096, device=DEV, dtype=torch.float64))
    assert_close(wl.grad, w64.grad, "dw", scale=(dy.double().abs() * xhat.abs()).sum((0, 1)).max().item())


def test_swiglu_model_shape_fused_projection_layout():
    fused = torch.randn(2048, 2 * 14336, device=DEV, dtype=torch.bfloat16)
    g, u = leaf(fused[:, :14336]), leaf(fused[:, 14336:])
    out = swiglu(g, u)
    g64, u64 = leaf(g.double()), leaf(u.double())
    ref = swiglu_ref(g64, u64)
    (dg, rdg), (du, rdu) = _grads(out, ref, (g, u), (g64, u64))
    assert_close(out, ref, "y")
    assert_close(dg, rdg, "dgate")
    assert_close(du, rdu, "dup")


def test_swiglu_more_than_2_31_elements():
    """64-bit offsets: a flat problem past int32 (forward only; 3 x 4.3 GB of bf16)."""
    n = (1 << 31) + 4099
    g = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    u = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    out = swiglu(g, u)
    for sl in (slice(0, 4096), slice(n - 8192, n)):
        assert_close(out[sl], swiglu_ref(g[sl], u[sl]), "y tail")
    del g, u, out
    torch.cuda.empty_cache()


def _check_rope(b, hq, hk, s, hf_layout, base=500000.0):
    """rope forward and backward at head_dim 128 against the float64 reference."""
    d = 128
    if hf_layout:
        q = torch.randn(b, s, hq, d, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, s, hk, d, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    else:
        q = torch.randn(b, hq, s, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device=DEV, dtype=torch.bfloat16)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([torch.arange(s, device=DEV).float()[:, None] * inv] * 2, -1)[None].expand(b, s, d)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    ql, kl = leaf(q), leaf(k)
    qo, ko = rope(ql, kl, cos, sin)
    q64, k64 = leaf(q.double()), leaf(k.double())
    rq, rk = rope_ref(q64, k64, cos, sin)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (dq, dk))
    torch.autograd.backward((rq, rk), (dq.double(), dk.double()))
    for name, a, r in [("q", qo, rq), ("k", ko, rk), ("dq", ql.grad, q64.grad), ("dk", kl.grad, k64.grad)]:
        assert_close(a, r, name)


@pytest.mark.parametrize("b, hq, hk, s, hf_layout", [(4, 32, 8, 1024, False), (1, 64, 8, 2048, True)])
def test_rope_model_shapes(b, hq, hk, s, hf_layout):
    _check_rope(b, hq, hk, s, hf_layout)


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_fullgraph_triton_op(dynamic):
    """Inductor sees the triton_op bodies; two row counts exercise dynamic shapes."""
    w = leaf(torch.randn(4096, device=DEV, dtype=torch.bfloat16))

    def block(x, r, q, k, cos, sin):
        h, s = add_rms_norm(x, r, w)
        a = swiglu(h, rms_norm(s, w))
        qo, ko = rope(q, k, cos, sin)
        return a.float().sum() + qo.float().sum() + ko.float().sum()

    f = torch.compile(block, fullgraph=True, dynamic=dynamic)
    for m in (96, 160):
        x, r = (leaf(torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)) for _ in range(2))
        q = leaf(torch.randn(1, 8, m, 128, device=DEV, dtype=torch.bfloat16))
        k = leaf(torch.randn(1, 2, m, 128, device=DEV, dtype=torch.bfloat16))
        cos, sin = torch.randn(1, m, 128, device=DEV), torch.randn(1, m, 128, device=DEV)
        f(x, r, q, k, cos, sin).backward()
        got = [t.grad.clone() for t in (x, r, q, k)]
        for t in (x, r, q, k):
            t.grad = None
        w.grad = None
        block(x, r, q, k, cos, sin).backward()  # eager path (raw launchers) as the reference
        for name, a, t in zip(("dx", "dres", "dq", "dk"), got, (x, r, q, k)):
            torch.testing.assert_close(
                a.float(),
                t.grad.float(),
                rtol=RTOL[torch.bfloat16],
                atol=RTOL[torch.bfloat16] * t.grad.abs().max().item(),
                msg=name,
            )
        w.grad = None


def test_opcheck_triton_ops():
    g, u = (leaf(torch.randn(64, 256, device=DEV)) for _ in range(2))
    torch.library.opcheck(SWIGLU.forward_op, (g, u))
    q, k = leaf(torch.randn(2, 4, 16, 64, device=DEV)), leaf(torch.randn(2, 2, 16, 64, device=DEV))
    cos, sin = torch.randn(2, 16, 64, device=DEV), torch.randn(2, 16, 64, device=DEV)
    torch.library.opcheck(ROPE.forward_op, (q, k, cos, sin))


def test_cpu_tensor_without_interpreter_is_rejected():
    with pytest.raises(ValueError, match="'x' is on the CPU"):
        rms_norm(torch.randn(2, 8), torch.randn(8))


def test_cached_launches_respecialize_on_alignment_dtype_and_spec():
    """Repeated eager calls reuse compiled kernels only where Triton would: another dtype and another spec
    selection each get their own kernel, an unaligned view takes Triton's own path (never a cached binary),
    and every result stays correct."""
    import sys

    import tritonspec
    from tritonspec.ops.rms_norm import _rms_norm_fwd_kernel

    assert _library.USE_CACHED_LAUNCH
    sys.modules["tritonspec.ops.rms_norm"]._FWD_PLANS.clear()  # a plan would relaunch without the cache
    cached = _library.launcher(_rms_norm_fwd_kernel, traced=False)
    cached.compiled.clear()  # earlier tests in this process may have cached these shapes
    torch.manual_seed(0)
    base = torch.randn(65 * 4096 + 1, device=DEV)
    w = 1 + 0.5 * torch.randn(4096, device=DEV)
    aligned = base[: 64 * 4096].view(64, 4096)
    unaligned = base[1 : 64 * 4096 + 1].view(64, 4096)  # 4-byte offset: not 16-byte aligned
    cases = [aligned, unaligned, aligned.bfloat16(), aligned, unaligned]
    for x in cases:
        for _ in range(2):  # the second call of each is a cache (or plan) hit
            wx = w.to(x.dtype)
            assert_close(rms_norm(x, wx, 1e-6), rms_norm_ref(x, wx, 1e-6), "y", x.dtype)
    assert len(cached.compiled) == 2  # aligned fp32 and bf16; the unaligned calls went through Triton
    with tritonspec.use_backend("iluvatar"):
        for x in (aligned, unaligned):
            assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), "y", torch.float32)
    assert len(cached.compiled) == 3  # the iluvatar selection's own kernel


def test_eager_launch_plans_are_keyed_by_what_they_fix():
    """Repeated eager calls relaunch planned kernels; another eps, residual, in-place flag or layout
    on the same shape is another plan, and every call's outputs and gradients stay correct."""
    import sys

    rms_mod, rope_mod = sys.modules["tritonspec.ops.rms_norm"], sys.modules["tritonspec.ops.rope"]
    for plans in (rms_mod._FWD_PLANS, rms_mod._BWD_PLANS, rope_mod._PLANS):
        plans.clear()  # earlier tests may have planned these shapes
    torch.manual_seed(0)
    x = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16)
    w = (1 + 0.5 * torch.randn(4096, device=DEV)).bfloat16()
    r = torch.randn_like(x)
    for eps, in_place in [(1e-6, False), (1e-2, False), (1e-6, True), (1e-6, False)] * 2:
        xl, wl = leaf(x), leaf(w)
        y = rms_norm(xl, wl, eps, in_place_backward=in_place)
        x64, w64 = leaf(x.double()), leaf(w.double())
        ref = rms_norm_ref(x64, w64, eps)
        dy = torch.randn_like(y)
        y.backward(dy.clone())
        ref.backward(dy.double())
        assert_close(y, ref, "y")
        assert_close(xl.grad, x64.grad, "dx")
        out, s = add_rms_norm(x, r, w, eps)
        ref_out, ref_s = add_rms_norm_ref(x.double(), r.double(), w.double(), eps)
        assert_close(out, ref_out, "add y")
        assert_close(s, ref_s, "add residual")
    assert len(rms_mod._FWD_PLANS) == 4  # rms_norm and add_rms_norm, each at two eps
    assert len(rms_mod._BWD_PLANS) == 2  # out of place and in place
    for hf_layout in (False, True, False, True):
        _check_rope(2, 8, 2, 64, hf_layout, base=10000.0)
    assert len(rope_mod._PLANS) == 4  # forward and backward, in both layouts
