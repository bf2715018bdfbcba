"""SwiGLU activation ``silu(gate) * up``, forward and backward in Triton (LlamaMLP semantics).

As in ``act_fn(gate_proj(x)) * up_proj(x)``, silu is computed in float32 and rounded to the input
dtype before the multiply; the backward works in float32 throughout.

Elementwise and memory bound: contiguous inputs run as one flat row; row-strided inputs (e.g. the
two halves of a fused gate_up projection) run as 2-D (rows, N) tiles without a copy. The grid is
1-D (CUDA limits the second grid dim to 65535).

Layers: ``_swiglu_fwd_kernel`` / ``_swiglu_bwd_kernel`` -> ``swiglu_forward`` / ``swiglu_backward``
-> the ``SWIGLU`` op (eager autograd, and ``tritonspec::swiglu_*`` for torch.compile) -> ``swiglu``
-> ``tritonspec.nn.SwiGLUMLP``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_table import SwiGLUBackward, SwiGLUForward
from ..launch import launch_config
from ._checks import as_rows, check_same_device, check_same_dtype, check_same_shape, check_tensor
from ._library import Op, cdiv, launch, next_pow2


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float64, differentiable: the definition of correct."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


@triton.jit
def _swiglu_fwd_kernel(
    # Pointers
    gate_ptr,
    up_ptr,
    y_ptr,
    # Sizes
    M,
    N,
    n_col_blocks,  # column blocks per row block: the 1-D grid walks (row block, column block) pairs
    # Strides
    stride_gate,
    stride_up,
    stride_y,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y = silu(gate) * up over (M, N) rows, one BLOCK_M x BLOCK_N tile per program."""
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (act * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    # Pointers
    dy_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,  # may alias gate_ptr (in-place backward)
    dup_ptr,  # may alias up_ptr
    # Sizes
    M,
    N,
    n_col_blocks,
    # Strides
    stride_dy,
    stride_gate,
    stride_up,
    stride_dgate,
    stride_dup,
    # Meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dgate = dy * up * silu'(gate), dup = dy * silu(gate); each element is read before it is written, so the
    gradients may overwrite gate and up."""
    pid = tl.program_id(0).to(tl.int64)
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = g * sig
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * act.to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dgate_ptr + rows[:, None] * stride_dgate + cols[None, :], dg.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows[:, None] * stride_dup + cols[None, :], du.to(dup_ptr.dtype.element_ty), mask=mask)


def _default(config, n: int, flat: bool):
    """Tile of ~BLOCK elements; a flat (contiguous) problem is one long row whatever its size."""
    # 4K elements per program (8 KB per bf16 tensor): 16 per thread at 8 warps, two 16-byte loads.
    # On the H100, 1K-8K elements and 4 or 8 warps all ran within 2% of the copy bandwidth.
    block = 4096
    block_n = block if flat else min(next_pow2(n), block)
    return config(BLOCK_N=block_n, BLOCK_M=max(1, block // block_n), num_warps=8)


def _config(config, t: torch.Tensor, n, flat: bool):
    n_ = 0 if flat else int(n)  # a flat problem's length never enters the config (nor its cache key)
    return launch_config(config, t.device, lambda: _default(config, n_, flat), flat=flat, N=n_, dtype=str(t.dtype))


def _grid(m, n, cfg):
    n_col_blocks = cdiv(n, cfg.BLOCK_N)
    return (cdiv(m, cfg.BLOCK_M) * n_col_blocks,), n_col_blocks


def _flat(*ts: torch.Tensor) -> bool:
    return all(t.is_contiguous() for t in ts)


def _rows(t: torch.Tensor, flat: bool) -> torch.Tensor:
    return t.view(1, -1) if flat else as_rows(t)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, *, traced: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` as a new contiguous tensor shaped like ``gate``."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    flat = _flat(gate, up)
    g, u, y = _rows(gate, flat), _rows(up, flat), _rows(out, flat)
    m, n = g.shape
    cfg = _config(SwiGLUForward, gate, n, flat)
    grid, n_col_blocks = _grid(m, n, cfg)
    launch(
        _swiglu_fwd_kernel,
        grid,
        gate_ptr=g,
        up_ptr=u,
        y_ptr=y,
        M=m,
        N=n,
        n_col_blocks=n_col_blocks,
        stride_gate=g.stride(0),
        stride_up=u.stride(0),
        stride_y=y.stride(0),
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        **cfg.options,
        traced=traced,
    )
    return out


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, in_place: bool = False, traced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)``; ``in_place=True`` writes them into ``gate`` and ``up`` and returns those."""
    if in_place:
        dg, du = gate, up
    else:
        dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if dg.numel() == 0:
        return dg, du
    flat = _flat(dy, gate, up, dg, du)
    d, g, u, dg2, du2 = (_rows(t, flat) for t in (dy, gate, up, dg, du))
    m, n = g.shape
    cfg = _config(SwiGLUBackward, gate, n, flat)
    grid, n_col_blocks = _grid(m, n, cfg)
    launch(
        _swiglu_bwd_kernel,
        grid,
        dy_ptr=d,
        gate_ptr=g,
        up_ptr=u,
        dgate_ptr=dg2,
        dup_ptr=du2,
        M=m,
        N=n,
        n_col_blocks=n_col_blocks,
        stride_dy=d.stride(0),
        stride_gate=g.stride(0),
        stride_up=u.stride(0),
        stride_dgate=dg2.stride(0),
        stride_dup=du2.stride(0),
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        **cfg.options,
        traced=traced,
    )
    return dg, du


def _swiglu_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate.new_empty(gate.shape)


def _save(inputs: tuple, outputs: tuple) -> tuple:
    """The backward recomputes silu(gate) from the inputs rather than saving the activation."""
    return inputs


def _backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, in_place: bool, traced: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)``; with ``in_place`` they overwrite gate and up (Liger style)."""
    if dy is None:
        dy = torch.zeros(gate.shape, dtype=gate.dtype, device=gate.device)
    in_place = in_place and gate.is_contiguous() and up.is_contiguous()
    dg, du = swiglu_backward(dy, gate, up, in_place=in_place, traced=traced)
    if in_place:  # anything else that saved gate/up now fails loudly instead of reading gradients
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
        # Fresh aliases: a leaf's AccumulateGrad adopts a gradient only when nothing else holds
        # it, and gate/up are held, so returning them would add two activation-sized copies.
        dg, du = dg.view_as(dg), du.view_as(du)
    return dg, du


def _backward_fake(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


SWIGLU = Op(
    "swiglu",
    forward=swiglu_forward,
    fake=_swiglu_fake,
    save=_save,
    backward=_backward,
    backward_fake=_backward_fake,
    grads=(0, 1),
)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, in_place_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (any shape, both the same) with a Triton backward.

    ``in_place_backward=True`` writes the gradients into ``gate``'s and ``up``'s storage (as Liger
    does), saving two activation-sized buffers; only for callers that own those tensors, like
    ``SwiGLUMLP`` whose projections produce them. Ignored under torch.compile.
    """
    op = "swiglu"
    check_tensor(op, "gate", gate)
    check_tensor(op, "up", up)
    check_same_device(op, gate=gate, up=up)
    check_same_dtype(op, gate=gate, up=up)
    check_same_shape(op, gate=gate, up=up)
    return SWIGLU(gate, up, in_place_backward=in_place_backward)
