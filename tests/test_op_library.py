"""Op declarations: the torch.library schemas come from the annotated forward and backward, and a
declaration that cannot give one is refused with an error naming the op and the parameter."""

from typing import Optional

import pytest
import torch

from tritonspec.ops._library import Op


def _forward(x: torch.Tensor, bias: Optional[torch.Tensor], scale: float, *, traced: bool) -> torch.Tensor:
    return x * scale if bias is None else x * scale + bias


def _fake(x, bias, scale):
    return torch.empty_like(x)


def _backward(dy: torch.Tensor, scale: float, *, in_place: bool, traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return dy * scale, dy.clone()


def _backward_fake(dy, scale):
    return torch.empty_like(dy), torch.empty_like(dy)


def _op(name, **changes):
    declared = dict(
        forward=_forward,
        fake=_fake,
        save=lambda inputs, outputs: (),
        backward=_backward,
        backward_fake=_backward_fake,
        grads=(0, 1, None),
        statics=(2,),
    )
    return Op(name, **{**declared, **changes})


def test_schemas_come_from_the_annotations():
    op = _op("test_scale_add")
    assert str(op.forward_op._opoverload._schema) == (
        "tritonspec::test_scale_add_fwd(Tensor x, Tensor? bias, float scale) -> Tensor"
    )
    assert str(op.backward_op._opoverload._schema) == (
        "tritonspec::test_scale_add_bwd(Tensor dy, float scale) -> (Tensor, Tensor)"
    )
    x, bias = torch.randn(5, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64)
    scale = float(torch.rand(()) + 0.5)
    for b in (bias.requires_grad_(), None):
        out = op(x, b, scale)
        torch.testing.assert_close(out, x * scale if b is None else x * scale + b, rtol=0, atol=0)
        dy = torch.randn(5, dtype=torch.float64)
        grads = torch.autograd.grad(out, (x, b) if b is not None else (x,), dy)
        torch.testing.assert_close(grads[0], dy * scale, rtol=0, atol=0)
        if b is not None:
            torch.testing.assert_close(grads[1], dy, rtol=0, atol=0)


def test_a_forward_without_annotations_is_refused():
    def forward(x, *, traced):
        return x

    with pytest.raises(TypeError, match="Op 'test_bad1': forward: parameter 'x' needs a type annotation"):
        _op("test_bad1", forward=forward, fake=lambda x: x)


def test_a_missing_return_annotation_is_refused():
    def backward(dy: torch.Tensor, scale: float, *, in_place: bool, traced: bool):
        return dy, dy

    with pytest.raises(TypeError, match="Op 'test_bad2': backward: needs a return annotation"):
        _op("test_bad2", backward=backward)


def test_a_fake_taking_other_parameters_is_refused():
    with pytest.raises(TypeError, match=r"Op 'test_bad3': fake: takes \(x, scale\), expected \(x, bias, scale\)"):
        _op("test_bad3", fake=lambda x, scale: x)
