"""RMSNorm / add+RMSNorm against the float64 reference: outputs, dx, dweight, dresidual.

Runs on the CPU through the Triton interpreter (shapes kept small); the same tests run on a GPU
with TRITONSPEC_TEST_DEVICE=cuda.
"""

import pytest
from helpers import leaf, make_spec
import torch

import tritonspec
from tritonspec.ops import _library, add_rms_norm, rms_norm
from numerics import RTOL, assert_close, poisoned_allocations
from tritonspec.ops.rms_norm import ADD_RMS_NORM, MAX_FUSED_N, RMS_NORM, add_rms_norm_ref, rms_norm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dweight_scale(x, dy, eps=1e-6) -> float:
    """Largest per-column sum of |dy * xhat|: what dweight's rounding error is relative to."""
    xhat = rms_norm_ref(x.detach(), torch.ones(x.shape[-1], device=x.device, dtype=torch.float64), eps)
    return (dy.double().abs() * xhat.abs()).reshape(-1, x.shape[-1]).sum(0).max().item()


def _inputs(shape, dtype, device, wdtype=None):
    x = torch.randn(shape, device=device).to(dtype)
    w = (1.0 + 0.5 * torch.randn(shape[-1], device=device)).to(wdtype or dtype)
    return x, w


def _check_rms_norm(x, w, eps=1e-6, in_place_backward=False):
    """Forward and backward of rms_norm on (x, w) against the float64 reference."""
    xl, wl = leaf(x), leaf(w)
    with poisoned_allocations():
        y = rms_norm(xl, wl, eps, in_place_backward=in_place_backward)
        dy = torch.randn(y.shape, device=y.device).to(y.dtype)
        y.backward(dy.clone())
    x64, w64 = leaf(x.double()), leaf(w.double())
    ref = rms_norm_ref(x64, w64, eps)
    ref.backward(dy.double())
    assert y.shape == x.shape and y.dtype == torch.promote_types(x.dtype, w.dtype)
    lo = max((x.dtype, w.dtype), key=RTOL.get)  # the normalized x is rounded to x's dtype (Llama)
    assert_close(y, ref, "y", lo)
    assert_close(xl.grad, x64.grad, "dx", lo)
    assert_close(wl.grad, w64.grad, "dweight", lo, scale=dweight_scale(x, dy, eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 123), (5, 1), (1, 64), (2, 3, 2, 40)])
def test_rms_norm_matches_reference(shape, dtype, device):
    torch.manual_seed(hash((shape, str(dtype))) % 2**31)
    # With N=1, dx = rstd*dy*w*eps/(x^2+eps): a cancellation no float32 kernel (or HF) resolves at
    # eps=1e-6, so that shape uses an eps large enough for the gradient to be well conditioned.
    _check_rms_norm(*_inputs(shape, dtype, device), eps=1.0 if shape[-1] == 1 else 1e-6)


def test_rms_norm_mixed_weight_dtype_promotes_like_hf(device):
    x, w = _inputs((4, 96), torch.bfloat16, device, wdtype=torch.float32)
    _check_rms_norm(x, w)


def test_rms_norm_noncontiguous_inputs(device):
    base = torch.randn(3, 7, 200, device=device)
    _check_rms_norm(base[..., 50:173], _inputs((1, 123), torch.float32, device)[1])  # row-strided view
    _check_rms_norm(torch.randn(7, 3, 123, device=device).transpose(0, 1), torch.randn(123, device=device))


def test_rms_norm_strided_weight(device):
    """A weight viewed with a stride (e.g. every other element of a buffer) is read as such, and its
    gradient lands on the viewed elements only."""
    torch.manual_seed(5)
    x = torch.randn(3, 5, 64, device=device)
    wbase = leaf(1 + 0.5 * torch.randn(128, device=device))
    w64 = leaf(wbase.detach().double())
    y = rms_norm(x, wbase[::2])
    ref = rms_norm_ref(x.double(), w64[::2])
    dy = torch.randn(y.shape, device=device)
    y.backward(dy)
    ref.backward(dy.double())
    assert_close(y, ref, "y")
    assert_close(wbase.grad, w64.grad, "dweight", scale=dweight_scale(x, dy))
    r = torch.randn_like(x)
    out, _ = add_rms_norm(x, r, wbase.detach()[1::2])
    assert_close(out, add_rms_norm_ref(x.double(), r.double(), wbase.detach()[1::2].double())[0], "y")


def test_rms_norm_long_rows_take_the_looped_path(device):
    """N above MAX_FUSED_N: rows are processed in chunks (two passes), both directions."""
    x, w = _inputs((2, 8 * MAX_FUSED_N), torch.float32, device)
    _check_rms_norm(x, w, eps=1e-5)


