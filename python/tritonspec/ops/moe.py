"""Mixture-of-Experts experts, forward and backward in Triton, on Hugging Face's expert weights.

``out[t] = sum_j w[t, j] * down_e(act(gate_e x_t, up_e x_t))`` with ``e = ids[t, j]``, for the
(token, expert) pairs a router chose. How it runs:

* The expert sort (:mod:`tritonspec.ops.moe_sort`), on the device from static bounds (no ``.item()``,
  so a CUDA graph can capture it): the ``T*k`` pairs sorted by expert (stably: token order within an
  expert), each expert's rows padded to ``BLOCK_M`` in a buffer of ``T*k + E*(BLOCK_M-1)`` rows, and
  each block of rows knowing its expert. Pairs whose id is outside ``[0, E)`` (transformers'
  expert-parallel sentinels) are dropped.
* Forward: a grouped GEMM gathers each row's token inside its loads (no permuted copy of ``x``) and
  applies the activation in its epilogue (``h``); a second grouped GEMM projects down (``y``); a
  gather-reduce adds each token's ``k`` rows with its routing weights. Every sum has a fixed order (no
  floating-point atomics): outputs and gradients are bitwise the same from run to run.
* Backward: ``g = dout @ down_e^T`` (a grouped GEMM gathering ``dout``); one pass over g recomputes
  ``h`` from the saved pre-activations and gives the routing weights' gradient ``<g, h>`` (so neither
  ``h`` nor ``y`` is kept from the forward), the activation's backward of ``w * g``, and ``w * h``;
  ``dx`` as the grouped GEMM of ``d(gate, up)`` with ``gate_up_e^T`` and the same gather-reduce;
  ``d gate_up_e`` and ``d down_e`` as grouped GEMMs over each expert's rows (the bias gradients are
  their column sums). Eager autograd writes ``d(gate, up)`` over the saved pre-activations and frees each
  row buffer once nothing reads it, so the backward's peak is about one ``(R, 2I)`` buffer besides the
  gradients.
* Without gradients (inference), nothing is saved, and batches of at most 16 tokens skip the sort: each
  chosen expert's weights are read once by :mod:`tritonspec.ops.moe_decode`'s two launches, the second of
  which also sums each token's rows.
* Where the backend's launch configs say ``TMA`` (sm90), the weights' tiles come through host tensor
  descriptors, and for large experts the weight gradients read rows sorted first (``_sorted_rows``).
* A backend may run the grouped GEMMs over sorted rows with its own kernel (the ``moe_experts_gemm`` hook;
  NVIDIA's on Hopper, from 512 rows an expert): the forward's gate/up projection (x's rows gathered for it
  first) and down projection, the backward's d h and dx; and the weight gradients (``moe_weight_grad``),
  gathering the tokens' rows itself. Declined problems run the kernels below.

Weight layouts are strides, so one kernel serves both of Hugging Face's: ``"concatenated"``
(``gate_up_proj (E, 2I, H)`` = [gate; up], ``down_proj (E, H, I)``: Qwen2/3-MoE, Mixtral, OLMoE,
DeepSeek-V3) and ``"interleaved_transposed"`` (``gate_up_proj (E, H, 2I)`` with gate and up in
alternate columns, ``down_proj (E, I, H)``: GPT-OSS, with biases and its clamped SwiGLU).

Layers: ``sort_by_expert`` and the ``_moe_*`` kernels -> ``moe_experts_forward`` / ``moe_experts_backward``
-> the ``MOE_EXPERTS`` op (eager autograd, and ``tritonspec::moe_experts_*`` for torch.compile) ->
``moe_experts``. The router in front of it, ``moe_route`` (top-k ids and weights from router logits),
is :mod:`tritonspec.ops.moe_routing`'s.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..kernel_table import MoECombine, MoERows, MoEUp, MoEWeightGrad
from ..launch import launch_config
from ..specialization.resolve import backend_for_device, lookup
from ._checks import check_same_device, check_tensor
from ._library import (
    Op,
    PlanCache,
    TensorDescriptor,
    cdiv,
    launch,
    library_op,
    next_pow2,
    tma_ok,
    use_library_op,
)
from .moe_decode import MAX_TOKENS as DECODE_TOKENS, moe_decode
from .moe_routing import moe_route
from .moe_sort import padded_rows, sort_by_expert


__all__ = ["moe_experts", "moe_experts_tiered", "moe_route", "moe_experts_ref", "ACTIVATIONS", "LAYOUTS"]

LAYOUTS = ("concatenated", "interleaved_transposed")
# act(gate, up): "silu" is Llama/Qwen's silu(gate) * up; "gpt_oss" is GPT-OSS's clamped
# (up + 1) * gate * sigmoid(1.702 * gate) with gate <= clamp and |up| <= clamp.
ACTIVATIONS = ("silu", "gpt_oss")
GPT_OSS_ALPHA = 1.702


# ----------------------------------------------------------------------------------------------
# the reference: float64 for tests and benchmarks, the weights' dtype for offloaded experts on the CPU
# ----------------------------------------------------------------------------------------------
def moe_experts_ref(
    x,
    ids,
    weights,
    gate_up_proj,
    down_proj,
    *,
    gate_up_bias=None,
    down_bias=None,
    layout="concatenated",
    activation="silu",
    clamp=None,
    dtype=torch.float64,
    experts=None,
):
    """The experts with a loop over experts, differentiable: in float64, the definition of correct.

    ``dtype`` is the matmuls' dtype (the sum is at least float32); ``experts`` limits the loop to those ids
    (others contribute nothing), so the CPU computes only the experts assigned to it, in place.
    """
    x64, w64 = x.to(dtype), weights.to(torch.promote_types(dtype, torch.float32))
    out = torch.zeros(x.shape, dtype=w64.dtype, device=x.device)
    for e in range(gate_up_proj.shape[0]) if experts is None else experts:
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        wgu, wd = gate_up_proj[e].to(dtype), down_proj[e].to(dtype)
        if layout == "concatenated":
            gu = x64[tok] @ wgu.T
            gate, up = gu.chunk(2, dim=-1)
        else:
            gu = x64[tok] @ wgu
            gate, up = gu[:, ::2], gu[:, 1::2]
        if gate_up_bias is not None:
            b = gate_up_bias[e].to(dtype)
            gate, up = (
                (gate + b[: gate.shape[1]], up + b[gate.shape[1] :])
                if layout == "concatenated"
                else (gate + b[::2], up + b[1::2])
            )
        if activation == "silu":
            h = torch.nn.functional.silu(gate) * up
        else:
            gate = gate.clamp(max=clamp) if clamp is not None else gate
            up = up.clamp(-clamp, clamp) if clamp is not None else up
            h = (up + 1) * gate * torch.sigmoid(GPT_OSS_ALPHA * gate)
        y = h @ (wd.T if layout == "concatenated" else wd)
        if down_bias is not None:
            y = y + down_bias[e].to(dtype)
        out.index_add_(0, tok, y.to(out.dtype) * w64[tok, slot, None])
    return out


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` with the N blocks of GROUP_M consecutive M blocks running together:
    each row block is read once from memory and each column block serves GROUP_M row blocks from L2
    (launching M blocks fastest re-reads every row block once per N block)."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _rows_of_block(ROW_PAIR, BLOCK_EXPERT, pid_m, TOP_K, BLOCK_M: tl.constexpr):
    """(rows, pairs, tokens, valid, expert) of M-block ``pid_m`` of the padded, expert-sorted rows."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(ROW_PAIR + rows)
    valid = pairs >= 0
    tokens = tl.where(valid, pairs // TOP_K, 0)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    return rows, pairs, tokens, valid, expert


@triton.jit
def _moe_up_kernel(
    # Pointers to matrices
    X,  # (T, K) tokens, gathered by row
    W,  # (E, K, 2N) by strides: each expert's gate and up columns; TMA: a descriptor over (E * 2N, K)
    BIAS,  # (E, 2N) by strides, read when HAS_BIAS
    H_OUT,  # (R, N) out: act(gate, up) per row
    GU_OUT,  # (R, 2N) out: gate and up before the activation in W's column order, written when STORE_GU
    # Pointers to the expert sort (moe_sort.SortedPairs)
    ROW_PAIR,
    BLOCK_EXPERT,
    # Matrix dimensions
    N,
    K,
    num_m,  # M blocks (R / BLOCK_M)
    TOP_K,  # pairs per token: a row's token is its pair // TOP_K
    # Strides
    stride_x_m,
    stride_w_e,
    stride_w_k,
    stride_w_n,
    stride_bias_e,
    stride_bias_n,
    # Scalars
    clamp,  # gpt_oss's clamp
    # Meta-parameters
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_GU: tl.constexpr,
    ACT: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """h = act(x_rows @ gate_e, x_rows @ up_e) for one (M block, N block); x rows gathered by token.

    W's gate columns are [0, N) and its up columns [N, 2N), or (INTERLEAVED, GPT-OSS) gate and up
    alternate, loaded as one contiguous 2*BLOCK_N-column tile and split in registers. Rows are stored in
    the padded expert-sorted order; GU_OUT keeps the pre-activations (input dtype) for the backward, in W's
    column order ([gate | up], or alternate columns), the order of d(gate, up): the eager backward writes
    those over them in place.
    """
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, pairs, tokens, valid, expert = _rows_of_block(ROW_PAIR, BLOCK_EXPERT, pid_m, TOP_K, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    out_rows = rows.to(tl.int64)[:, None]
    if expert < 0:  # a block past the last expert's rows: zeros, so every output element is defined
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=H_OUT.dtype.element_ty)
        tl.store(H_OUT + out_rows * N + cols[None, :], zero, mask=col_ok[None, :])
        if STORE_GU:  # (all 2N columns over the N blocks, whichever the layout)
            tl.store(GU_OUT + out_rows * (2 * N) + cols[None, :], zero, mask=col_ok[None, :])
            tl.store(GU_OUT + out_rows * (2 * N) + N + cols[None, :], zero, mask=col_ok[None, :])
        return
    w_e = W if TMA else W + expert.to(tl.int64) * stride_w_e
    b_e = BIAS + expert.to(tl.int64) * stride_bias_e
    x_rows = X + tokens.to(tl.int64)[:, None] * stride_x_m
    if INTERLEAVED:
        c2 = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c2_ok = c2 < 2 * N
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(
                w_e + ks[:, None] * stride_w_k + c2[None, :] * stride_w_n,
                mask=k_ok[:, None] & c2_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(b_e + c2 * stride_bias_n, mask=c2_ok, other=0.0).to(tl.float32)[None, :]
        if STORE_GU:  # the tile as loaded, gate and up alternating (padding rows: zeros, as below)
            tl.store(
                GU_OUT + out_rows * (2 * N) + c2[None, :],
                tl.where(valid[:, None], acc, 0.0).to(GU_OUT.dtype.element_ty),
                mask=c2_ok[None, :],
            )
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            if TMA:  # (BLOCK_N, BLOCK_K) tiles of the expert's gate and up rows; columns past N are not stored
                first = expert * 2 * N + pid_n * BLOCK_N
                acc_g = tl.dot(a, tl.trans(W.load([first, k0])), acc_g)
                acc_u = tl.dot(a, tl.trans(W.load([first + N, k0])), acc_u)
            else:
                b_off = ks[:, None] * stride_w_k + cols[None, :] * stride_w_n
                b_mask = k_ok[:, None] & col_ok[None, :]
                acc_g = tl.dot(a, tl.load(w_e + b_off, mask=b_mask, other=0.0), acc_g)
                acc_u = tl.dot(a, tl.load(w_e + N * stride_w_n + b_off, mask=b_mask, other=0.0), acc_u)
        if HAS_BIAS:
            acc_g += tl.load(b_e + cols * stride_bias_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_e + (N + cols) * stride_bias_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # As a Hugging Face expert rounds: the projection's output, the activation, the product. Padding
    # rows are stored as zeros (their loads were masked; the bias is not added to them).
    gate = tl.where(valid[:, None], acc_g.to(H_OUT.dtype.element_ty).to(tl.float32), 0.0)
    up = tl.where(valid[:, None], acc_u.to(H_OUT.dtype.element_ty).to(tl.float32), 0.0)
    out_mask = col_ok[None, :]
    if STORE_GU and not INTERLEAVED:
        tl.store(GU_OUT + out_rows * (2 * N) + cols[None, :], gate.to(GU_OUT.dtype.element_ty), mask=out_mask)
        tl.store(GU_OUT + out_rows * (2 * N) + N + cols[None, :], up.to(GU_OUT.dtype.element_ty), mask=out_mask)
    if ACT == "silu":
        h = (gate * tl.sigmoid(gate)).to(H_OUT.dtype.element_ty).to(tl.float32) * up
    else:  # gpt_oss
        g = tl.minimum(gate, clamp)
        u = tl.minimum(tl.maximum(up, -clamp), clamp)
        h = (u + 1.0) * (g * tl.sigmoid(1.702 * g))
    tl.store(H_OUT + out_rows * N + cols[None, :], h.to(H_OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _moe_rows_kernel(
    # Pointers to matrices
    A,  # (rows or tokens, K): the padded rows themselves, or (GATHER) the rows' tokens
    B,  # (E, K, N) by strides: the experts' weights; TMA: a descriptor over them as (E * N, K) (K_MAJOR) or (E * K, N)
    BIAS,  # (E, N) by strides, read when HAS_BIAS
    SCALE,  # (T * k,) each pair's routing weight, read when HAS_SCALE
    C,  # (R, N) out
    # Pointers to the expert sort (moe_sort.SortedPairs)
    ROW_PAIR,
    BLOCK_EXPERT,
    # Matrix dimensions
    N,
    K,
    num_m,  # M blocks (R / BLOCK_M)
    TOP_K,  # pairs per token: a row's token is its pair // TOP_K
    # Strides
    stride_a_m,
    stride_b_e,
    stride_b_k,
    stride_b_n,
    stride_bias_e,
    stride_bias_n,
    # Meta-parameters
    GATHER: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    K_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C_rows = scale * (A_rows @ B_e) + bias_e for one (M block, N block).

    TMA (K a multiple of BLOCK_K): B's tiles through a descriptor; columns past N (the next expert's) are not
    stored."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, pairs, tokens, valid, expert = _rows_of_block(ROW_PAIR, BLOCK_EXPERT, pid_m, TOP_K, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if expert < 0:  # a block past the last expert's rows: zeros, so every output element is defined
        tl.store(
            C + rows.to(tl.int64)[:, None] * N + cols[None, :],
            tl.zeros([BLOCK_M, BLOCK_N], dtype=C.dtype.element_ty),
            mask=col_ok[None, :],
        )
        return
    a_rows = A + (tokens if GATHER else rows).to(tl.int64)[:, None] * stride_a_m
    b_e = B if TMA else B + expert.to(tl.int64) * stride_b_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if TMA and K_MAJOR:
            b = tl.trans(B.load([expert * N + pid_n * BLOCK_N, k0]))
        elif TMA:
            b = B.load([expert * K + k0, pid_n * BLOCK_N])
        else:
            b = tl.load(
                b_e + ks[:, None] * stride_b_k + cols[None, :] * stride_b_n,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
        acc = tl.dot(a, b, acc)
    if HAS_SCALE:
        acc *= tl.load(SCALE + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(BIAS + expert.to(tl.int64) * stride_bias_e + cols * stride_bias_n, mask=col_ok, other=0.0).to(
            tl.float32
        )[None, :]
    acc = tl.where(valid[:, None], acc, 0.0)  # padding rows: zeros
    tl.store(C + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _moe_act_backward_kernel(
    # Pointers to matrices
    G,  # (R, N) g = dout_t @ down_e^T per row; overwritten with s * h
    GU,  # (R, 2N) the forward's gate and up, in the gate_up weight's column order
    DGU,  # (R, 2N) out: d(gate), d(up) in the same order; may be GU itself (written over it in place)
    SCALE,  # (T * k,) each pair's routing weight s
    DW,  # (T * k,) out: each pair's routing weight gradient
    DOUT,  # (T, H) the output's gradient, read when HAS_BIAS
    DOWN_BIAS,  # (E, H) by strides, read when HAS_BIAS
    # Pointers to the expert sort (moe_sort.SortedPairs)
    ROW_PAIR,
    BLOCK_EXPERT,
    # Matrix dimensions
    R,
    N,
    H,
    TOP_K,  # pairs per token: a row's token is its pair // TOP_K
    ALIGN,  # rows per block of the sort
    # Strides
    stride_dout_t,
    stride_down_bias_e,
    # Scalars
    clamp,  # gpt_oss's clamp
    # Meta-parameters
    ACT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The activation's backward and the routing weights' gradient, for BLOCK_M rows over all their columns.

    With h recomputed from the saved pre-activations (rounded as the forward rounded it):
    * ``dw = <dout_t, y> = <g, h> (+ <dout_t, down_bias_e>)`` (y is never kept);
    * ``d(gate), d(up)`` of ``s * g`` ([dgate | dup], or INTERLEAVED alternate columns);
    * G overwritten with ``s * h``, the down weight's gradient's right-hand side, so that GEMM multiplies
      tiles straight from memory.
    Padding rows get zeros. Each column chunk stores d(gate), d(up) at the very elements of
    GU it loaded gate and up from (and s * h where it loaded g), after computing from them, and no other
    chunk or program touches those: DGU may be GU (and the eager backward passes GU).
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(ROW_PAIR + rows, mask=rows < R, other=-1)
    used = pairs >= 0
    scale = tl.load(SCALE + tl.where(used, pairs, 0), mask=used, other=0.0).to(tl.float32)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    dw = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = used[:, None] & (cols < N)[None, :]
        if INTERLEAVED:
            gate_at = r64 * (2 * N) + 2 * cols[None, :]
            up_at = gate_at + 1
        else:
            gate_at = r64 * (2 * N) + cols[None, :]
            up_at = gate_at + N
        g_in = tl.load(G + r64 * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(GU + gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(GU + up_at, mask=mask, other=0.0).to(tl.float32)
        dh = g_in * scale
        if ACT == "silu":
            sig = tl.sigmoid(gate)
            act = (gate * sig).to(DGU.dtype.element_ty).to(tl.float32)
            dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
            dup = dh * act
            h = act * up
        else:  # gpt_oss, through the clamps (torch.clamp passes the gradient where min <= x <= max)
            g = tl.minimum(gate, clamp)
            u = tl.minimum(tl.maximum(up, -clamp), clamp)
            sig = tl.sigmoid(1.702 * g)
            glu = g * sig
            dgate = tl.where(gate <= clamp, dh * (u + 1.0) * (sig + 1.702 * g * sig * (1.0 - sig)), 0.0)
            dup = tl.where((up >= -clamp) & (up <= clamp), dh * glu, 0.0)
            h = (u + 1.0) * glu
        h = h.to(G.dtype.element_ty).to(tl.float32)
        dw += tl.sum(g_in * h, axis=1)
        # padding rows too (zeros: their loads were masked), so the weight gradients' descriptors read zeros
        stored = (rows < R)[:, None] & (cols < N)[None, :]
        tl.store(DGU + gate_at, dgate.to(DGU.dtype.element_ty), mask=stored)
        tl.store(DGU + up_at, dup.to(DGU.dtype.element_ty), mask=stored)
        tl.store(G + r64 * N + cols[None, :], (h * scale).to(G.dtype.element_ty), mask=stored)
    if HAS_BIAS:
        tokens = tl.where(used, pairs // TOP_K, 0).to(tl.int64)
        expert = tl.load(BLOCK_EXPERT + rows // ALIGN, mask=used, other=0).to(tl.int64)
        for c0 in range(0, H, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            mask = used[:, None] & (cols < H)[None, :]
            d = tl.load(DOUT + tokens[:, None] * stride_dout_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(DOWN_BIAS + expert[:, None] * stride_down_bias_e + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
            dw += tl.sum(d * b, axis=1)
    tl.store(DW + tl.where(used, pairs, 0), dw, mask=used)


@triton.jit
def _moe_combine_kernel(
    # Pointers
    Y,  # (R, H) the rows
    POS,  # (T * k,) each pair's row, -1 for a dropped pair
    WEIGHTS,  # (T * k,) each pair's routing weight, read when HAS_WEIGHTS
    OUT,  # (T, H) out
    # Sizes
    T,
    H,
    # Strides
    stride_out_t,
    # Meta-parameters
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t] = sum_j w[t, j] * Y[pos[t, j]] in float32, a fixed order (no atomics); pos < 0: dropped."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < T
    col_ok = cols < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pos = tl.load(POS + tokens * TOP_K + j, mask=t_ok, other=-1)
        ok = pos >= 0
        y = tl.load(
            Y + tl.where(ok, pos, 0).to(tl.int64)[:, None] * H + cols[None, :],
            mask=ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:
            y *= tl.load(WEIGHTS + tokens * TOP_K + j, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        acc += y
    tl.store(
        OUT + tokens.to(tl.int64)[:, None] * stride_out_t + cols[None, :],
        acc.to(OUT.dtype.element_ty),
        mask=t_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _moe_sorted_rows_kernel(
    # Pointers
    SRC,  # (T, C) by strides: tokens' rows
    ROW_PAIR,  # (R,) each row's pair, -1 for a padding row
    OUT,  # (R, C) out
    # Sizes
    R,
    C,
    TOP_K,
    # Strides
    stride_src,
    # Meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """OUT[r] = SRC[pair(r) // TOP_K], zeros in padding rows: tokens' rows in the sort's order, one pass."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    pairs = tl.load(ROW_PAIR + rows, mask=rows < R, other=-1)
    valid = pairs >= 0
    col_ok = cols < C
    tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
    v = tl.load(SRC + tokens[:, None] * stride_src + cols[None, :], mask=valid[:, None] & col_ok[None, :], other=0.0)
    tl.store(OUT + rows.to(tl.int64)[:, None] * C + cols[None, :], v, mask=(rows < R)[:, None] & col_ok[None, :])


@triton.jit
def _moe_weight_grad_kernel(
    # Pointers to matrices
    L,  # (rows or tokens, M): the padded rows themselves, or (GATHER_L) the rows' tokens; TMA: a descriptor
    RHS,  # (rows or tokens, N): likewise (GATHER_R); TMA: a descriptor over the rows
    SCALE,  # (T * k,) each pair's routing weight, read when HAS_SCALE (the bias gradient's factor)
    DW,  # (E, M, N) by strides, out: each expert's weight gradient, in the weight's own layout
    DBIAS,  # (E, M) by strides, out: each expert's bias gradient, written when HAS_BIAS
    # Pointers to the expert sort (moe_sort.SortedPairs)
    ROW_PAIR,
    EXPERT_START,
    EXPERT_ROWS,
    # Matrix dimensions
    M,
    N,
    TOP_K,  # pairs per token: a row's token is its pair // TOP_K
    # Strides
    stride_l_k,
    stride_rhs_k,
    stride_dw_e,
    stride_dw_m,
    stride_dw_n,
    stride_dbias_e,
    stride_dbias_m,
    # Meta-parameters
    GATHER_L: tl.constexpr,
    GATHER_R: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """dW_e[m, n] = sum over expert e's rows of L_row[m] * RHS_row[n]; dbias_e[m] = sum of scale * L_row[m].

    An expert without rows gets zeros. Programs run expert by expert (grid axis 1), so an expert's rows
    are read while they are in L2. TMA: both operands are sorted rows read by descriptors, whole BLOCK_K-row
    steps (an expert's rows are padded to a multiple of BLOCK_K with rows of zeros in both).
    """
    e = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    start = tl.load(EXPERT_START + e)
    count = tl.load(EXPERT_ROWS + e)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bias = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):
        within = k0 + tl.arange(0, BLOCK_K)
        rows = start + within
        if TMA:
            lt = L.load([start + k0, pid_m * BLOCK_M])
            rt = RHS.load([start + k0, pid_n * BLOCK_N])
            if HAS_BIAS:
                pairs = tl.load(ROW_PAIR + rows, mask=within < count, other=-1)
                valid = pairs >= 0
        else:
            pairs = tl.load(ROW_PAIR + rows, mask=within < count, other=-1)
            valid = pairs >= 0
            tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
            l_rows = tokens if GATHER_L else rows.to(tl.int64)
            r_rows = tokens if GATHER_R else rows.to(tl.int64)
            lt = tl.load(L + l_rows[:, None] * stride_l_k + ms[None, :], mask=valid[:, None] & m_ok[None, :], other=0.0)
            rt = tl.load(
                RHS + r_rows[:, None] * stride_rhs_k + ns[None, :], mask=valid[:, None] & n_ok[None, :], other=0.0
            )
        acc = tl.dot(tl.trans(lt), rt, acc)
        if HAS_BIAS:
            lf = lt.to(tl.float32)
            if HAS_SCALE:
                lf *= tl.load(SCALE + tl.where(valid, pairs, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
            bias += tl.sum(lf, axis=0)
    e64 = e.to(tl.int64)
    tl.store(
        DW + e64 * stride_dw_e + ms[:, None] * stride_dw_m + ns[None, :] * stride_dw_n,
        acc.to(DW.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )
    if HAS_BIAS:
        if pid_n == 0:
            tl.store(DBIAS + e64 * stride_dbias_e + ms * stride_dbias_m, bias.to(DBIAS.dtype.element_ty), mask=m_ok)


# ----------------------------------------------------------------------------------------------
# launch parameters
# ----------------------------------------------------------------------------------------------
def _tokens_per_expert(pairs: int, experts: int) -> int:
    """Average rows per expert, as a power-of-two bucket (tiles and the launch-config memo key)."""
    return next_pow2(max(1, -(-pairs // experts)))


# Defaults from H100 sweeps (bench/bench_moe.py --sweep) at decode (a few rows per expert) and at 4096
# tokens (hundreds): small problems want 16-row blocks; from 64 rows per expert on, 128-row blocks (DeepSeek-V3
# at 64 and 128 rows per expert: 4-6 % faster than 64-row blocks despite the padding), 64-deep K steps, 8
# warps and 256-column row GEMMs; the weight gradients 128 x 128 tiles of one warpgroup, 64 rows a step.
def _up_default(per_expert: int) -> MoEUp:
    if per_expert <= 16:
        return MoEUp(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return MoEUp(BLOCK_M=64 if per_expert <= 32 else 128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)


def _rows_default(per_expert: int) -> MoERows:
    if per_expert <= 16:
        return MoERows(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return MoERows(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)


def _weight_grad_default(per_expert: int) -> MoEWeightGrad:
    if per_expert <= 16:
        return MoEWeightGrad(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    return MoEWeightGrad(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3)


_COMBINE_DEFAULT = MoECombine(BLOCK_T=4, BLOCK_H=256, num_warps=4)


def _problem(x, num_experts, intermediate, top_k) -> dict:
    return dict(
        tokens_per_expert=_tokens_per_expert(x.shape[0] * top_k, num_experts),
        H=int(x.shape[1]),
        I=int(intermediate),
        E=int(num_experts),
        dtype=str(x.dtype),
    )


# ----------------------------------------------------------------------------------------------
# weight layouts as strided views (no copies)
# ----------------------------------------------------------------------------------------------
def _gate_up_view(w: torch.Tensor, layout: str):
    """``gate_up_proj`` as an (E, H, 2I) view (K = hidden, N = gate and up columns in the weight's order)."""
    return w.transpose(1, 2) if layout == "concatenated" else w


def _down_view(w: torch.Tensor, layout: str):
    """``down_proj`` as an (E, I, H) view (K = intermediate, N = hidden)."""
    return w.transpose(1, 2) if layout == "concatenated" else w


def _dummy(device) -> torch.Tensor:
    return torch.empty(1, device=device)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def moe_experts_forward(
    x,
    ids,
    weights,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    layout: str,
    activation: str,
    clamp: float,
    *,
    save: bool,
    traced: bool = False,
):
    """``(out, saved)``; ``saved`` is what the backward needs (empty unless ``save``)."""
    T, H = x.shape
    k = ids.shape[1]
    E = gate_up_proj.shape[0]
    I = down_proj.shape[2] if layout == "concatenated" else down_proj.shape[1]
    device = x.device
    problem = _problem(x, E, I, k)
    cfg = launch_config(MoEUp, device, lambda: _up_default(problem["tokens_per_expert"]), **problem)
    row_pair, block_expert, pair_pos, expert_start, expert_rows = sort_by_expert(ids, E, cfg.BLOCK_M, traced)
    R = row_pair.numel()
    num_m = R // cfg.BLOCK_M
    h = torch.empty((R, I), dtype=x.dtype, device=device)
    gu = torch.empty((R, 2 * I), dtype=x.dtype, device=device) if save else _dummy(device)
    w = _gate_up_view(gate_up_proj, layout)
    tma = cfg.TMA and layout == "concatenated" and gate_up_proj.is_contiguous() and tma_ok(gate_up_proj)
    has_bias = gate_up_bias is not None
    bias = gate_up_bias if has_bias else _dummy(device)
    own = None
    if layout == "concatenated" and activation == "silu" and not has_bias:
        own = _backend_gemm(w, h, block_expert, traced, gate_up=True, gu=gu if save else None)
    if own is not None:
        own(_sorted_rows(x, row_pair, k, traced))
    else:
        launch(
            _moe_up_kernel,
            (num_m * cdiv(I, cfg.BLOCK_N),),
            X=x,
            W=TensorDescriptor(gate_up_proj, [E * 2 * I, H], [H, 1], [cfg.BLOCK_N, cfg.BLOCK_K]) if tma else w,
            BIAS=bias,
            H_OUT=h,
            GU_OUT=gu,
            ROW_PAIR=row_pair,
            BLOCK_EXPERT=block_expert,
            N=I,
            K=H,
            num_m=num_m,
            TOP_K=k,
            stride_x_m=x.stride(0),
            stride_w_e=w.stride(0),
            stride_w_k=w.stride(1),
            stride_w_n=w.stride(2),
            stride_bias_e=bias.stride(0) if has_bias else 0,
            stride_bias_n=bias.stride(1) if has_bias else 0,
            clamp=float(clamp),
            INTERLEAVED=layout != "concatenated",
            HAS_BIAS=has_bias,
            STORE_GU=save,
            ACT=activation,
            TMA=tma,
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            BLOCK_K=cfg.BLOCK_K,
            GROUP_M=cfg.GROUP_M,
            **cfg.options,
            traced=traced,
        )
    y = torch.empty((R, H), dtype=x.dtype, device=device)
    _rows(
        h,
        False,
        row_pair,
        block_expert,
        None,
        _down_view(down_proj, layout),
        down_bias,
        y,
        k,
        cfg.BLOCK_M,
        problem,
        traced,
    )
    out = torch.empty((T, H), dtype=x.dtype, device=device)
    _combine(y, pair_pos, weights, out, k, problem, traced)
    saved = (row_pair, block_expert, pair_pos, expert_start, expert_rows, gu) if save else ()
    return out, saved


def _backend_gemm(b, c, block_expert, traced, *, gate_up=False, gu=None):
    """The backend's own grouped GEMM (``moe_experts_gemm``) as ``run(a_rows)``, or None for the portable
    kernels. Not while traced: torch.library's Triton tracing takes ``tl`` kernels only."""
    if traced:
        return None
    own = lookup("moe_experts_gemm", backend=backend_for_device(c.device))
    return own(b, c, block_expert, gate_up=gate_up, gu=gu) if own is not None else None


def _weights_descriptor(b, block_k: int, block_n: int):
    """``(descriptor, k_major)`` over the experts' weights ``b`` ((E, K, N) by strides) as the 2-D tensor their
    storage is, (E * N, K) with K contiguous or (E * K, N); None where TMA cannot read them (another layout,
    16-byte alignment, or K not a multiple of block_k: a K tile would run into the next expert's)."""
    E, K, N = b.shape
    if TensorDescriptor is None or K % block_k or b.data_ptr() % 16:
        return None
    if b.stride() == (K * N, 1, K) and K * b.element_size() % 16 == 0:
        return TensorDescriptor(b, [E * N, K], [K, 1], [block_n, block_k]), True
    if b.stride() == (K * N, N, 1) and N * b.element_size() % 16 == 0:
        return TensorDescriptor(b, [E * K, N], [N, 1], [block_k, block_n]), False
    return None


def _rows(a, gather, row_pair, block_expert, scale, b, bias, c, top_k, block_m, problem, traced):
    """c = scale * (a_rows @ b_e) + bias_e; ``b`` is (E, K, N) by strides."""
    own = _backend_gemm(b, c, block_expert, traced) if not gather and scale is None and bias is None else None
    if own is not None:
        own(a)
        return
    cfg = launch_config(MoERows, c.device, lambda: _rows_default(problem["tokens_per_expert"]), **problem)
    dummy = _dummy(c.device)
    n = c.shape[1]
    num_m = row_pair.numel() // block_m
    desc = _weights_descriptor(b, cfg.BLOCK_K, cfg.BLOCK_N) if cfg.TMA else None
    launch(
        _moe_rows_kernel,
        (num_m * cdiv(n, cfg.BLOCK_N),),
        A=a,
        B=b if desc is None else desc[0],
        BIAS=dummy if bias is None else bias,
        SCALE=dummy if scale is None else scale,
        C=c,
        ROW_PAIR=row_pair,
        BLOCK_EXPERT=block_expert,
        N=n,
        K=b.shape[1],
        num_m=num_m,
        TOP_K=top_k,
        stride_a_m=a.stride(0),
        stride_b_e=b.stride(0),
        stride_b_k=b.stride(1),
        stride_b_n=b.stride(2),
        stride_bias_e=0 if bias is None else bias.stride(0),
        stride_bias_n=0 if bias is None else bias.stride(1),
        GATHER=gather,
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        TMA=desc is not None,
        K_MAJOR=desc is not None and desc[1],
        BLOCK_M=block_m,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M,
        **cfg.options,
        traced=traced,
    )


# Eager LaunchPlans (see _launch_cache) of the gather-reduce: contiguous tensors by shape and dtype.
_COMBINE_PLANS = PlanCache()


def _combine(y, pair_pos, weights, out, top_k, problem, traced):
    """out = the routing-weighted sum of each token's rows of y."""
    T, H = out.shape
    key = None
    if not traced:
        key = (y.shape, pair_pos.shape, pair_pos.dtype, None if weights is None else weights.dtype, out.shape, top_k)
        key += (y.dtype, out.device, *problem.items())  # the problem picks the launch config
        plan = _COMBINE_PLANS.get(key)
        tensors = (y, pair_pos, _dummy(out.device) if weights is None else weights, out)
        if plan is not None and plan(*tensors):
            return
    cfg = launch_config(MoECombine, out.device, _COMBINE_DEFAULT, **problem)
    plan = launch(
        _moe_combine_kernel,
        (cdiv(T, cfg.BLOCK_T), cdiv(H, cfg.BLOCK_H)),
        Y=y,
        POS=pair_pos,
        WEIGHTS=_dummy(out.device) if weights is None else weights,
        OUT=out,
        T=T,
        H=H,
        stride_out_t=out.stride(0),
        TOP_K=top_k,
        HAS_WEIGHTS=weights is not None,
        BLOCK_T=cfg.BLOCK_T,
        BLOCK_H=cfg.BLOCK_H,
        **cfg.options,
        traced=traced,
        plan=key is not None,
    )
    if plan is not None:
        _COMBINE_PLANS[key] = plan


def _sorted_rows(src, row_pair, top_k, traced, cols=slice(None)):
    """``src[:, cols]``'s rows in the sort's row order (R rows), zeros in the padding rows."""
    src = src[:, cols]
    out = torch.empty((row_pair.numel(), src.shape[1]), dtype=src.dtype, device=src.device)
    launch(
        _moe_sorted_rows_kernel,
        (cdiv(out.shape[0], 16), cdiv(out.shape[1], 256)),
        SRC=src,
        ROW_PAIR=row_pair,
        OUT=out,
        R=out.shape[0],
        C=out.shape[1],
        TOP_K=top_k,
        stride_src=src.stride(0),
        BLOCK_R=16,
        BLOCK_C=256,
        traced=traced,
    )
    return out


def _x_columns(H: int, T: int, R: int) -> list[slice]:
    """Blocks of x's columns (multiples of 256, at least 512) whose sorted rows (R of them) take at most the
    size of x and dx together (2 T rows of H): the gate/up weight gradient's operand, made when both weight
    gradients exist. As few as that allows: each block re-reads d(gate, up)."""
    blocks = -(-R // (2 * T))
    width = H if blocks <= 1 else min(H, max(512, H // blocks // 256 * 256))
    return [slice(c, min(c + width, H)) for c in range(0, H, width)]


def _backend_weight_grad(lhs, gather_l, rhs, gather_r, row_pair, expert_start, expert_rows, dw, top_k, block_m, traced):
    """True where the backend's own weight-gradient kernel (``moe_weight_grad``) wrote ``dw``; never while traced
    (as ``_backend_gemm``)."""
    if traced:
        return False
    own = lookup("moe_weight_grad", backend=backend_for_device(dw.device))
    return own is not None and own(
        lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m, gather_l=gather_l, gather_r=gather_r, top_k=top_k
    )


def _weight_grad_config(problem: dict, device) -> MoEWeightGrad:
    return launch_config(MoEWeightGrad, device, lambda: _weight_grad_default(problem["tokens_per_expert"]), **problem)


def _weight_grad(
    lhs,
    gather_l,
    rhs,
    gather_r,
    row_pair,
    expert_start,
    expert_rows,
    scale,
    dw,
    dbias,
    top_k,
    block_m,
    problem,
    traced,
    tma=False,
):
    """dw: an (E, M, N) view of a weight's gradient; dbias: its (E, M) bias gradient or None. ``tma``: lhs and
    rhs are sorted rows, (R, M) and (R, N), read through descriptors. The backend's own kernel first, where
    there is no bias gradient."""
    if dbias is None and _backend_weight_grad(
        lhs, gather_l, rhs, gather_r, row_pair, expert_start, expert_rows, dw, top_k, block_m, traced
    ):
        return
    cfg = _weight_grad_config(problem, dw.device)
    E, m, n = dw.shape
    dummy = _dummy(dw.device)
    desc = lambda t, cols: TensorDescriptor(t, list(t.shape), list(t.stride()), [cfg.BLOCK_K, cols])  # noqa: E731
    launch(
        _moe_weight_grad_kernel,
        (cdiv(m, cfg.BLOCK_M) * cdiv(n, cfg.BLOCK_N), E),
        L=desc(lhs, cfg.BLOCK_M) if tma else lhs,
        RHS=desc(rhs, cfg.BLOCK_N) if tma else rhs,
        SCALE=dummy if scale is None else scale,
        DW=dw,
        DBIAS=dummy if dbias is None else dbias,
        ROW_PAIR=row_pair,
        EXPERT_START=expert_start,
        EXPERT_ROWS=expert_rows,
        M=m,
        N=n,
        TOP_K=top_k,
        stride_l_k=lhs.stride(0),
        stride_rhs_k=rhs.stride(0),
        stride_dw_e=dw.stride(0),
        stride_dw_m=dw.stride(1),
        stride_dw_n=dw.stride(2),
        stride_dbias_e=0 if dbias is None else dbias.stride(0),
        stride_dbias_m=0 if dbias is None else dbias.stride(1),
        GATHER_L=gather_l,
        GATHER_R=gather_r,
        HAS_SCALE=scale is not None,
        HAS_BIAS=dbias is not None,
        TMA=tma,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M,
        **cfg.options,
        traced=traced,
    )


def moe_experts_backward(
    dout,
    x,
    weights,
    gate_up_proj,
    down_proj,
    gate_up_bias,
    down_bias,
    saved,
    layout: str,
    activation: str,
    clamp: float,
    top_k: int,
    *,
    in_place: bool = False,
    traced: bool = False,
):
    """``(dx, dweights, dgate_up, ddown, dgate_up_bias or None, ddown_bias or None)``, all fresh tensors.

    ``in_place``: d(gate, up) is written over the saved pre-activations (``saved[-1]``), whose version is
    then bumped (a second backward through the same graph fails loudly instead of reading gradients).
    Peak memory: each row buffer is freed as soon as nothing reads it, in this order: g (R x I), the
    activation's backward (g becomes s * h), d down_proj, g freed, the dx rows (R x H), dx, the rows
    freed, d gate_up_proj (from d(gate, up), R x 2I, and x).

    Where the backend's weight-gradient config asks for TMA, both weight gradients read sorted rows through
    descriptors: dout's rows are gathered once (R x H, also the g GEMM's operand, freed after d down_proj),
    and x's rows a block of columns at a time (:func:`_x_columns`).
    """
    row_pair, block_expert, pair_pos, expert_start, expert_rows, gu = saved
    T, H = x.shape
    E = gate_up_proj.shape[0]
    I = gu.shape[1] // 2
    R = row_pair.numel()
    device = x.device
    problem = _problem(x, E, I, top_k)
    block_m = R // block_expert.numel()
    dout = dout.contiguous()
    w_flat = weights.reshape(-1)
    wg_cfg = _weight_grad_config(problem, device)
    tma = (
        wg_cfg.TMA
        and TensorDescriptor is not None
        and block_m % wg_cfg.BLOCK_K == 0  # whole descriptor steps stay in an expert's (padded) rows
        and all(n * x.element_size() % 16 == 0 for n in (H, I))
    )
    if tma:
        dout_rows = _sorted_rows(dout, row_pair, top_k, traced)
    # g = dout_t @ down_e^T per row; then the activation's backward, dw = <g, h> (+ the bias term) and s * h
    g = torch.empty((R, I), dtype=x.dtype, device=device)
    _rows(
        dout_rows if tma else dout,
        not tma,
        row_pair,
        block_expert,
        None,
        _down_view(down_proj, layout).transpose(1, 2),
        None,
        g,
        top_k,
        block_m,
        problem,
        traced,
    )
    dgu = gu if in_place else torch.empty((R, 2 * I), dtype=x.dtype, device=device)
    dweights = torch.zeros(T * top_k, dtype=torch.float32, device=device)  # dropped pairs keep 0
    launch(
        _moe_act_backward_kernel,
        (cdiv(R, 16),),
        G=g,
        GU=gu,
        DGU=dgu,
        SCALE=w_flat,
        DW=dweights,
        DOUT=dout,
        DOWN_BIAS=_dummy(device) if down_bias is None else down_bias,
        ROW_PAIR=row_pair,
        BLOCK_EXPERT=block_expert,
        R=R,
        N=I,
        H=H,
        TOP_K=top_k,
        ALIGN=block_m,
        stride_dout_t=dout.stride(0),
        stride_down_bias_e=0 if down_bias is None else down_bias.stride(0),
        clamp=float(clamp),
        ACT=activation,
        INTERLEAVED=layout != "concatenated",
        HAS_BIAS=down_bias is not None,
        BLOCK_M=16,
        BLOCK_N=128,
        traced=traced,
    )
    if in_place:
        torch.autograd.graph.increment_version(gu)
    # d down_e (as (E, H, I)) = sum of dout_t^T (s * h_row); its bias: sum of s * dout_t. g (now s * h) is
    # read by nothing after it.
    ddown = torch.empty_like(down_proj)
    ddb = torch.empty_like(down_bias) if down_bias is not None else None
    _weight_grad(
        dout_rows if tma else dout,
        not tma,
        g,
        False,
        row_pair,
        expert_start,
        expert_rows,
        w_flat,
        _down_view(ddown, layout).transpose(1, 2),
        ddb,
        top_k,
        block_m,
        problem,
        traced,
        tma,
    )
    del g
    if tma:
        del dout_rows
    # dx: each pair's d(gate, up) @ gate_up_e^T, then the same gather-reduce as the forward
    w_t = _gate_up_view(gate_up_proj, layout).transpose(1, 2)  # (E, 2I, H)
    dxp = torch.empty((R, H), dtype=x.dtype, device=device)
    _rows(dgu, False, row_pair, block_expert, None, w_t, None, dxp, top_k, block_m, problem, traced)
    dx = torch.empty((T, H), dtype=x.dtype, device=device)
    _combine(dxp, pair_pos, None, dx, top_k, problem, traced)
    del dxp
    # d gate_up_e: each expert's rows, written in the weight's own layout
    dgate_up = torch.empty_like(gate_up_proj)
    dgb = torch.empty_like(gate_up_bias) if gate_up_bias is not None else None
    dgate_up_view = _gate_up_view(dgate_up, layout).transpose(1, 2)  # (E, 2I, H)
    for cols in _x_columns(H, T, R) if tma else (slice(0, H),):
        _weight_grad(
            dgu,
            False,
            _sorted_rows(x, row_pair, top_k, traced, cols) if tma else x,
            not tma,
            row_pair,
            expert_start,
            expert_rows,
            None,
            dgate_up_view[:, :, cols],
            dgb if cols.start == 0 else None,  # each block of columns would write the same bias gradient
            top_k,
            block_m,
            problem,
            traced,
            tma,
        )
    return dx, dweights.view(T, top_k), dgate_up, ddown, dgb, ddb


# ----------------------------------------------------------------------------------------------
# the op (eager autograd and the torch.library ops, from one declaration)
# ----------------------------------------------------------------------------------------------
def _forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    layout: str,
    activation: str,
    clamp: float,
    *,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, row_pair, block_expert, pair_pos, expert_start, expert_rows, gu)``: the output, then the sort
    and the pre-activations the backward reads."""
    out, saved = moe_experts_forward(
        x,
        ids,
        weights,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        layout,
        activation,
        clamp,
        save=True,
        traced=traced,
    )
    return (out, *saved)


def _fake(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    layout: str,
    activation: str,
    clamp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H = x.shape
    E = gate_up_proj.shape[0]
    I = down_proj.shape[2] if layout == "concatenated" else down_proj.shape[1]
    P = ids.numel()
    problem = _problem(x, E, I, ids.shape[1])
    block_m = launch_config(MoEUp, x.device, lambda: _up_default(problem["tokens_per_expert"]), **problem).BLOCK_M
    R = padded_rows(P, E, block_m)
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty((T, H)),
        torch.empty(R, **i32),
        torch.empty(R // block_m, **i32),
        torch.empty(P, **i32),
        torch.empty(E, **i32),
        torch.empty(E, **i32),
        x.new_empty((R, 2 * I)),
    )


def _save(inputs: tuple, outputs: tuple) -> tuple:
    """x, the routing weights, both weights and biases, then the sort and the pre-activations."""
    return (inputs[0], *inputs[2:7], *outputs[1:])


def _backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    row_pair: torch.Tensor,
    block_expert: torch.Tensor,
    pair_pos: torch.Tensor,
    expert_start: torch.Tensor,
    expert_rows: torch.Tensor,
    gu: torch.Tensor,
    layout: str,
    activation: str,
    clamp: float,
    *,
    in_place: bool,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if dout is None:  # eager autograd passes None for an output that got no gradient
        dout = torch.zeros_like(x)
    # gu is this op's own intermediate, which no caller ever sees: the eager backward always writes d(gate,
    # up) over it (one (R, 2I) buffer fewer), whatever in_place_backward says. The traced backward is a
    # library op whose schema mutates nothing, so it never does.
    in_place = not traced
    saved = (row_pair, block_expert, pair_pos, expert_start, expert_rows, gu)
    # Every gradient is a fresh tensor nothing else holds, so AccumulateGrad adopts it instead of copying.
    dx, dw, dgu, dd, dgb, ddb = moe_experts_backward(
        dout,
        x,
        weights,
        gate_up_proj,
        down_proj,
        gate_up_bias,
        down_bias,
        saved,
        layout,
        activation,
        clamp,
        weights.shape[1],
        in_place=in_place,
        traced=traced,
    )
    # absent biases get empty gradients of their own (library op outputs may not alias each other)
    return (
        dx,
        dw.to(weights.dtype),
        dgu,
        dd,
        x.new_empty(0) if dgb is None else dgb,
        x.new_empty(0) if ddb is None else ddb,
    )


def _backward_fake(
    dout: torch.Tensor,
    x: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    row_pair: torch.Tensor,
    block_expert: torch.Tensor,
    pair_pos: torch.Tensor,
    expert_start: torch.Tensor,
    expert_rows: torch.Tensor,
    gu: torch.Tensor,
    layout: str,
    activation: str,
    clamp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(x),
        torch.empty_like(weights),
        torch.empty_like(gate_up_proj),
        torch.empty_like(down_proj),
        x.new_empty(0) if gate_up_bias is None else torch.empty_like(gate_up_bias),
        x.new_empty(0) if down_bias is None else torch.empty_like(down_bias),
    )


MOE_EXPERTS = Op(
    "moe_experts",
    forward=_forward,
    fake=_fake,
    save=_save,
    statics=(7, 8, 9),
    backward=_backward,
    backward_fake=_backward_fake,
    grads=(0, None, 1, 2, 3, 4, 5, None, None, None),
)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def _check(x, ids, weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout, activation, clamp):
    op = "moe_experts"
    check_tensor(op, "x", x, ndim=2)
    check_tensor(op, "gate_up_proj", gate_up_proj, ndim=3)
    check_tensor(op, "down_proj", down_proj, ndim=3)
    check_tensor(op, "top_k_weights", weights, ndim=2)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
        raise TypeError(
            f"{op}: argument 'top_k_ids' must be a 2-D int32 or int64 tensor (tokens, top_k), got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {tuple(getattr(ids, 'shape', ()))}"
        )
    biases = {n: b for n, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)) if b is not None}
    for name, bias in biases.items():
        check_tensor(op, name, bias, ndim=2)
    check_same_device(
        op, x=x, top_k_ids=ids, top_k_weights=weights, gate_up_proj=gate_up_proj, down_proj=down_proj, **biases
    )
    if weights.shape != ids.shape:
        raise ValueError(
            f"{op}: argument 'top_k_weights' has shape {tuple(weights.shape)} but 'top_k_ids' has {tuple(ids.shape)}"
        )
    T, H = x.shape
    if ids.shape[0] != T:
        raise ValueError(f"{op}: argument 'top_k_ids' has {ids.shape[0]} rows but 'x' has {T} tokens")
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: argument 'layout' must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: argument 'activation' must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0):
        raise ValueError(f"{op}: argument 'clamp' must be a positive number or None, got {clamp!r}")
    if clamp is not None and activation != "gpt_oss":
        raise ValueError(f"{op}: argument 'clamp' applies to activation 'gpt_oss' only")
    E = gate_up_proj.shape[0]
    if E == 0:
        raise ValueError(f"{op}: argument 'gate_up_proj' has no experts, shape {tuple(gate_up_proj.shape)}")
    if layout == "concatenated":
        two_i, h_in = gate_up_proj.shape[1:]
        want_down = (E, H, two_i // 2)
    else:
        h_in, two_i = gate_up_proj.shape[1:]
        want_down = (E, two_i // 2, H)
    if h_in != H or two_i % 2 or two_i == 0:
        raise ValueError(
            f"{op}: argument 'gate_up_proj' has shape {tuple(gate_up_proj.shape)}; with layout "
            f"{layout!r} and hidden size {H} it must be " + ("(E, 2I, H)" if layout == "concatenated" else "(E, H, 2I)")
        )
    if tuple(down_proj.shape) != want_down:
        raise ValueError(
            f"{op}: argument 'down_proj' has shape {tuple(down_proj.shape)}; expected {want_down} for layout {layout!r}"
        )
    for name, t in (("x", x), ("down_proj", down_proj)):
        if t.dtype != gate_up_proj.dtype:
            raise TypeError(f"{op}: argument '{name}' has dtype {t.dtype} but 'gate_up_proj' has {gate_up_proj.dtype}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (E, two_i)), ("down_bias", down_bias, (E, H))):
        if bias is not None:
            if tuple(bias.shape) != shape:
                raise ValueError(f"{op}: argument '{name}' has shape {tuple(bias.shape)}; expected {shape}")
    if x.dtype == torch.float32 and x.device.type != "cpu":
        raise TypeError(
            f"{op}: argument 'x' has dtype float32, not supported on {x.device.type} (float32 only on the "
            "CPU interpreter); use torch.float16 or torch.bfloat16"
        )


def _inference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor],
    far_gate_up_proj: Optional[torch.Tensor],
    far_down_proj: Optional[torch.Tensor],
    far_gate_up_bias: Optional[torch.Tensor],
    far_down_bias: Optional[torch.Tensor],
    layout: str,
    activation: str,
    clamp: float,
) -> torch.Tensor:
    """No gradient wanted: nothing saved for a backward, and decode-sized batches skip the sort. ``far_*``: a
    second store of experts (:func:`moe_experts_tiered`, at most 16 tokens), or None."""
    gate_up_bias, down_bias = _contiguous_last(gate_up_bias), _contiguous_last(down_bias)
    far = None
    if far_gate_up_proj is not None:
        far = (_gate_up_view(far_gate_up_proj, layout), _down_view(far_down_proj, layout))
        far += (_contiguous_last(far_gate_up_bias), _contiguous_last(far_down_bias))
    if x.shape[0] <= DECODE_TOKENS or far is not None:
        gate_up, down = _gate_up_view(gate_up_proj, layout), _down_view(down_proj, layout)
        interleaved = layout != "concatenated"
        return moe_decode(x, ids, weights, gate_up, down, gate_up_bias, down_bias, interleaved, activation, clamp, far)
    args = (x, ids, weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout, activation, clamp)
    return moe_experts_forward(*args, save=False)[0]


def _inference_fake(x, ids, weights, gate_up_proj, down_proj, gate_up_bias, down_bias, far_gate_up_proj,
                    far_down_proj, far_gate_up_bias, far_down_bias, layout, activation, clamp):  # fmt: skip
    return x.new_empty(x.shape)


# What torch.compile traces when no gradient is wanted: the eager inference path as one opaque op, so a compiled
# decode step runs the sort-free decode kernels (and the backends' own GEMMs), and CUDA graphs capture them as
# eager runs them. Forward only: autograd never reaches it.
MOE_INFERENCE = library_op("moe_experts_inference", _inference, _inference_fake, opaque=True)


# GPT-OSS's activation without a clamp: the kernels clamp to +-inf, which leaves every value as it is.
_NO_CLAMP = float("inf")


def _contiguous_last(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def moe_experts(
    x: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    layout: str = "concatenated",
    activation: str = "silu",
    clamp: float | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * down_e(act(gate_e x_t, up_e x_t))``, ``e = top_k_ids[t, j]``, in Triton.

    Args:
        x: (T, H) tokens, float16 / bfloat16 (float32 on the CPU interpreter).
        top_k_ids: (T, k) int32 or int64 expert ids; a token may name an expert in several slots (each slot
            adds its term); ids outside [0, E) (transformers' expert-parallel sentinels) contribute nothing.
        top_k_weights: (T, k) routing weights, any float dtype; differentiable (their gradient feeds
            the router).
        gate_up_proj, down_proj: Hugging Face's expert weights. ``layout="concatenated"``:
            (E, 2I, H) = [gate; up] and (E, H, I). ``"interleaved_transposed"`` (GPT-OSS): (E, H, 2I) with
            gate and up in alternate columns, and (E, I, H).
        gate_up_bias, down_bias: optional (E, 2I) (in the weight's column order) and (E, H).
        activation: "silu" (``silu(gate) * up``) or "gpt_oss" (``(up + 1) * gate * sigmoid(1.702 * gate)``
            with ``gate <= clamp`` and ``|up| <= clamp``).
    Returns:
        (T, H) in x's dtype. Gradients flow to x, the routing weights, both weights and the biases. The eager
        backward writes its activation gradient over what the forward saved: a second backward through the
        same graph (``retain_graph=True``) raises autograd's in-place error. Without gradients (inference),
        up to 16 tokens run :mod:`tritonspec.ops.moe_decode`'s sort-free GEMMs.
    """
    _check(x, top_k_ids, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, layout, activation, clamp)
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        # Triton's interpreter (3.6 to 3.9) feeds bf16 tl.dot operands to numpy as raw bits: compute in
        # float32 there and round the result (on GPUs bf16 runs as it is).
        f = lambda t: None if t is None else t.float()  # noqa: E731
        return moe_experts(
            x.float(),
            top_k_ids,
            top_k_weights,
            f(gate_up_proj),
            f(down_proj),
            gate_up_bias=f(gate_up_bias),
            down_bias=f(down_bias),
            layout=layout,
            activation=activation,
            clamp=clamp,
        ).to(x.dtype)
    if x.shape[0] == 0:
        return x.new_zeros(x.shape) + 0 * top_k_weights.sum() + 0 * gate_up_proj.sum() + 0 * down_proj.sum()
    x, top_k_weights = x.contiguous(), top_k_weights.contiguous()
    params = (x, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)):
        return (MOE_INFERENCE if use_library_op() else _inference)(
            x,
            top_k_ids.contiguous(),
            top_k_weights,
            gate_up_proj,
            down_proj,
            gate_up_bias,
            down_bias,
            None,
            None,
            None,
            None,
            layout,
            activation,
            _NO_CLAMP if clamp is None else float(clamp),
        )
    return MOE_EXPERTS(
        x,
        top_k_ids.contiguous(),
        top_k_weights,
        gate_up_proj,
        down_proj,
        _contiguous_last(gate_up_bias),
        _contiguous_last(down_bias),
        layout,
        activation,
        _NO_CLAMP if clamp is None else float(clamp),
    )


def moe_experts_tiered(
    x: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    near: dict,
    far: dict,
    *,
    layout: str = "concatenated",
    activation: str = "silu",
    clamp: float | None = None,
) -> torch.Tensor:
    """:func:`moe_experts` without gradients, over experts whose weights lie in two stores.

    ``near`` and ``far`` each map ``gate_up_proj``, ``down_proj`` (and optionally ``gate_up_bias``,
    ``down_bias``) to tensors laid out as :func:`moe_experts` takes them; ids in [0, E_near) name ``near``'s
    experts, ids in [E_near, E_near + E_far) ``far``'s; others contribute nothing. Offloaded experts in a CUDA
    graph use it: the GPU slots near, every expert in host memory mapped into the GPU's address space far, so
    a step reads a missing expert in place, with no host decision. The decode kernels read each expert from its
    store with plain loads (host memory included), 16 tokens a launch pair, and the result is bit for bit that of
    one store holding both. Meant for decode: past 16 tokens each group of 16 reads its experts again.
    """
    names = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
    stores = {}
    for side, store in (("near", near), ("far", far)):
        if not isinstance(store, dict) or not set(names[:2]) <= set(store) <= set(names):
            raise ValueError(
                f"moe_experts_tiered: argument {side!r} must be a dict of gate_up_proj, down_proj and optionally "
                f"gate_up_bias, down_bias; got {sorted(store) if isinstance(store, dict) else type(store).__name__}"
            )
        stores[side] = [store.get(n) for n in names]
        _check(x, top_k_ids, top_k_weights, *stores[side], layout, activation, clamp)
    near_, far_ = stores["near"], stores["far"]
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, top_k_weights, *near_, *far_)):
        raise ValueError("moe_experts_tiered: inference only; call it under torch.no_grad() (a gradient was required)")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":  # the interpreter's bf16 dots: see moe_experts
        f = lambda t: None if t is None else t.float()  # noqa: E731
        near_f, far_f = dict(zip(names, map(f, near_))), dict(zip(names, map(f, far_)))
        kw = dict(layout=layout, activation=activation, clamp=clamp)
        return moe_experts_tiered(x.float(), top_k_ids, top_k_weights, near_f, far_f, **kw).to(x.dtype)
    clamp_ = _NO_CLAMP if clamp is None else float(clamp)
    x, top_k_weights, ids = x.contiguous(), top_k_weights.contiguous(), top_k_ids.contiguous()
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    op = MOE_INFERENCE if use_library_op() else _inference
    groups = [slice(t, t + DECODE_TOKENS) for t in range(0, x.shape[0], DECODE_TOKENS)]
    chunks = [op(x[g], ids[g], top_k_weights[g], *near_, *far_, layout, activation, clamp_) for g in groups]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
