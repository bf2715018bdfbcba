"""Rotary position embedding with Hugging Face ``apply_rotary_pos_emb`` conventions, in Triton.

q: (batch, heads_q, seq, head_dim) and k: (batch, heads_k, seq, head_dim) in any strides whose
last dim is contiguous (HF passes ``proj(x).view(...).transpose(1, 2)``); cos, sin:
(batch or 1, seq, head_dim) as HF's rotary embedding returns them (``unsqueeze_dim=1``).
Rotate-half: ``out = x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x2, x1)``.

One program per (seq block, batch) reads its cos/sin tile once and rotates every head of q and
then k, so cos/sin cost one read instead of one per head. The backward applies the transposed
rotation, ``dx = dy * cos + rotate_half^T(dy * sin)`` -- for HF's duplicated-half cos/sin that is
the forward with -sin. Outputs may alias inputs (each tile is read before it is written).

Layers: ``_rope_kernel`` -> ``rope_forward`` / ``rope_backward`` -> the ``ROPE`` op (eager autograd,
and ``tritonspec::rope_*`` for torch.compile) -> ``rope``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_table import RoPE
from ..launch import launch_config
from ._checks import check_same_device, check_same_dtype, check_tensor, unit_last_stride
from ._library import Op, PlanCache, cdiv, launch, next_pow2


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF ``apply_rotary_pos_emb`` in float64, differentiable: the definition of correct."""
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    q64, k64 = q.double(), k.double()
    return q64 * c + rotate_half(q64) * s, k64 * c + rotate_half(k64) * s