def test_rms_norm_rows_of_4096_and_longer_use_the_one_program_per_sm_blocks(device):
    """N=4096 takes 4-row blocks in the backward; 7 rows leave a ragged last block."""
    _check_rms_norm(*_inputs((7, 4096), torch.bfloat16, device))


def test_rms_norm_adds_no_view_nodes_to_the_autograd_graph(device):
    """Leading dims are handled inside the autograd Function: one node between y and the leaves."""
    x, w = _inputs((2, 3, 40), torch.float32, device)
    xl, wl = leaf(x), leaf(w)
    y = rms_norm(xl, wl)
    assert type(y.grad_fn).__name__ == "RmsNormFunctionBackward"
    leaves = [fn.variable for fn, _ in y.grad_fn.next_functions if fn is not None and hasattr(fn, "variable")]
    assert leaves[0] is xl and leaves[1] is wl
    assert y.shape == x.shape and y.is_contiguous()


def test_rms_norm_in_place_backward_reuses_the_gradient(device):
    x, w = _inputs((6, 72), torch.float32, device)
    _check_rms_norm(x, w, in_place_backward=True)
    xl = leaf(x)
    dy = torch.randn_like(x)
    dy0 = dy.clone()
    rms_norm(xl, w, in_place_backward=True).backward(dy)
    assert not torch.equal(dy, dy0) and torch.equal(xl.grad, dy)  # dy's storage now holds dx ...
    assert xl.grad.data_ptr() == dy.data_ptr()  # ... and x adopted it as .grad without a copy


@pytest.fixture
def small_blocks(registry):
    """A backend spec forcing tiny BLOCK_N: the looped path at interpreter-friendly sizes, through
    the same launch_config override a real backend would use."""
    calls = []

    def kernel_config(kernel, **problem):
        calls.append(kernel)
        if kernel == "rms_norm_bwd":
            return {"BLOCK_N": 32, "BLOCK_M": 2, "programs_per_unit": 1}
        return {"BLOCK_N": 32, "BLOCK_M": 2} if kernel == "rms_norm_fwd" else None

    spec = make_spec("tritonspec_test_small_blocks", kernel_config=kernel_config)
    tritonspec.register_spec("test-small-blocks", spec)
    with tritonspec.use_backend("test-small-blocks"):
        yield calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_looped_path_via_backend_spec(small_blocks, dtype, device):
    _check_rms_norm(*_inputs((5, 3, 100), dtype, device))
    _check_add_rms_norm(*_inputs((5, 3, 100), dtype, device), torch.randn(5, 3, 100, device=device).to(dtype))
    assert {"rms_norm_fwd", "rms_norm_bwd"} <= set(small_blocks)


def _check_add_rms_norm(x, w, residual, grad_residual_out=True):
    xl, rl, wl = leaf(x), leaf(residual), leaf(w)
    with poisoned_allocations():
        y, s = add_rms_norm(xl, rl, wl)
        dy = torch.randn(y.shape, device=y.device).to(y.dtype)
        ds = torch.randn(s.shape, device=s.device).to(s.dtype)
        loss = (y * dy).sum() + ((s * ds).sum() if grad_residual_out else 0)
        loss.backward()
    x64, r64, w64 = leaf(x.double()), leaf(residual.double()), leaf(w.double())
    ref_y, ref_s = add_rms_norm_ref(x64, r64, w64)
    ((ref_y * dy.double()).sum() + ((ref_s * ds.double()).sum() if grad_residual_out else 0)).backward()
    assert_close(y, ref_y, "y")
    assert_close(s, ref_s, "new_residual")
    assert_close(xl.grad, x64.grad, "dx")
    assert_close(rl.grad, r64.grad, "dresidual")
    assert_close(wl.grad, w64.grad, "dweight", scale=dweight_scale(x64 + r64, dy))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad_residual_out", [True, False])
def test_add_rms_norm_matches_reference(dtype, grad_residual_out, device):
    torch.manual_seed(7)
    x, w = _inputs((3, 7, 123), dtype, device)
    _check_add_rms_norm(x, w, torch.randn(3, 7, 123, device=device).to(dtype), grad_residual_out)


def test_library_op_path_in_eager(monkeypatch, device):
    """The registered ops (what torch.compile calls) and their autograd, without compiling."""
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    _check_rms_norm(*_inputs((3, 7, 123), torch.float32, device))
    x, w = _inputs((4, 33), torch.bfloat16, device)
    _check_add_rms_norm(x, w, torch.randn(4, 33, device=device).to(torch.bfloat16))


