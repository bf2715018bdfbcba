"""SwiGLU (silu(gate) * up) against the float64 reference: output, dgate, dup."""

import pytest
from helpers import leaf, model_config
import torch

from tritonspec.ops import _library, swiglu
from numerics import assert_close, poisoned_allocations
from tritonspec.ops.swiglu import SWIGLU, swiglu_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(gate, up, in_place_backward=False):
    gl, ul = leaf(gate), leaf(up)
    with poisoned_allocations():
        y = swiglu(gl, ul, in_place_backward=in_place_backward)
        dy = torch.randn(y.shape, device=y.device).to(y.dtype)
        y.backward(dy)
    g64, u64 = leaf(gate.double()), leaf(up.double())
    ref = swiglu_ref(g64, u64)
    ref.backward(dy.double())
    assert y.shape == gate.shape and y.dtype == gate.dtype
    assert_close(y, ref, "y")
    # dgate = dy * up * sig(g) * (1 + g * (1 - sig(g))): near silu's minimum the bracket cancels, so
    # its rounding scales with the terms, not with the result
    sig = torch.sigmoid(g64.detach())
    terms = (dy.double() * u64.detach() * sig).abs() * (1 + (g64.detach() * (1 - sig)).abs())
    assert_close(gl.grad, g64.grad, "dgate", scale=terms.max().item())
    assert_close(ul.grad, u64.grad, "dup")
    return gl, ul


def _pair(shape, dtype, device):
    return (3 * torch.randn(shape, device=device)).to(dtype), torch.randn(shape, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 123), (1,), (5, 1), (2, 4099)])
def test_swiglu_matches_reference(shape, dtype, device):
    torch.manual_seed(hash((shape, str(dtype))) % 2**31)
    _check(*_pair(shape, dtype, device))


def test_swiglu_row_strided_halves_of_a_fused_projection(device):
    """gate/up as column halves of one (tokens, 2*I) tensor: the 2-D strided path, no copy."""
    fused = torch.randn(3, 5, 2 * 77, device=device)
    gate, up = fused[..., :77], fused[..., 77:]
    assert not gate.is_contiguous()
    _check(gate, up)


def test_swiglu_transposed_inputs(device):
    gate, up = _pair((9, 6), torch.bfloat16, device)
    _check(gate.t(), up.t())


def test_swiglu_in_place_backward_writes_into_gate_and_up(device):
    gate, up = _pair((4, 50), torch.float32, device)
    gl, ul = _check(gate, up, in_place_backward=True)
    # leaves adopt the reused storage as .grad instead of copying it (the memory the option saves)
    assert gl.grad.data_ptr() == gl.data_ptr() and ul.grad.data_ptr() == ul.data_ptr()
    g, u = leaf(gate), leaf(up)
    gc, uc = g.detach().clone(), u.detach().clone()
    a, b = g * 1.0, u * 1.0  # non-leaf activations, as a projection would produce
    swiglu(a, b, in_place_backward=True).sum().backward()
    assert not torch.equal(a.detach(), gc) and not torch.equal(b.detach(), uc)  # storage reused for the grads
    assert torch.equal(g.grad, a.detach()) and torch.equal(u.grad, b.detach())


def test_library_op_path_in_eager(monkeypatch, device):
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    _check(*_pair((3, 7, 123), torch.float32, device))


def test_torch_compile_fullgraph(device):
    gate, up = _pair((3, 7, 123), torch.float32, device)
    gl, ul = leaf(gate), leaf(up)
    out = torch.compile(lambda g, u: swiglu(g, u) * 2.0, fullgraph=True)(gl, ul)
    dy = torch.randn_like(out)
    out.backward(dy)
    g64, u64 = leaf(gate.double()), leaf(up.double())
    ref = swiglu_ref(g64, u64) * 2.0
    ref.backward(dy.double())
    assert_close(out, ref, "out")
    assert_close(gl.grad, g64.grad, "dgate")
    assert_close(ul.grad, u64.grad, "dup")


def test_opcheck(device):
    gate, up = _pair((6, 40), torch.float32, device)
    torch.library.opcheck(SWIGLU.forward_op, (leaf(gate), leaf(up)))
    torch.library.opcheck(SWIGLU.backward_op, (torch.randn_like(gate), gate, up))


def test_layer_is_a_drop_in_for_llama_mlp(device):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from tritonspec.nn.modules import SwiGLUMLP

    cfg = model_config("llama", hidden_size=32, intermediate_size=72, hidden_act="silu")
    hf = modeling.LlamaMLP(cfg).to(device)
    ours = SwiGLUMLP(32, 72).to(device)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 32, device=device)
    xh, xo = leaf(x), leaf(x)
    ref, out = hf(xh), ours(xo)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    out.backward(dy)
    assert_close(out, ref, "SwiGLUMLP vs LlamaMLP")
    assert_close(xo.grad, xh.grad, "dx")
    for name, p in ours.named_parameters():
        assert_close(p.grad, dict(hf.named_parameters())[name].grad, f"d{name}")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: swiglu(torch.randn(2, 8, device=d), torch.randn(2, 9, device=d)), "'up' has shape"),
        (lambda d: swiglu(torch.randn(2, 8, device=d), torch.randn(2, 8, device=d).half()), "'up' has dtype"),
        (lambda d: swiglu(torch.randn(2, 8, device=d).long(), torch.randn(2, 8, device=d)), "'gate' has dtype"),
        (lambda d: swiglu(torch.randn(2, 8, device=d), torch.randn(2, 8, device="meta")), "'up' is on meta"),
        (lambda d: swiglu(torch.tensor(1.0, device=d), torch.tensor(1.0, device=d)), "'gate' must have at least"),
        (lambda d: swiglu(torch.randn(2, 8, device=d), None), "'up' must be a torch.Tensor"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        call(device)
