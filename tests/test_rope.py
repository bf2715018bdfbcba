"""RoPE (HF apply_rotary_pos_emb, rotate-half) against the float64 reference: q_embed, k_embed, dq, dk."""

import pytest
from helpers import leaf, model_config
import torch

from tritonspec.ops import _library, rope
from numerics import assert_close, poisoned_allocations
from tritonspec.ops.rope import ROPE, rope_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cos_sin(batch, seq, dim, device, dtype=torch.float32, generic=False):
    """HF-style cos/sin (duplicated halves) from positions; ``generic`` makes the halves differ,
    which checks the backward is the exact transpose and not just the forward with -sin."""
    if generic:
        return (
            torch.randn(batch, seq, dim, device=device).to(dtype),
            torch.randn(batch, seq, dim, device=device).to(dtype),
        )
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    pos = torch.randint(0, 4096, (batch, seq), device=device).float()
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(b, hq, hk, s, d, dtype, device, hf_layout=False):
    if hf_layout:  # proj(x).view(b, s, h, d).transpose(1, 2), as Llama attention passes them
        return (
            torch.randn(b, s, hq, d, device=device).to(dtype).transpose(1, 2),
            torch.randn(b, s, hk, d, device=device).to(dtype).transpose(1, 2),
        )
    return torch.randn(b, hq, s, d, device=device).to(dtype), torch.randn(b, hk, s, d, device=device).to(dtype)