@triton.jit
def _rope_heads(
    x_ptr,
    stride_xb,
    stride_xh,
    stride_xs,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    b,
    s,
    s_ok,
    d,
    d_ok,
    c1,
    c2,
    s1,
    s2,
    H,
    HALF,
    first,
    step,
    BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Rotate this program's heads of one (batch, seq block) tile: BLOCK_H heads from head ``first``, then
    every ``step`` heads."""
    for h0 in range(first, H, step):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < H)[:, None, None] & s_ok[None, :, None] & d_ok[None, None, :]
        h = h.to(tl.int64)[:, None, None]
        xo = x_ptr + b * stride_xb + h * stride_xh + s[None, :, None] * stride_xs + d[None, None, :]
        x1 = tl.load(xo, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xo + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # transpose of [[c1, -s1], [s2, c2]]
            o1 = x1 * c1[None, :, :] + x2 * s2[None, :, :]
            o2 = x2 * c2[None, :, :] - x1 * s1[None, :, :]
        else:
            o1 = x1 * c1[None, :, :] - x2 * s1[None, :, :]
            o2 = x2 * c2[None, :, :] + x1 * s2[None, :, :]
        oo = out_ptr + b * stride_ob + h * stride_oh + s[None, :, None] * stride_os + d[None, None, :]
        tl.store(oo, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(oo + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    # Pointers
    q_ptr,
    k_ptr,
    q_out_ptr,  # may alias q_ptr (in-place backward)
    k_out_ptr,  # may alias k_ptr
    cos_ptr,
    sin_ptr,
    # Sizes
    HQ,  # heads of q
    HK,  # heads of k
    S,  # sequence length
    HALF,  # head_dim // 2
    # Strides (the head_dim stride is 1)
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_qob,
    stride_qoh,
    stride_qos,
    stride_kob,
    stride_koh,
    stride_kos,
    stride_cb,  # 0: one cos row per position, broadcast over the batch
    stride_cs,
    stride_sb,
    stride_ss,
    # Meta-parameters
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """One program per (seq block, batch, head group): its cos/sin tile is read once and rotates the group's heads
    of q, then of k. Head groups (the third grid axis; usually 1) give short sequences (decode) programs enough."""
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    group, groups = tl.program_id(2), tl.num_programs(2)
    b = tl.program_id(1).to(tl.int64)
    s_ok = s < S
    s = s.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    mask = s_ok[:, None] & d_ok[None, :]
    co = cos_ptr + b * stride_cb + s[:, None] * stride_cs + d[None, :]
    so = sin_ptr + b * stride_sb + s[:, None] * stride_ss + d[None, :]
    c1 = tl.load(co, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(co + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(so, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(so + HALF, mask=mask, other=0.0).to(tl.float32)
    _rope_heads(
        q_ptr,
        stride_qb,
        stride_qh,
        stride_qs,
        q_out_ptr,
        stride_qob,
        stride_qoh,
        stride_qos,
        b,
        s,
        s_ok,
        d,
        d_ok,
        c1,
        c2,
        s1,
        s2,
        HQ,
        HALF,
        group * BLOCK_HQ,
        groups * BLOCK_HQ,
        BLOCK_HQ,
        BACKWARD,
    )
    _rope_heads(
        k_ptr,
        stride_kb,
        stride_kh,
        stride_ks,
        k_out_ptr,
        stride_kob,
        stride_koh,
        stride_kos,
        b,
        s,
        s_ok,
        d,
        d_ok,
        c1,
        c2,
        s1,
        s2,
        HK,
        HALF,
        group * BLOCK_HK,
        groups * BLOCK_HK,
        BLOCK_HK,
        BACKWARD,
    )


def _default(hq: int, hk: int, half: int) -> RoPE:
    # H100 sweep, q 4x32x4096x128 and 1x64x8192x128, k 8 heads: 16 positions x
    # 2 heads x 64 per half-tile at 8 warps led both (92.3% / 91.7% of copy bandwidth) against
    # 8 positions x 4 heads (90.8% / 89.5%); ~2K elements per half-tile either way.
    block_d = next_pow2(half)
    block_s = max(1, min(16, 1024 // block_d))
    tile_heads = max(1, 2048 // (block_s * block_d))  # ~2K elements per half tile
    return RoPE(
        BLOCK_S=block_s, BLOCK_HQ=min(next_pow2(hq), tile_heads), BLOCK_HK=min(next_pow2(hk), tile_heads), num_warps=8
    )


_FEW_TILES = 64

# Eager LaunchPlans (see _launch_cache), keyed by every shape and stride the launch passes. The launch
# passes its arguments by name, which costs the cached launcher a reordering: on a plan miss only.
_PLANS = PlanCache()


def _launch(q, k, qo, ko, cos, sin, backward: bool, traced: bool):
    if q.numel() == 0 and k.numel() == 0:
        return
    key = None
    if not traced:
        key = (
            q.shape,
            q.stride(),
            k.shape,
            k.stride(),
            qo.stride(),
            ko.stride(),
            cos.shape,
            cos.stride(),
            sin.stride(),
            q.dtype,
            cos.dtype,
            backward,
            q.device,
        )
        plan = _PLANS.get(key)
        if plan is not None and plan(q, k, qo, ko, cos, sin):
            return
    b, hq, s, d = q.shape
    hk = k.shape[1]
    hq, hk, half = int(hq), int(hk), int(d) // 2  # specialized if torch.compile made them symbolic
    cfg = launch_config(
        RoPE, q.device, lambda: _default(hq, hk, half), heads_q=hq, heads_k=hk, head_dim=2 * half, dtype=str(q.dtype)
    )
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)  # (1, seq, dim) broadcasts over the batch
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    tiles = cdiv(s, cfg.BLOCK_S) * b
    # few (seq block, batch) tiles (decode): their heads spread over up to _FEW_TILES programs
    groups = 1 if tiles >= _FEW_TILES else min(cdiv(max(hq, hk), cfg.BLOCK_HQ), _FEW_TILES // tiles)
    grid = (cdiv(s, cfg.BLOCK_S), b, groups)
    plan = launch(
        _rope_kernel,
        grid,
        q_ptr=q,
        k_ptr=k,
        q_out_ptr=qo,
        k_out_ptr=ko,
        cos_ptr=cos,
        sin_ptr=sin,
        HQ=hq,
        HK=hk,
        S=s,
        HALF=half,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qs=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_ks=k.stride(2),
        stride_qob=qo.stride(0),
        stride_qoh=qo.stride(1),
        stride_qos=qo.stride(2),
        stride_kob=ko.stride(0),
        stride_koh=ko.stride(1),
        stride_kos=ko.stride(2),
        stride_cb=cb,
        stride_cs=cos.stride(1),
        stride_sb=sb,
        stride_ss=sin.stride(1),
        BLOCK_HQ=cfg.BLOCK_HQ,
        BLOCK_HK=cfg.BLOCK_HK,
        BLOCK_S=cfg.BLOCK_S,
        BLOCK_D=next_pow2(half),
        BACKWARD=backward,
        **cfg.options,
        traced=traced,
        plan=key is not None,
    )
    if plan is not None:
        _PLANS[key] = plan


def rope_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_embed, k_embed)``, laid out like ``q`` and ``k``."""
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    _launch(q, k, qo, ko, cos, sin, False, traced)
    return qo, ko


def rope_backward(dq, dk, cos, sin, *, in_place: bool = False, traced: bool = False):
    """``(dq, dk)`` from the output gradients; ``in_place=True`` overwrites the output gradients."""
    gq, gk = (dq, dk) if in_place else (torch.empty_like(dq), torch.empty_like(dk))
    _launch(dq, dk, gq, gk, cos, sin, True, traced)
    return gq, gk


def _writable(t: torch.Tensor) -> bool:
    """Dense without overlap in the two layouts HF produces, so an in-place gradient is safe."""
    return t.is_contiguous() or t.transpose(1, 2).is_contiguous()


def _rope_fake(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


def _save(inputs: tuple, outputs: tuple) -> tuple:
    """cos and sin: the backward is the transposed rotation, which needs nothing else."""
    return inputs[2:]


def _backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, in_place: bool, traced: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)``: the transposed rotation; with ``in_place`` it overwrites the output gradients. On the eager
    path an unused output's gradient is None (the library op always gets both)."""
    if dq is None or dk is None:  # an unused output (rare: attention consumes both): rotate the other alone
        g = unit_last_stride(dq if dq is not None else dk)
        gg, _ = rope_backward(g, g[:, :0], cos, sin, traced=traced)
        return (gg, None) if dq is not None else (None, gg)
    dq, dk = unit_last_stride(dq), unit_last_stride(dk)
    in_place = in_place and _writable(dq) and _writable(dk)
    gq, gk = rope_backward(dq, dk, cos, sin, in_place=in_place, traced=traced)
    if in_place:
        torch.autograd.graph.increment_version(dq)
        torch.autograd.graph.increment_version(dk)
        gq, gk = gq.view_as(gq), gk.view_as(gk)  # fresh aliases, so a leaf adopts them uncopied
    return gq, gk


def _backward_fake(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(dq), torch.empty_like(dk)


ROPE = Op(
    "rope",
    forward=rope_forward,
    fake=_rope_fake,
    save=_save,
    backward=_backward,
    backward_fake=_backward_fake,
    grads=(0, 1, None, None),
    visible=2,
)


def _check(q, k, cos, sin) -> None:
    op = "rope"
    check_tensor(op, "q", q, ndim=4)
    check_tensor(op, "k", k, ndim=4)
    check_tensor(op, "cos", cos, ndim=3)
    check_tensor(op, "sin", sin, ndim=3)
    check_same_device(op, q=q, k=k, cos=cos, sin=sin)
    check_same_dtype(op, q=q, k=k)
    check_same_dtype(op, cos=cos, sin=sin)
    b, _, s, d = q.shape
    if d % 2 or d == 0:
        raise ValueError(f"rope: argument 'q' has head_dim {d}; rotate-half needs an even, nonzero one")
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"rope: argument 'k' has shape {tuple(k.shape)}; expected (batch={b}, heads, seq={s}, "
            f"head_dim={d}) to match 'q' {tuple(q.shape)}"
        )
    if cos.shape != sin.shape:
        raise ValueError(f"rope: argument 'sin' has shape {tuple(sin.shape)} but 'cos' has {tuple(cos.shape)}")
    if cos.shape[0] not in (1, b) or cos.shape[1:] != (s, d):
        raise ValueError(
            f"rope: argument 'cos' has shape {tuple(cos.shape)}; expected ({b} or 1, {s}, {d}) = "
            "(batch, seq, head_dim) as HF's rotary embedding returns it"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "rope: arguments 'cos'/'sin' require grad, but rope gives them no gradient; "
            "detach them (HF computes them under no_grad)"
        )


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, in_place_backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``) with a Triton backward.

    Outputs have q's dtype (cos/sin may be any supported float dtype; math is float32).
    ``in_place_backward=True`` writes dq/dk into the incoming gradients' storage (as Liger does);
    only for callers whose gradients nobody reads later. Ignored under torch.compile.
    """
    _check(q, k, cos, sin)
    q, k, cos, sin = (unit_last_stride(t) for t in (q, k, cos, sin))
    return ROPE(q, k, cos, sin, in_place_backward=in_place_backward)