def test_torch_compile_fullgraph(device):
    x, w = _inputs((3, 7, 123), torch.float32, device)
    r = torch.randn_like(x)

    def f(x, r, w):
        y, s = add_rms_norm(x, r, w)
        return rms_norm(y, w) + s

    xl, rl, wl = leaf(x), leaf(r), leaf(w)
    out = torch.compile(f, fullgraph=True)(xl, rl, wl)
    dy = torch.randn_like(out)
    out.backward(dy)
    x64, r64, w64 = leaf(x.double()), leaf(r.double()), leaf(w.double())
    ry, rs = add_rms_norm_ref(x64, r64, w64)
    ref = rms_norm_ref(ry, w64) + rs
    ref.backward(dy.double())
    assert_close(out, ref, "out")
    for name, a, b in [("dx", xl, x64), ("dresidual", rl, r64), ("dweight", wl, w64)]:
        assert_close(a.grad, b.grad, name)


def test_opcheck(device):
    x, w = _inputs((6, 40), torch.float32, device)
    r = torch.randn_like(x)
    torch.library.opcheck(RMS_NORM.forward_op, (leaf(x), leaf(w), 1e-6))
    torch.library.opcheck(ADD_RMS_NORM.forward_op, (leaf(x), leaf(r), leaf(w), 1e-6))
    _, rstd = RMS_NORM.forward_op(x, w, 1e-6)
    torch.library.opcheck(RMS_NORM.backward_op, (torch.randn_like(x), x, w, rstd))
    torch.library.opcheck(ADD_RMS_NORM.backward_op, (torch.randn_like(x), torch.randn_like(x), x, w, rstd))
    torch.library.opcheck(ADD_RMS_NORM.backward_op, (None, torch.randn_like(x), x, w, rstd))


def test_empty_batch(device):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    w = torch.randn(16, device=device, requires_grad=True)
    y = rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


def test_layer_is_a_drop_in_for_llama_rms_norm(device):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from tritonspec.nn.modules import RMSNorm

    hf = modeling.LlamaRMSNorm(48, eps=1e-5).to(device)
    with torch.no_grad():
        hf.weight.normal_()
    ours = RMSNorm(48, eps=1e-5).to(device)
    ours.load_state_dict(hf.state_dict())
    assert ours.variance_epsilon == hf.variance_epsilon
    x = torch.randn(2, 5, 48, device=device)
    assert_close(ours(x), hf(x).double(), "RMSNorm vs LlamaRMSNorm")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: rms_norm(torch.randn(2, 8, device=d), torch.randn(7, device=d)), "'weight' has shape"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), torch.randn(2, 8, device=d)), "'weight' must have 1 dim"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d).int(), torch.randn(8, device=d)), "'x' has dtype torch.int32"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d).double(), torch.randn(8, device=d)), "'x' has dtype"),
        (lambda d: rms_norm([1.0], torch.randn(8, device=d)), "'x' must be a torch.Tensor"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), torch.randn(8, device="meta")), "'weight' is on meta"),
        (lambda d: rms_norm(torch.randn(2, 8, device=d), torch.randn(8, device=d), eps=-1.0), "'eps' must be >= 0"),
        (lambda d: rms_norm(torch.randn(2, 0, device=d), torch.randn(0, device=d)), "'x' has an empty last"),
        (
            lambda d: add_rms_norm(torch.randn(2, 8, device=d), torch.randn(3, 8, device=d), torch.randn(8, device=d)),
            "'residual' has shape",
        ),
        (
            lambda d: add_rms_norm(
                torch.randn(2, 8, device=d), torch.randn(2, 8, device=d).half(), torch.randn(8, device=d)
            ),
            "'residual' has dtype",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        call(device)


def test_a_declined_dw_plan_never_reruns_the_backward_kernel(monkeypatch):
    """The backward plans launch two kernels. If the dw reduction's plan declines after the main
    kernel's plan ran (in place, dy already holds dx), only the reduction takes the ordinary path."""
    import sys

    mod = sys.modules["tritonspec.ops.rms_norm"]
    calls = []

    def main_plan(*tensors):
        calls.append("main plan")
        return True

    def reduce_plan(*tensors):
        calls.append("reduce plan declined")
        return False

    class Plans(dict):
        def get(self, key):
            return main_plan, reduce_plan, 2, torch.zeros

    def launch(kernel, grid, **kwargs):
        calls.append(kernel.fn.__name__)

    monkeypatch.setattr(mod, "_BWD_PLANS", Plans())
    monkeypatch.setattr(mod, "launch", launch)
    x, dy = torch.randn(3, 8), torch.randn(3, 8)
    mod.rms_norm_backward(dy, x, torch.ones(8), torch.ones(3), in_place=True)
    assert calls == ["main plan", "reduce plan declined", "_rms_norm_dw_kernel"]