def _check(q, k, cos, sin, in_place_backward=False):
    ql, kl = leaf(q), leaf(k)
    with poisoned_allocations():
        qo, ko = rope(ql, kl, cos, sin, in_place_backward=in_place_backward)
        dq = torch.randn(qo.shape, device=q.device).to(q.dtype)
        dk = torch.randn(ko.shape, device=q.device).to(q.dtype)
        ((qo * dq).sum() + (ko * dk).sum()).backward()
    q64, k64 = leaf(q.double()), leaf(k.double())
    rq, rk = rope_ref(q64, k64, cos, sin)
    ((rq * dq.double()).sum() + (rk * dk.double()).sum()).backward()
    assert qo.dtype == q.dtype and qo.shape == q.shape and ko.shape == k.shape
    assert_close(qo, rq, "q_embed")
    assert_close(ko, rk, "k_embed")
    assert_close(ql.grad, q64.grad, "dq")
    assert_close(kl.grad, k64.grad, "dk")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b, hq, hk, s, d, cos_batch",
    [
        (2, 4, 2, 5, 16, 1),  # GQA, cos/sin broadcast over the batch
        (1, 3, 3, 7, 24, 1),  # head_dim/2 = 12 is not a power of two
        (3, 2, 1, 9, 8, 3),  # MQA, per-batch positions
        (1, 1, 1, 1, 2, 1),  # the smallest shape
        (1, 5, 3, 1, 128, 1),  # decode: the heads spread over programs (two at a time), k's over fewer
        (2, 7, 1, 2, 128, 2),  # decode, batch 2, MQA
    ],
)
def test_rope_matches_reference(b, hq, hk, s, d, cos_batch, dtype, device):
    torch.manual_seed(hash((b, hq, hk, s, d, str(dtype))) % 2**31)
    _check(*_qk(b, hq, hk, s, d, dtype, device), *_cos_sin(cos_batch, s, d, device, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_hf_layout_and_generic_cos_sin(dtype, device):
    _check(*_qk(2, 4, 2, 6, 16, dtype, device, hf_layout=True), *_cos_sin(2, 6, 16, device, dtype, generic=True))


def test_rope_float32_cos_sin_with_bf16_q(device):
    _check(*_qk(1, 2, 1, 5, 16, torch.bfloat16, device), *_cos_sin(1, 5, 16, device, torch.float32))


def test_rope_in_place_backward(device):
    q, k = _qk(2, 4, 2, 5, 16, torch.float32, device, hf_layout=True)
    cos, sin = _cos_sin(1, 5, 16, device)
    _check(q, k, cos, sin, in_place_backward=True)
    ql, kl = leaf(q), leaf(k)
    qo, ko = rope(ql, kl, cos, sin, in_place_backward=True)
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    dq0 = dq.clone()
    torch.autograd.backward((qo, ko), (dq, dk))
    # the incoming gradients' storage now holds dq/dk, and the leaves adopted it without a copy
    assert not torch.equal(dq, dq0) and torch.equal(ql.grad, dq) and torch.equal(kl.grad, dk)
    assert ql.grad.data_ptr() == dq.data_ptr() and kl.grad.data_ptr() == dk.data_ptr()


def test_rope_only_one_output_used(device):
    q, k = _qk(1, 2, 2, 3, 8, torch.float32, device)
    cos, sin = _cos_sin(1, 3, 8, device)
    ql, kl = leaf(q), leaf(k)
    qo, _ = rope(ql, kl, cos, sin)
    dq = torch.randn_like(qo)
    qo.backward(dq)
    q64 = leaf(q.double())
    (rope_ref(q64, k.double(), cos, sin)[0] * dq.double()).sum().backward()
    assert_close(ql.grad, q64.grad, "dq")
    assert kl.grad is None or torch.count_nonzero(kl.grad) == 0


def test_rope_matches_hf_apply_rotary_pos_emb(device):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    cfg = model_config("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    rotary = modeling.LlamaRotaryEmbedding(cfg).to(device)
    q, k = _qk(2, 4, 2, 6, 16, torch.float32, device, hf_layout=True)
    cos, sin = rotary(q, torch.arange(6, device=device)[None].expand(2, 6))
    ref_q, ref_k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    qo, ko = rope(q, k, cos, sin)
    assert_close(qo, ref_q, "q_embed vs HF")
    assert_close(ko, ref_k, "k_embed vs HF")


def test_library_op_path_in_eager(monkeypatch, device):
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    _check(*_qk(2, 4, 2, 5, 16, torch.float32, device, hf_layout=True), *_cos_sin(1, 5, 16, device))


def test_torch_compile_fullgraph(device):
    q, k = _qk(2, 4, 2, 5, 16, torch.float32, device, hf_layout=True)
    cos, sin = _cos_sin(2, 5, 16, device)
    ql, kl = leaf(q), leaf(k)

    def f(q, k):
        qo, ko = rope(q, k, cos, sin)
        return qo.sum(1) + ko.sum(1)

    out = torch.compile(f, fullgraph=True)(ql, kl)
    dy = torch.randn_like(out)
    out.backward(dy)
    q64, k64 = leaf(q.double()), leaf(k.double())
    rq, rk = rope_ref(q64, k64, cos, sin)
    ref = rq.sum(1) + rk.sum(1)
    ref.backward(dy.double())
    assert_close(out, ref, "out")
    assert_close(ql.grad, q64.grad, "dq")
    assert_close(kl.grad, k64.grad, "dk")


def test_opcheck(device):
    q, k = _qk(2, 4, 2, 5, 16, torch.float32, device, hf_layout=True)
    cos, sin = _cos_sin(1, 5, 16, device)
    torch.library.opcheck(ROPE.forward_op, (leaf(q), leaf(k), cos, sin))
    torch.library.opcheck(ROPE.backward_op, (torch.randn_like(q), torch.randn_like(k), cos, sin))


def _bad(
    device,
    q=(2, 4, 5, 16),
    k=(2, 2, 5, 16),
    cs=(1, 5, 16),
    qdtype=torch.float32,
    kdtype=torch.float32,
    sin_shape=None,
    cos_grad=False,
):
    cos = torch.randn(cs, device=device, requires_grad=cos_grad)
    return rope(
        torch.randn(q, device=device, dtype=qdtype),
        torch.randn(k, device=device, dtype=kdtype),
        cos,
        torch.randn(sin_shape or cs, device=device),
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q=(2, 5, 16)), "'q' must have 4 dimensions"),
        (dict(k=(2, 2, 6, 16)), "'k' has shape"),
        (dict(k=(3, 2, 5, 16)), "'k' has shape"),
        (dict(q=(2, 4, 5, 15), k=(2, 2, 5, 15), cs=(1, 5, 15)), "head_dim 15"),
        (dict(cs=(1, 4, 16)), "'cos' has shape"),
        (dict(cs=(3, 5, 16)), "'cos' has shape"),
        (dict(cs=(5, 16)), "'cos' must have 3 dimensions"),
        (dict(sin_shape=(2, 5, 16)), "'sin' has shape"),
        (dict(kdtype=torch.float16), "'k' has dtype"),
        (dict(qdtype=torch.float64, kdtype=torch.float64), "'q' has dtype"),
        (dict(cos_grad=True), "'cos'/'sin' require grad"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        _bad(device, **kwargs)
