"""RMSNorm and fused residual-add + RMSNorm, forward and backward in Triton (Llama semantics).

``y = weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``, computed in float32 and rounded to the
input dtype before the weight multiply exactly where ``LlamaRMSNorm`` rounds; the output dtype is
``torch.promote_types(x.dtype, weight.dtype)``, as in Hugging Face. ``add_rms_norm`` first forms
``new_residual = x + residual`` (rounded to the input dtype, like ``residual + hidden_states`` in
a decoder layer) and normalizes that.

Layers: ``_rms_norm_*_kernel`` (jit) -> ``rms_norm_forward`` / ``rms_norm_backward`` (launchers)
-> the ``RMS_NORM`` / ``ADD_RMS_NORM`` ops (eager autograd, and ``tritonspec::*rms_norm*`` for
torch.compile) -> ``rms_norm`` / ``add_rms_norm`` -> ``tritonspec.nn.RMSNorm``.

Rows up to ``MAX_FUSED_N`` elements stay in registers (one read of x); longer rows loop over
``BLOCK_N`` chunks (two reads), so any hidden size works. dW is a two-stage reduction: a
persistent grid of about ``programs_per_unit`` programs per SM each sums its rows into one fp32
partial row, then a small kernel sums the partials.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..kernel_table import RMSNormBackward, RMSNormForward
from ..launch import launch_config
from ._checks import (
    check_eps,
    check_same_device,
    check_same_dtype,
    check_same_shape,
    check_tensor,
    rows_of,
    unit_last_stride,
)
from ..devices import compute_units
from ._library import Op, PlanCache, cdiv, launch, next_pow2

# Row elements kept in registers: 16384 bf16 = 32 KB per row over 16 warps is ~32 fp32 values per
# thread per live array; the backward keeps four (x, dy, w, dw partial), which still fits.
MAX_FUSED_N = 16384


# ----------------------------------------------------------------------------------------------
# float64 references (shared by tests and benchmarks)
# ----------------------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm in float64, differentiable: the definition of correct for outputs and gradients."""
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """``(rms_norm_ref(x + residual), x + residual)`` in float64."""
    s = x.double() + residual.double()
    return rms_norm_ref(s, weight, eps), s


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _input_block(
    x_ptr,
    stride_x,
    residual_ptr,
    stride_residual,
    new_residual_ptr,
    stride_new_residual,
    rows,
    c,
    mask,
    in_ty,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
):
    """A block of x (or of x + residual, rounded to the input dtype as a decoder layer rounds it);
    STORE_RESIDUAL also writes that sum, the new residual."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_residual + c[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)
        if STORE_RESIDUAL:
            tl.store(new_residual_ptr + rows[:, None] * stride_new_residual + c[None, :], x, mask=mask)
    return x


@triton.jit
def _rms_norm_fwd_kernel(
    # Pointers
    x_ptr,
    residual_ptr,  # read only when HAS_RESIDUAL
    new_residual_ptr,  # x + residual, written only when HAS_RESIDUAL
    y_ptr,
    weight_ptr,
    rstd_ptr,
    # Sizes
    M,
    N,
    # Strides (of rows; columns are contiguous)
    stride_x,
    stride_residual,
    stride_new_residual,
    stride_y,
    # Scalars
    eps,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LOOPED: tl.constexpr,  # rows longer than BLOCK_N: two passes over BLOCK_N chunks
):
    """BLOCK_M rows per program; rstd is kept for the backward."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    in_ty = x_ptr.dtype.element_ty
    if not LOOPED:
        mask = row_ok[:, None] & (cols < N)[None, :]
        x = _input_block(
            x_ptr,
            stride_x,
            residual_ptr,
            stride_residual,
            new_residual_ptr,
            stride_new_residual,
            rows,
            cols,
            mask,
            in_ty,
            HAS_RESIDUAL,
            True,
        )
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        xn = (xf * rstd[:, None]).to(in_ty).to(tl.float32)
        tl.store(
            y_ptr + rows[:, None] * stride_y + cols[None, :], (xn * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask
        )
    else:
        # Pass 1: sum of squares (and the new residual); pass 2 re-reads the inputs rather than the new
        # residual, so no program ever loads what it just stored.
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = _input_block(
                x_ptr,
                stride_x,
                residual_ptr,
                stride_residual,
                new_residual_ptr,
                stride_new_residual,
                rows,
                c,
                mask,
                in_ty,
                HAS_RESIDUAL,
                True,
            )
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = _input_block(
                x_ptr,
                stride_x,
                residual_ptr,
                stride_residual,
                new_residual_ptr,
                stride_new_residual,
                rows,
                c,
                mask,
                in_ty,
                HAS_RESIDUAL,
                False,
            )
            w = tl.load(weight_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            xn = (x.to(tl.float32) * rstd[:, None]).to(in_ty).to(tl.float32)
            tl.store(
                y_ptr + rows[:, None] * stride_y + c[None, :], (xn * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask
            )


@triton.jit
def _rms_norm_bwd_kernel(
    # Pointers
    dy_ptr,
    x_ptr,  # the normalized input (the new residual for add_rms_norm)
    weight_ptr,
    rstd_ptr,
    dres_ptr,  # the new residual's gradient, added to dx when HAS_DRES
    dx_ptr,  # may alias dy_ptr (in-place backward)
    dw_part_ptr,  # (programs, N) float32: one dW partial row per program
    # Sizes
    M,
    N,
    # Strides (of rows; columns are contiguous)
    stride_dy,
    stride_x,
    stride_dres,
    stride_dx,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_DRES: tl.constexpr,
    LOOPED: tl.constexpr,  # rows longer than BLOCK_N: two passes over BLOCK_N chunks
):
    """Persistent: program p handles row blocks p, p + P, ...; writes its dW partial to row p of dw_part.

    dx = rstd * (dy*w - xhat * mean(dy*w*xhat)) (+ dres); dW partial = sum over rows of dy * xhat,
    with xhat rounded to the input dtype as the forward used it. dx may alias dy: every element is
    read before the same program writes it.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    in_ty = x_ptr.dtype.element_ty
    num_row_blocks = tl.cdiv(M, BLOCK_M)
    if not LOOPED:
        col_ok = cols < N
        w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for rb in range(pid, num_row_blocks, nprog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            rows = rows.to(tl.int64)
            mask = row_ok[:, None] & col_ok[None, :]
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            xhat = x * rstd[:, None]
            dw_acc += dy * xhat.to(in_ty).to(tl.float32)
            dxhat = dy * w[None, :]
            c = tl.sum(dxhat * xhat, axis=1) / N
            dx = (dxhat - xhat * c[:, None]) * rstd[:, None]
            if HAS_DRES:
                dx += tl.load(dres_ptr + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
            tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_part_ptr + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    else:
        # dw_part starts zeroed; only this program touches its row, with the same layout each time.
        for rb in range(pid, num_row_blocks, nprog):
            rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            rows = rows.to(tl.int64)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for n0 in range(0, N, BLOCK_N):
                c_ = n0 + cols
                mask = row_ok[:, None] & (c_ < N)[None, :]
                dy = tl.load(dy_ptr + rows[:, None] * stride_dy + c_[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + rows[:, None] * stride_x + c_[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(weight_ptr + c_, mask=c_ < N, other=0.0).to(tl.float32)
                acc += dy * w[None, :] * x
            c = tl.sum(acc, axis=1) * rstd / N
            for n0 in range(0, N, BLOCK_N):
                c_ = n0 + cols
                col_ok = c_ < N
                mask = row_ok[:, None] & col_ok[None, :]
                dy = tl.load(dy_ptr + rows[:, None] * stride_dy + c_[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_ptr + rows[:, None] * stride_x + c_[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(weight_ptr + c_, mask=col_ok, other=0.0).to(tl.float32)
                xhat = x * rstd[:, None]
                dx = (dy * w[None, :] - xhat * c[:, None]) * rstd[:, None]
                if HAS_DRES:
                    dx += tl.load(dres_ptr + rows[:, None] * stride_dres + c_[None, :], mask=mask, other=0.0).to(
                        tl.float32
                    )
                tl.store(dx_ptr + rows[:, None] * stride_dx + c_[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
                part = dw_part_ptr + pid.to(tl.int64) * N + c_
                dw = tl.load(part, mask=col_ok, other=0.0)
                tl.store(part, dw + tl.sum(dy * xhat.to(in_ty).to(tl.float32), axis=0), mask=col_ok)


@triton.jit
def _rms_norm_dw_kernel(
    # Pointers
    dw_part_ptr,  # (P, N) float32, contiguous
    dw_ptr,
    # Sizes
    P,
    N,
    # Meta-parameters
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Second stage of dW: sum the P fp32 partial rows, one column block per program."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & col_ok[None, :]
        acc += tl.load(dw_part_ptr + p.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_ok)


# ----------------------------------------------------------------------------------------------
# launch parameters (the backend's spec may override any field through launch_config)
# ----------------------------------------------------------------------------------------------
def _fwd_default(n: int) -> RMSNormForward:
    # ~4K-element tiles: short rows pack several per program. On the H100, BLOCK_M 1..4 x 4..16 warps
    # all ran within 1% at N=4096 and 8192, except 4 rows at 4 warps, N=8192 (+10%).
    block_n = min(next_pow2(n), MAX_FUSED_N)
    block_m = max(1, min(16, 4096 // block_n))
    return RMSNormForward(BLOCK_N=block_n, BLOCK_M=block_m, num_warps=min(16, max(4, block_m * block_n // 512)))


def _bwd_default(n: int) -> RMSNormBackward:
    # H100 sweeps of the backward kernel. Rows of 4096 and longer: one program per SM on
    # ~16K-element row blocks (4 rows at N=4096, 2 at 8192) ran at 88% of copy bandwidth against
    # 82% / 81% for two programs per SM, and halves the fp32 dW partials. Shorter rows keep the
    # earlier tuning: two programs per SM and ~2K-element blocks.
    block_n = min(next_pow2(n), MAX_FUSED_N)
    if block_n >= 4096:
        return RMSNormBackward(
            BLOCK_N=block_n, BLOCK_M=max(1, 16384 // block_n), num_warps=min(16, block_n // 512), programs_per_unit=1
        )
    block_m = max(1, min(16, 2048 // block_n))
    return RMSNormBackward(
        BLOCK_N=block_n, BLOCK_M=block_m, num_warps=min(16, max(4, block_m * block_n // 256)), programs_per_unit=2
    )


# ----------------------------------------------------------------------------------------------
# launchers: (..., N) tensors in (rows of any stride with a unit column stride; see rows_of), fresh
# contiguous tensors of the same shape out
# ----------------------------------------------------------------------------------------------
# Eager LaunchPlans (see _launch_cache): a repeated call with the same shapes, dtypes and eps
# relaunches the compiled kernels directly. Only contiguous tensors are planned, so their row
# strides follow from the shape. The launches pass their arguments by name, which costs the cached
# launcher a reordering: on a plan miss only, never on the hot path.
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *, traced: bool = False
):
    """Returns ``(y, new_residual or None, rstd)``; ``y`` has dtype promote(x, weight), rstd is (...,) fp32."""
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    m = rstd.numel()
    if m == 0:
        return y, s, rstd
    r = x if residual is None else residual
    key = None
    if not traced and x.is_contiguous() and r.is_contiguous():
        key = (x.shape, x.dtype, weight.dtype, residual is None, eps, x.device)
        plan = _FWD_PLANS.get(key)
        if plan is not None and plan(x, r, y if s is None else s, y, weight, rstd):
            return y, s, rstd
    x2, sx = rows_of(x)
    n_ = int(n)  # a hidden size symbolic under torch.compile is specialized
    cfg = launch_config(RMSNormForward, x.device, lambda: _fwd_default(n_), N=n_, dtype=str(x.dtype))
    block_n = cfg.BLOCK_N
    r2, sr = rows_of(r)
    grid = (cdiv(m, cfg.BLOCK_M),)
    # Without a residual, x and y stand in for residual_ptr and new_residual_ptr, which the kernel then never
    # touches; y and s are contiguous (row stride n).
    plan = launch(
        _rms_norm_fwd_kernel,
        grid,
        x_ptr=x2,
        residual_ptr=r2,
        new_residual_ptr=y if s is None else s,
        y_ptr=y,
        weight_ptr=weight,
        rstd_ptr=rstd,
        M=m,
        N=n,
        stride_x=sx,
        stride_residual=sr,
        stride_new_residual=n,
        stride_y=n,
        eps=eps,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=block_n,
        HAS_RESIDUAL=residual is not None,
        LOOPED=block_n < n_,
        **cfg.options,
        traced=traced,
        plan=key is not None,
    )
    if plan is not None:
        _FWD_PLANS[key] = plan
    return y, s, rstd


def _launch_dw_reduce(dw_part, dw, programs, n, *, traced: bool = False, plan: bool = False):
    """dw = the column sums of the (programs, n) fp32 partials; returns launch()'s plan."""
    red_n = min(256, next_pow2(int(n)))
    return launch(
        _rms_norm_dw_kernel,
        (cdiv(n, red_n),),
        dw_part_ptr=dw_part,
        dw_ptr=dw,
        P=programs,
        N=n,
        BLOCK_P=min(32, next_pow2(programs)),
        BLOCK_N=red_n,
        num_warps=4,
        traced=traced,
        plan=plan,
    )


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dres: torch.Tensor | None = None,
    *,
    in_place: bool = False,
    traced: bool = False,
):
    """Returns ``(dx, dweight)``; ``x`` is the normalized input (the new residual for add_rms_norm).

    ``in_place=True`` writes dx into ``dy`` (saves one activation; dy must be contiguous, of x's dtype).
    """
    n = x.shape[-1]
    dx = dy if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    m = rstd.numel()
    if m == 0:
        return dx, torch.zeros_like(weight)
    d = dy if dres is None else dres
    key = None
    if not traced and x.is_contiguous() and dy.is_contiguous() and d.is_contiguous():
        key = (x.shape, x.dtype, dy.dtype, d.dtype, weight.dtype, dres is None, in_place, x.device)
        hit = _BWD_PLANS.get(key)
        if hit is not None:
            main, reduce, programs, alloc = hit
            dw_part = alloc((programs, n), dtype=torch.float32, device=x.device)
            if main(dy, x, weight, rstd, d, dx, dw_part):
                dw = torch.empty_like(weight)
                if not reduce(dw_part, dw):
                    # the main kernel has run (in place, dy now holds dx): never run it again
                    _launch_dw_reduce(dw_part, dw, programs, n)
                return dx, dw
    (x2, sx), (dy2, sdy) = rows_of(x), rows_of(dy)
    d2, sd = rows_of(d)
    n_ = int(n)
    cfg = launch_config(RMSNormBackward, x.device, lambda: _bwd_default(n_), N=n_, dtype=str(x.dtype))
    block_n = cfg.BLOCK_N
    looped = block_n < n_
    programs = compute_units(x.device) * cfg.programs_per_unit
    if isinstance(m, int):  # not while torch.compile traces a symbolic row count
        programs = max(1, min(programs, cdiv(m, cfg.BLOCK_M)))
    alloc = torch.zeros if looped else torch.empty
    dw_part = alloc((programs, n), dtype=torch.float32, device=x.device)
    grid = (programs,)
    # Without dres, dy stands in for dres_ptr, which the kernel then never reads; dx is contiguous.
    main = launch(
        _rms_norm_bwd_kernel,
        grid,
        dy_ptr=dy2,
        x_ptr=x2,
        weight_ptr=weight,
        rstd_ptr=rstd,
        dres_ptr=d2,
        dx_ptr=dx,
        dw_part_ptr=dw_part,
        M=m,
        N=n,
        stride_dy=sdy,
        stride_x=sx,
        stride_dres=sd,
        stride_dx=n,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=block_n,
        HAS_DRES=dres is not None,
        LOOPED=looped,
        **cfg.options,
        traced=traced,
        plan=key is not None,
    )
    dw = torch.empty_like(weight)  # after the main launch: the GPU starts sooner
    reduce = _launch_dw_reduce(dw_part, dw, programs, n, traced=traced, plan=key is not None)
    if main is not None and reduce is not None:
        _BWD_PLANS[key] = (main, reduce, programs, alloc)
    return dx, dw


# ----------------------------------------------------------------------------------------------
# the ops (eager autograd and the torch.library ops, from one declaration)
# ----------------------------------------------------------------------------------------------
def _backward(dy, ds, xs, weight, rstd, *, in_place: bool, traced: bool):
    """``(dx, dweight)`` for both ops; ``xs`` is the normalized input, ``ds`` the new residual's gradient (None
    for rms_norm). With ``in_place`` the gradient of the output becomes dx (dy must be contiguous and of the
    input's dtype)."""
    if dy is None:  # add_rms_norm whose normalized output was not used
        dy = torch.zeros(xs.shape, dtype=xs.dtype, device=xs.device)
    in_place = in_place and dy.dtype == xs.dtype and dy.is_contiguous()
    dx, dw = rms_norm_backward(dy, xs, weight, rstd, ds, in_place=in_place, traced=traced)
    if in_place:
        torch.autograd.graph.increment_version(dy)
        dx = dx.view_as(dx)  # a fresh alias, so a leaf adopts the buffer instead of copying it
    return dx, dw


def _out_fake(x, weight):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _rstd_fake(x):
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


# rms_norm: (y, rstd); the backward saves x, weight and rstd.
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, rstd = rms_norm_forward(x, weight, eps, traced=traced)
    return y, rstd


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _out_fake(x, weight), _rstd_fake(x)


def _rms_norm_save(inputs: tuple, outputs: tuple) -> tuple:
    (x, weight, _), (_, rstd) = inputs, outputs
    return x, weight, rstd


def _rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *, in_place: bool, traced: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, None, x, weight, rstd, in_place=in_place, traced=traced)


def _rms_norm_backward_fake(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), torch.empty_like(weight)


RMS_NORM = Op(
    "rms_norm",
    forward=_rms_norm,
    fake=_rms_norm_fake,
    save=_rms_norm_save,
    backward=_rms_norm_backward,
    backward_fake=_rms_norm_backward_fake,
    grads=(0, 1, None),
)


# add_rms_norm: (y, new residual s, rstd); the backward saves s (the normalized input), weight and rstd. Either
# visible output may go unused, so both gradients are optional.
def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, traced: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rms_norm_forward(x, weight, eps, residual, traced=traced)


def _add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _out_fake(x, weight), x.new_empty(x.shape), _rstd_fake(x)


def _add_rms_norm_save(inputs: tuple, outputs: tuple) -> tuple:
    (_, _, weight, _), (_, s, rstd) = inputs, outputs
    return s, weight, rstd


def _add_rms_norm_backward(
    dy: Optional[torch.Tensor],
    ds: Optional[torch.Tensor],
    s: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    in_place: bool,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, ds, s, weight, rstd, in_place=in_place, traced=traced)


def _add_rms_norm_backward_fake(
    dy: Optional[torch.Tensor], ds: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return s.new_empty(s.shape), torch.empty_like(weight)


ADD_RMS_NORM = Op(
    "add_rms_norm",
    forward=_add_rms_norm,
    fake=_add_rms_norm_fake,
    save=_add_rms_norm_save,
    backward=_add_rms_norm_backward,
    backward_fake=_add_rms_norm_backward_fake,
    grads=(0, 0, 1, None),
    visible=2,
)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def _check(op: str, x, weight, eps, residual=None) -> float:
    check_tensor(op, "x", x)
    check_tensor(op, "weight", weight, ndim=1)
    if residual is not None:
        check_tensor(op, "residual", residual)
        check_same_device(op, x=x, residual=residual, weight=weight)
        check_same_dtype(op, x=x, residual=residual)
        check_same_shape(op, x=x, residual=residual)
    else:
        check_same_device(op, x=x, weight=weight)
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"{op}: argument 'x' has an empty last (hidden) dimension, shape {tuple(x.shape)}")
    if weight.shape[0] != n:
        raise ValueError(
            f"{op}: argument 'weight' has shape {tuple(weight.shape)} but the hidden size (x.shape[-1]) is {n}"
        )
    return check_eps(op, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, in_place_backward: bool = False):
    """``LlamaRMSNorm`` over the last dim of ``x`` (any leading dims) with a Triton backward.

    Args:
        x: (..., N) float16/bfloat16/float32.
        weight: (N,), any of those dtypes; the output has dtype promote(x.dtype, weight.dtype).
        eps: added to the mean square.
        in_place_backward: write dx into the incoming gradient's storage (as Liger does), saving
            one activation-sized buffer; only for callers whose gradient tensor nobody reads later.
            Ignored under torch.compile.
    Returns: the normalized tensor, shaped like ``x``.
    """
    eps = _check("rms_norm", x, weight, eps)
    weight = unit_last_stride(weight)  # the kernels read weight with unit stride
    return RMS_NORM(x, weight, eps, in_place_backward=in_place_backward)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, in_place_backward: bool = False
):
    """Fused ``new_residual = x + residual; out = rms_norm(new_residual)``; returns ``(out, new_residual)``.

    ``x`` and ``residual`` have the same shape and dtype; gradients of both are the same tensor.
    """
    eps = _check("add_rms_norm", x, weight, eps, residual)
    weight = unit_last_stride(weight)
    return ADD_RMS_NORM(x, residual, weight, eps, in_place_backward=in_place_backward)
