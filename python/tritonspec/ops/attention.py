"""Scaled dot-product attention, forward and backward, written once in Triton.

``attention(q, k, v, causal=, scale=)`` is FlashAttention-2 style: the forward streams K/V blocks
through an online softmax and saves the row logsumexp; the backward recomputes the probabilities
from it (preprocess ``delta = rowsum(dO * O)``, a dK/dV kernel looping over q blocks, a dQ kernel
looping over k blocks -- or dQ accumulated with fp32 atomics from the dK/dV kernel).

Every launch parameter (tile sizes, warps, stages, TMA tensor descriptors, warp specialization,
dQ strategy) comes from ``launch_config`` with the kernel table's attention config types: the
defaults below are portable (the CPU interpreter included) and a backend's ``kernel_config`` may
override any field (NVIDIA's does on sm90 with tiles measured on an H100). A
backend may also run the forward or the whole backward with kernels of its own (hooks
``attention_forward`` / ``attention_backward``; NVIDIA's spec does on Hopper). The backward hook
answers before the op allocates anything: taking the problem, it returns the launch to run once the
op has zeroed the fp32 dQ accumulator and computed delta, so a declined problem costs neither. The
op itself never asks which backend it runs on.

Semantics follow ``torch.nn.functional.scaled_dot_product_attention``:
* q ``(batch, heads_q, seq_q, head_dim)``, k and v ``(batch, heads_kv, seq_k, head_dim)``;
  ``heads_q % heads_kv == 0`` (grouped-query / multi-query attention: q head ``h`` reads kv head
  ``h // (heads_q // heads_kv)``, as SDPA's ``enable_gqa=True``).
* ``causal=True`` is SDPA's ``is_causal=True``: the mask is top-left aligned, query ``i`` sees keys
  ``j <= i`` -- also when ``seq_q != seq_k`` (for ``seq_q < seq_k`` this is *not* the bottom-right
  alignment a KV-cache decode step wants; pass ``causal=False`` for single-token decode).
* ``scale`` defaults to ``1/sqrt(head_dim)``.
* ``key_bounds`` instead of ``causal``: each query's keys as one interval (padding, packed sequences, sliding
  windows); the kernels split each q block's key blocks into masked and unmasked ranges from the rows' intervals
  (a backend's own kernels get the bounds too). ``sinks``: GPT-OSS's per-head sink logits (portable kernels only).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..kernel_table import AttentionBackwardKV, AttentionBackwardQ, AttentionForward, AttentionPreprocess
from ..launch import launch_config
from ..specialization.resolve import backend_for_device, lookup
from ._checks import check_same_device, check_same_dtype, check_tensor
from ._library import Op, TensorDescriptor, cdiv, derived, launch, next_pow2, tma_ok

__all__ = ["attention", "attention_ref", "causal_key_bounds", "key_bounds_from_mask", "LOG2E"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# tile loads/stores: one TMA descriptor path, one plain pointer path, chosen by a constexpr
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile_load(
    X,
    b,
    h,
    row0,
    stride_b,
    stride_h,
    stride_s,
    n_rows,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    TMA: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """A [BLOCK, DP] tile of rows row0.. of head (b, h); rows >= n_rows and columns >= D read as 0."""
    if TMA:
        # 4-D descriptor over (batch, heads, seq, head_dim): the hardware zero-fills out of bounds.
        t = X.load([b, h, row0, 0]).reshape([BLOCK, DP])
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = tl.arange(0, DP)
        base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
        ptrs = base + rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
        if CHECK_ROWS:
            if D == DP:
                t = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
            else:
                t = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < D), other=0.0)
        else:
            if D == DP:
                t = tl.load(ptrs)
            else:
                t = tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
    return t


@triton.jit
def _tile_store(
    X,
    val,
    b,
    h,
    row0,
    stride_b,
    stride_h,
    stride_s,
    n_rows,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    TMA: tl.constexpr,
):
    """Store a [BLOCK, DP] tile; rows >= n_rows and columns >= D are dropped."""
    if TMA:
        X.store([b, h, row0, 0], val.to(X.dtype).reshape([1, 1, BLOCK, DP]))
    else:
        rows = row0 + tl.arange(0, BLOCK)
        cols = tl.arange(0, DP)
        base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
        ptrs = base + rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
        tl.store(ptrs, val.to(X.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < D))


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    b,
    hk,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    lo,
    hi,
    offs_m,
    row_lo,
    row_hi,
    SEQ_K,
    qk_scale,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASKED: tl.constexpr,
    SCALE_POS: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi). MASKED blocks apply the causal / seq_k mask, or with
    BOUNDS each row's key interval [row_lo, row_hi); unmasked ones (every key valid for every row)
    skip it -- the on-band/off-band split. A BOUNDS row may see no key of a block (or of any), so its
    running max can stay -inf: subtracting 0 instead keeps its probabilities 0 rather than NaN."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _tile_load(K, b, hk, start_n, stride_kb, stride_kh, stride_ks, SEQ_K, BLOCK_N, D, DP, TMA, MASKED)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            cols = start_n + offs_n
            if BOUNDS:
                valid = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None])
            else:
                valid = cols[None, :] < SEQ_K
                if CAUSAL:
                    valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if BOUNDS:
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_sub = m_new
            s = s - m_sub[:, None]
        elif SCALE_POS:
            # max before scaling saves a pass; one FMA per score afterwards (valid for scale > 0)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
            s = qk * qk_scale - m_new[:, None]
        else:
            s = qk * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_new
            s = s - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _tile_load(V, b, hk, start_n, stride_vb, stride_vh, stride_vs, SEQ_K, BLOCK_N, D, DP, TMA, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _q_block(HQ, GROUP, SEQ_Q, SEQ_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The q block a forward / dQ program owns and the key range it walks.

    Returns (b, h, hk, bh, start_m, offs_m, mid, hi): keys [0, mid) are whole unmasked blocks, [mid,
    hi) need the causal / seq_k mask. The grid is one axis, q blocks fastest: a head's programs run
    side by side on its K/V (and a GQA group's heads follow each other), so K/V come from L2, and
    causal grids take each head's longest rows first. With heads fastest, one program per head was
    in flight once batch x heads passed the SM count, and 8x32x2048x64's causal forward fell from
    349 to 193 TFLOP/s on an H100."""
    n_m = tl.cdiv(SEQ_Q, BLOCK_M)
    pid_m = tl.program_id(0) % n_m
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    bh = tl.program_id(0) // n_m
    b = bh // HQ
    h = bh % HQ
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, SEQ_K)
        mid = tl.minimum(start_m, SEQ_K) // BLOCK_N * BLOCK_N
    else:
        hi = SEQ_K
        mid = SEQ_K // BLOCK_N * BLOCK_N
    return b, h, h // GROUP, bh, start_m, offs_m, mid, hi


@triton.jit
def _bounded_keys(KB, b, BOUNDS_HI, SEQ_PAD, offs_m, BLOCK_N: tl.constexpr):
    """A q block's rows' key intervals and the key blocks to walk: (row_lo, row_hi, lo, a, c, hi).

    Blocks [a, c) hold keys every row of the block sees (no mask); [lo, a) and [c, hi) need one.
    Rows with an empty interval (padding) add no key range, but a block with one is masked throughout,
    so that row keeps probability 0. KB holds lo rows at ``b * SEQ_PAD`` and hi rows ``BOUNDS_HI`` on."""
    row_lo = tl.load(KB + b.to(tl.int64) * SEQ_PAD + offs_m)
    row_hi = tl.load(KB + BOUNDS_HI + b.to(tl.int64) * SEQ_PAD + offs_m)
    seen = row_hi > row_lo
    hi = tl.max(tl.where(seen, row_hi, 0), 0)
    lo = tl.minimum(tl.min(tl.where(seen, row_lo, hi), 0), hi) // BLOCK_N * BLOCK_N
    a = tl.minimum(tl.maximum(tl.cdiv(tl.max(row_lo, 0), BLOCK_N) * BLOCK_N, lo), hi)
    c = tl.minimum(tl.maximum(tl.min(row_hi, 0) // BLOCK_N * BLOCK_N, a), hi)
    return row_lo, row_hi, lo, a, c, hi


@triton.jit
def _attn_fwd_kernel(
    # Pointers (TMA descriptors where TMA): q, k, v, o (batch, heads, seq, head_dim); lse (batch, heads_q, SEQ_PAD);
    # kb, each query's key interval (lo rows, then hi rows: 2, batch, SEQ_PAD) where BOUNDS; sinks (heads_q,)
    # fp32 logits where HAS_SINKS
    Q,
    K,
    V,
    O,
    LSE,
    KB,
    SINKS,
    # Sizes
    HQ,  # q heads
    GROUP,  # q heads per kv head
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,  # the per-row state's (lse, delta) row length: seq_q padded to a multiple of MAX_BLOCK_M
    BOUNDS_HI,  # batch * SEQ_PAD: where kb's hi rows start
    # Strides (batch, head, seq) of each 4-D tensor; head_dim is contiguous
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    # Scales
    qk_scale,  # softmax scale * log2(e)
    # Meta-parameters
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SCALE_POS: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """One q block of one q head: O = softmax(Q K^T * scale) V over its key range, and its rows' lse.

    A sink (GPT-OSS) is one more logit per head in the softmax's denominator, with no value."""
    b, h, hk, bh, start_m, offs_m, mid, hi = _q_block(HQ, GROUP, SEQ_Q, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL)
    q = _tile_load(Q, b, h, start_m, stride_qb, stride_qh, stride_qs, SEQ_Q, BLOCK_M, D, DP, TMA, True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    if BOUNDS:
        row_lo, row_hi, lo, a, mid, hi = _bounded_keys(KB, b, BOUNDS_HI, SEQ_PAD, offs_m, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, b, hk, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            lo, a, offs_m, row_lo, row_hi, SEQ_K, qk_scale,
            D, DP, BLOCK_N, False, True, True, SCALE_POS, TMA, False,
        )  # fmt: skip
    else:
        # Every row sees key 0, so the first block a row processes has a finite max: no NaN guard needed.
        row_lo, row_hi, a = offs_m, offs_m, 0
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, b, hk, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        a, mid, offs_m, row_lo, row_hi, SEQ_K, qk_scale,
        D, DP, BLOCK_N, CAUSAL, BOUNDS, False, SCALE_POS, TMA, WARP_SPEC,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, b, hk, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        mid, hi, offs_m, row_lo, row_hi, SEQ_K, qk_scale,
        D, DP, BLOCK_N, CAUSAL, BOUNDS, True, SCALE_POS, TMA, False,
    )  # fmt: skip
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634  # log2(e): lse is base 2
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    if BOUNDS:
        # a row that sees no key: output 0 (as SDPA's fully masked rows) and lse +inf (probability 0 in the backward)
        empty = l_i == 0.0
        l_i = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_i))
        out = acc / l_i[:, None]
    else:
        lse = m_i + tl.math.log2(l_i)  # base-2 logsumexp of qk * scale * log2(e)
        out = acc / l_i[:, None]
    tl.store(LSE + bh.to(tl.int64) * SEQ_PAD + offs_m, lse, mask=offs_m < SEQ_Q)
    _tile_store(O, out, b, h, start_m, stride_ob, stride_oh, stride_os, SEQ_Q, BLOCK_M, D, DP, TMA)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_pre_kernel(
    # Pointers: o, do (batch, heads, seq, head_dim); delta (batch, heads, SEQ_PAD); dqa, the fp32 dQ accumulator
    # (batch, heads, seq, DP), zeroed here where ZERO_DQA (else unused)
    O,
    DO,
    DELTA,
    DQA,
    # Sizes
    HQ,
    SEQ_Q,
    SEQ_PAD,  # the per-row state's (lse, delta) row length: seq_q padded to a multiple of MAX_BLOCK_M
    # Strides (batch, head, seq)
    stride_ob,
    stride_oh,
    stride_os,
    stride_dob,
    stride_doh,
    stride_dos,
    # Meta-parameters
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ZERO_DQA: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32; also zeroes the fp32 dQ accumulator when a kernel adds dQ into it."""
    pid_m = tl.program_id(1)
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    o = _tile_load(O, b, h, start_m, stride_ob, stride_oh, stride_os, SEQ_Q, BLOCK_M, D, DP, False, True).to(tl.float32)
    do = _tile_load(DO, b, h, start_m, stride_dob, stride_doh, stride_dos, SEQ_Q, BLOCK_M, D, DP, False, True).to(
        tl.float32
    )
    tl.store(DELTA + bh.to(tl.int64) * SEQ_PAD + offs_m, tl.sum(o * do, 1), mask=offs_m < SEQ_Q)
    if ZERO_DQA:
        row = bh.to(tl.int64) * SEQ_Q + offs_m
        cols = tl.arange(0, DP)
        tl.store(
            DQA + row[:, None] * DP + cols[None, :], tl.zeros([BLOCK_M, DP], tl.float32), mask=offs_m[:, None] < SEQ_Q
        )


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    DQA,
    KB,
    b,
    h,
    bh,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_dob,
    stride_doh,
    stride_dos,
    lo,
    hi,
    offs_n,
    SEQ_Q,
    SEQ_PAD,
    BOUNDS_HI,
    qk_scale,
    sm_scale,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    TMA: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA_REDUCE: tl.constexpr,
):
    """Accumulate dK, dV of one key block over the q blocks [lo, hi) of q head (b, h); CAUSAL (or BOUNDS:
    each query's key interval) masks each tile (only the diagonal ones need it, but one loop beats two
    here: see the kernel).

    Query rows past seq_q load as zero, and their padded lse rows hold +inf, so their probabilities
    are exactly 0. LSE and DELTA rows are read unmasked (padded to SEQ_PAD): masked loads of them
    kept two extra vectors per pipeline stage live and made the causal kernel spill."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _tile_load(Q, b, h, start_m, stride_qb, stride_qh, stride_qs, SEQ_Q, BLOCK_M, D, DP, TMA, True)
        lse = tl.load(LSE + bh.to(tl.int64) * SEQ_PAD + offs_m)
        qkT = tl.dot(k, tl.trans(q))
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if BOUNDS:
            row_lo = tl.load(KB + b.to(tl.int64) * SEQ_PAD + offs_m)
            row_hi = tl.load(KB + BOUNDS_HI + b.to(tl.int64) * SEQ_PAD + offs_m)
            pT = tl.where((offs_n[:, None] >= row_lo[None, :]) & (offs_n[:, None] < row_hi[None, :]), pT, 0.0)
        elif CAUSAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = _tile_load(DO, b, h, start_m, stride_dob, stride_doh, stride_dos, SEQ_Q, BLOCK_M, D, DP, TMA, True)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        delta = tl.load(DELTA + bh.to(tl.int64) * SEQ_PAD + offs_m)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        if DQ_ATOMIC:
            # key rows past seq_k hold k = 0, so they add exactly 0 here
            dq = tl.dot(tl.trans(dsT), k) * sm_scale
            if DQ_TMA_REDUCE:  # one bulk TMA reduce-add per tile (GPU only: not interpreted)
                DQA.atomic_add([b, h, start_m, 0], dq.reshape([1, 1, BLOCK_M, DP]))
            else:
                cols = tl.arange(0, DP)
                ptrs = DQA + (bh.to(tl.int64) * SEQ_Q + offs_m)[:, None] * DP + cols[None, :]
                tl.atomic_add(ptrs, dq, mask=offs_m[:, None] < SEQ_Q, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    # Pointers (TMA descriptors where TMA): q, k, v, do, dk, dv (batch, heads, seq, head_dim); lse, delta
    # (batch, heads_q, SEQ_PAD); dqa, the fp32 dQ accumulator (batch, heads_q, seq_q, DP), added into where
    # DQ_ATOMIC (a descriptor where DQ_TMA_REDUCE); where BOUNDS, kb (each query's key interval, as the
    # forward's) and qr, the q rows [lo, hi) that see each key block (batch, key blocks, 2)
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    DQA,
    KB,
    QR,
    # Sizes
    HQ,  # q heads
    HKV,  # kv heads
    GROUP,  # q heads per kv head
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,  # the per-row state's (lse, delta) row length: seq_q padded to a multiple of MAX_BLOCK_M
    BOUNDS_HI,  # batch * SEQ_PAD: where kb's hi rows start
    # Strides (batch, head, seq) of each 4-D tensor; head_dim is contiguous
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dkb,
    stride_dkh,
    stride_dks,
    stride_dvb,
    stride_dvh,
    stride_dvs,
    # Scales
    qk_scale,  # softmax scale * log2(e)
    sm_scale,  # softmax scale
    # Meta-parameters
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    TMA: tl.constexpr,
    DQ_ATOMIC: tl.constexpr,
    DQ_TMA_REDUCE: tl.constexpr,
):
    """One key block of one kv head; loops over the GROUP q heads that share it (GQA), so dK/dV are
    reduced in registers without atomics.

    Causal: one masked loop from the diagonal on. Splitting off the unmasked blocks (as the
    forward does) put two software pipelines in one kernel, which spilled at 64x128 tiles and ran
    7-10% slower on the H100."""
    n_n = tl.cdiv(SEQ_K, BLOCK_N)  # one axis, a kv head's key blocks side by side (they share Q/dO in L2)
    pid_n = tl.program_id(0) % n_n
    bhk = tl.program_id(0) // n_n
    b = bhk // HKV
    hk = bhk % HKV
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _tile_load(K, b, hk, start_n, stride_kb, stride_kh, stride_ks, SEQ_K, BLOCK_N, D, DP, TMA, True)
    v = _tile_load(V, b, hk, start_n, stride_vb, stride_vh, stride_vs, SEQ_K, BLOCK_N, D, DP, TMA, True)
    dk = tl.zeros([BLOCK_N, DP], tl.float32)
    dv = tl.zeros([BLOCK_N, DP], tl.float32)
    # causal: rows < start_n see none of these keys
    lo = tl.minimum(start_n // BLOCK_M * BLOCK_M, SEQ_Q) if CAUSAL else 0
    hi = SEQ_Q
    if BOUNDS:
        lo = tl.load(QR + (b.to(tl.int64) * n_n + pid_n) * 2)
        hi = tl.load(QR + (b.to(tl.int64) * n_n + pid_n) * 2 + 1)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * HQ + h
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            Q,
            DO,
            LSE,
            DELTA,
            DQA,
            KB,
            b,
            h,
            bh,
            stride_qb,
            stride_qh,
            stride_qs,
            stride_dob,
            stride_doh,
            stride_dos,
            lo,
            hi,
            offs_n,
            SEQ_Q,
            SEQ_PAD,
            BOUNDS_HI,
            qk_scale,
            sm_scale,
            D,
            DP,
            BLOCK_M,
            CAUSAL,
            BOUNDS,
            TMA,
            DQ_ATOMIC,
            DQ_TMA_REDUCE,
        )
    _tile_store(DK, dk * sm_scale, b, hk, start_n, stride_dkb, stride_dkh, stride_dks, SEQ_K, BLOCK_N, D, DP, TMA)
    _tile_store(DV, dv, b, hk, start_n, stride_dvb, stride_dvh, stride_dvs, SEQ_K, BLOCK_N, D, DP, TMA)


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    K,
    V,
    b,
    hk,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    lo,
    hi,
    offs_m,
    row_lo,
    row_hi,
    SEQ_K,
    qk_scale,
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
):
    """Accumulate dQ of one q block over the key blocks [lo, hi); MASKED as in ``_fwd_inner``."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _tile_load(K, b, hk, start_n, stride_kb, stride_kh, stride_ks, SEQ_K, BLOCK_N, D, DP, TMA, MASKED)
        v = _tile_load(V, b, hk, start_n, stride_vb, stride_vh, stride_vs, SEQ_K, BLOCK_N, D, DP, TMA, MASKED)
        qk = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            cols = start_n + offs_n
            if BOUNDS:
                valid = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None])
            else:
                valid = cols[None, :] < SEQ_K
                if CAUSAL:
                    valid = valid & (cols[None, :] <= offs_m[:, None])
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    # Pointers (TMA descriptors where TMA): q, k, v, do, dq (batch, heads, seq, head_dim); lse, delta
    # (batch, heads_q, SEQ_PAD); kb, each query's key interval (as the forward's) where BOUNDS
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    KB,
    # Sizes
    HQ,  # q heads
    GROUP,  # q heads per kv head
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,  # the per-row state's (lse, delta) row length: seq_q padded to a multiple of MAX_BLOCK_M
    BOUNDS_HI,  # batch * SEQ_PAD: where kb's hi rows start
    # Strides (batch, head, seq) of each 4-D tensor; head_dim is contiguous
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dqb,
    stride_dqh,
    stride_dqs,
    # Scales
    qk_scale,  # softmax scale * log2(e)
    sm_scale,  # softmax scale
    # Meta-parameters
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDS: tl.constexpr,
    TMA: tl.constexpr,
):
    """One q block of one q head: dQ over its key range (the portable backward's second pass)."""
    b, h, hk, bh, start_m, offs_m, mid, hi = _q_block(HQ, GROUP, SEQ_Q, SEQ_K, BLOCK_M, BLOCK_N, CAUSAL)
    q = _tile_load(Q, b, h, start_m, stride_qb, stride_qh, stride_qs, SEQ_Q, BLOCK_M, D, DP, TMA, True)
    do = _tile_load(DO, b, h, start_m, stride_dob, stride_doh, stride_dos, SEQ_Q, BLOCK_M, D, DP, TMA, True)
    lse = tl.load(LSE + bh.to(tl.int64) * SEQ_PAD + offs_m)
    delta = tl.load(DELTA + bh.to(tl.int64) * SEQ_PAD + offs_m)
    dq = tl.zeros([BLOCK_M, DP], tl.float32)
    if BOUNDS:
        row_lo, row_hi, lo, a, mid, hi = _bounded_keys(KB, b, BOUNDS_HI, SEQ_PAD, offs_m, BLOCK_N)
        dq = _dq_inner(
            dq, q, do, lse, delta, K, V, b, hk, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            lo, a, offs_m, row_lo, row_hi, SEQ_K, qk_scale, D, DP, BLOCK_N, False, True, True, TMA,
        )  # fmt: skip
    else:
        row_lo, row_hi, a = offs_m, offs_m, 0
    dq = _dq_inner(
        dq, q, do, lse, delta, K, V, b, hk, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        a, mid, offs_m, row_lo, row_hi, SEQ_K, qk_scale, D, DP, BLOCK_N, CAUSAL, BOUNDS, False, TMA,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, K, V, b, hk, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        mid, hi, offs_m, row_lo, row_hi, SEQ_K, qk_scale, D, DP, BLOCK_N, CAUSAL, BOUNDS, True, TMA,
    )  # fmt: skip
    _tile_store(DQ, dq * sm_scale, b, h, start_m, stride_dqb, stride_dqh, stride_dqs, SEQ_Q, BLOCK_M, D, DP, TMA)


@triton.jit
def _attn_bwd_dq_convert_kernel(
    # Pointers: dqa, the fp32 dQ accumulator (batch, heads, seq, DP); dq (batch, heads, seq, head_dim)
    DQA,
    DQ,
    # Sizes
    HQ,
    SEQ_Q,
    # Strides (batch, head, seq) of dq
    stride_dqb,
    stride_dqh,
    stride_dqs,
    # Meta-parameters
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """fp32 atomic dQ accumulator -> dQ in the input dtype."""
    pid_m = tl.program_id(1)
    bh = tl.program_id(0)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, DP)
    row = bh.to(tl.int64) * SEQ_Q + offs_m
    acc = tl.load(DQA + row[:, None] * DP + cols[None, :], mask=offs_m[:, None] < SEQ_Q, other=0.0)
    _tile_store(DQ, acc, bh // HQ, bh % HQ, start_m, stride_dqb, stride_dqh, stride_dqs, SEQ_Q, BLOCK_M, D, DP, False)


# ----------------------------------------------------------------------------------------------
# launch parameters
# ----------------------------------------------------------------------------------------------
def _pow2_bucket(n: int) -> int:
    """Sequence lengths are bucketed so the launch_config memo stays small."""
    return 1 << max(0, (int(n) - 1).bit_length())


# Portable defaults: no TMA, at most ~50 KB of shared memory and 4 warps, so they compile for
# sm80 and sm90 (checked offline, no spills at head_dim 64/128) and run in the interpreter. Tuned
# tiles (NVIDIA's for sm90) come in through the backend's kernel_config hook.
def _fwd_default(dp: int) -> AttentionForward:
    if dp <= 64:
        return AttentionForward(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if dp <= 128:
        return AttentionForward(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return AttentionForward(BLOCK_M=64, BLOCK_N=16, num_warps=4, num_stages=1)


def _dkdv_default(dp: int) -> AttentionBackwardKV:
    if dp <= 64:
        return AttentionBackwardKV(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)
    if dp <= 128:
        return AttentionBackwardKV(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    return AttentionBackwardKV(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def _dq_default(dp: int) -> AttentionBackwardQ:
    if dp <= 64:
        return AttentionBackwardQ(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if dp <= 128:
        return AttentionBackwardQ(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    return AttentionBackwardQ(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


_PREPROCESS_DEFAULT = AttentionPreprocess(BLOCK_M=64, num_warps=4, num_stages=1)


def _problem(q: torch.Tensor, k: torch.Tensor, causal: bool, bounds: torch.Tensor | None = None) -> dict:
    # key bounds (padding, packing, windows) mask like causal does, and take the causal tiles
    return dict(
        head_dim=q.shape[-1],
        causal=bool(causal) or bounds is not None,
        dtype=str(q.dtype),
        seq_q=_pow2_bucket(q.shape[2]),
        seq_k=_pow2_bucket(k.shape[2]),
        group=q.shape[1] // k.shape[1],
    )


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """The output, (batch, heads, seq, head_dim) over (batch, seq, heads, head_dim) memory, as SDPA's
    flash backend returns it: models reshape it to (batch, seq, hidden) with no copy."""
    B, HQ, SQ, D = q.shape
    return q.new_empty((B, SQ, HQ, D)).transpose(1, 2)


def _desc(t: torch.Tensor, rows: int, dp: int):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, dp])


# Per-row fp32 state (lse, delta) is stored with rows padded to a multiple of MAX_BLOCK_M (the largest
# tile the kernel table's attention configs allow), so the backward reads whole tiles of it without
# masks; padded rows hold the value that makes a row contribute nothing (lse = +inf: probability 0;
# delta = 0).
MAX_BLOCK_M = 256


def _padded_len(s: int) -> int:
    return -(-s // MAX_BLOCK_M) * MAX_BLOCK_M


def _padded_rows(b: int, h: int, s: int, fill: float, device) -> torch.Tensor:
    pad = _padded_len(s)
    t = torch.empty((b, h, pad), device=device, dtype=torch.float32)
    if pad > s:
        t[..., s:].fill_(fill)
    return t


def _head_dim_pad(d: int) -> int:
    return max(16, next_pow2(d))


def _padded_bounds(key_bounds: torch.Tensor, seq_k: int) -> torch.Tensor:
    """``(2, batch, seq_q)`` key intervals -> int32 ``(2, batch, SEQ_PAD)``, clipped to [0, seq_k]; padded
    rows are empty intervals, so whole tiles load without masks."""
    _, b, s = key_bounds.shape
    out = torch.zeros((2, b, _padded_len(s)), device=key_bounds.device, dtype=torch.int32)
    out[..., :s] = key_bounds.clamp(0, seq_k)
    return out


def _query_rows(bounds: torch.Tensor, seq_q: int, seq_k: int, block_m: int, block_n: int) -> torch.Tensor:
    """For each key block, the q rows [lo, hi) (whole BLOCK_M blocks) whose intervals reach it: the portable
    dK/dV kernel's loop, int32 ``(batch, key blocks, 2)``."""
    table = query_block_table(bounds, seq_q, seq_k, block_m, block_n)
    return torch.stack((table[..., 0], table[..., 0] + table[..., 3]), -1).mul_(block_m)


def query_block_table(bounds: torch.Tensor, seq_q: int, seq_k: int, block_m: int, tile_n: int) -> torch.Tensor:
    """The backward's q blocks per key tile of ``tile_n`` keys under key bounds (int32 ``(2, batch, padded
    rows)``): int32 ``(batch, key tiles, 4)`` rows (first, a, c, n). The tile walks the q blocks of
    ``block_m`` rows first .. first + n - 1, those that see any of its keys; the blocks [a, c) of those
    (counted from the first) see all of them, so need no mask (the portable dK/dV kernel masks every
    block; a backend's own kernels use [a, c)). A few small torch ops, once per batch (``derived``)."""
    b = bounds.shape[1]
    n_m, n_t = cdiv(seq_q, block_m), cdiv(seq_k, tile_n)
    lo = bounds[0, :, : n_m * block_m].view(b, n_m, block_m)
    hi = bounds[1, :, : n_m * block_m].view(b, n_m, block_m)
    seen = hi > lo
    starts = torch.arange(n_t, device=bounds.device, dtype=bounds.dtype) * tile_n
    block_lo = torch.where(seen, lo, seq_k).amin(-1)[:, :, None]
    block_hi = torch.where(seen, hi, 0).amax(-1)[:, :, None]
    touch = (block_lo < starts + tile_n) & (block_hi > starts)  # (batch, q blocks, key tiles)
    full = (lo.amax(-1)[:, :, None] <= starts) & (hi.amin(-1)[:, :, None] >= starts + tile_n)
    reached = touch.any(1)
    first = torch.where(reached, touch.byte().argmax(1), 0)
    end = torch.where(reached, n_m - touch.flip(1).byte().argmax(1), 0)
    a = torch.where(full.any(1), full.byte().argmax(1), end)
    blocks = torch.arange(n_m, device=bounds.device)[None, :, None]
    after = ~full & (blocks >= a[:, None, :])
    c = torch.minimum(torch.where(after.any(1), after.byte().argmax(1), n_m), end)
    return torch.stack((first, a - first, c - first, end - first), -1).int()


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def attention_forward(q, k, v, causal: bool, scale: float, bounds=None, sinks=None):
    """Launch the forward; returns (out, lse) with lse the base-2 logsumexp of ``q k^T * scale * log2(e)``.

    ``bounds``: the padded key intervals of :func:`_padded_bounds`; ``sinks``: (heads_q,) logits. A backend's
    own kernels are asked (with the bounds) only without sinks."""
    B, HQ, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    DP = _head_dim_pad(D)
    o = _out_like(q)
    lse = _padded_rows(B, HQ, SQ, float("inf"), q.device)
    if o.numel() == 0:
        return o, lse
    own = lookup("attention_forward", backend=backend_for_device(q.device)) if sinks is None else None
    if own is not None and own(q, k, v, o, lse, bool(causal), scale, bounds=bounds):
        return o, lse  # the backend's own kernel (e.g. Hopper's warp-specialized one) ran
    cfg = launch_config(AttentionForward, q.device, lambda: _fwd_default(DP), **_problem(q, k, causal, bounds))
    BM, BN = cfg.BLOCK_M, cfg.BLOCK_N
    tma = cfg.TMA and tma_ok(q, k, v, o)
    if tma:
        q_arg, k_arg, v_arg, o_arg = _desc(q, BM, DP), _desc(k, BN, DP), _desc(v, BN, DP), _desc(o, BM, DP)
    else:
        q_arg, k_arg, v_arg, o_arg = q, k, v, o
    launch(
        _attn_fwd_kernel,
        (B * HQ * cdiv(SQ, BM),),
        # Pointers
        Q=q_arg,
        K=k_arg,
        V=v_arg,
        O=o_arg,
        LSE=lse,
        KB=lse if bounds is None else bounds,
        SINKS=lse if sinks is None else sinks,
        # Sizes
        HQ=HQ,
        GROUP=HQ // HKV,
        SEQ_Q=SQ,
        SEQ_K=SK,
        SEQ_PAD=lse.shape[-1],
        BOUNDS_HI=B * lse.shape[-1],
        # Strides
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qs=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_ks=k.stride(2),
        stride_vb=v.stride(0),
        stride_vh=v.stride(1),
        stride_vs=v.stride(2),
        stride_ob=o.stride(0),
        stride_oh=o.stride(1),
        stride_os=o.stride(2),
        # Scales
        qk_scale=scale * LOG2E,
        # Meta-parameters
        D=D,
        DP=DP,
        BLOCK_M=BM,
        BLOCK_N=BN,
        CAUSAL=bool(causal),
        BOUNDS=bounds is not None,
        HAS_SINKS=sinks is not None,
        SCALE_POS=scale > 0,
        TMA=tma,
        WARP_SPEC=cfg.WARP_SPECIALIZE,
        **cfg.options,
    )
    return o, lse


def attention_backward(do, q, k, v, o, lse, causal: bool, scale: float, bounds=None, sinks=None):
    """Launch the backward; returns (dq, dk, dv, dsinks) (dsinks None without sinks)."""
    B, HQ, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    DP = _head_dim_pad(D)
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the inputs' layouts
    dsinks = None if sinks is None else torch.zeros_like(sinks)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dsinks
    problem = _problem(q, k, causal, bounds)
    cfg_pre = launch_config(AttentionPreprocess, q.device, _PREPROCESS_DEFAULT, **problem)

    def portable_config():
        return launch_config(AttentionBackwardKV, q.device, lambda: _dkdv_default(DP), **problem)

    # a backend's own backward (e.g. Hopper's one-pass warp-specialized kernel) if it takes the
    # problem, else the portable kernels. Asked first: the fp32 dQ accumulator, allocated and zeroed
    # here, is for kernels that add dQ up across key tiles, and a declining backend runs none.
    own = lookup("attention_backward", backend=backend_for_device(q.device)) if sinks is None else None
    runner = own(q, k, v, do, dk, dv, lse, bool(causal), scale, bounds=bounds) if own is not None else None
    accumulate = bool(runner) or portable_config().DQ_ATOMIC
    delta = _padded_rows(B, HQ, SQ, 0.0, q.device)
    dqa = torch.empty((B, HQ, SQ, DP), device=q.device, dtype=torch.float32) if accumulate else delta
    pre_bm = cfg_pre.BLOCK_M
    launch(
        _attn_bwd_pre_kernel,
        (B * HQ, cdiv(SQ, pre_bm)),
        # Pointers
        O=o,
        DO=do,
        DELTA=delta,
        DQA=dqa,
        # Sizes
        HQ=HQ,
        SEQ_Q=SQ,
        SEQ_PAD=lse.shape[-1],
        # Strides
        stride_ob=o.stride(0),
        stride_oh=o.stride(1),
        stride_os=o.stride(2),
        stride_dob=do.stride(0),
        stride_doh=do.stride(1),
        stride_dos=do.stride(2),
        # Meta-parameters
        D=D,
        DP=DP,
        BLOCK_M=pre_bm,
        ZERO_DQA=accumulate,
        **cfg_pre.options,
    )
    if sinks is not None:
        # d(sink_h) = -sum over rows of p_sink * delta, p_sink = exp(sink - lse); padded rows hold lse = +inf
        p_sink = torch.exp2(sinks.float()[None, :, None] * LOG2E - lse)
        dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)

    def dq_from_accumulator():
        launch(
            _attn_bwd_dq_convert_kernel,
            (B * HQ, cdiv(SQ, pre_bm)),
            # Pointers
            DQA=dqa,
            DQ=dq,
            # Sizes
            HQ=HQ,
            SEQ_Q=SQ,
            # Strides
            stride_dqb=dq.stride(0),
            stride_dqh=dq.stride(1),
            stride_dqs=dq.stride(2),
            # Meta-parameters
            D=D,
            DP=DP,
            BLOCK_M=pre_bm,
            **cfg_pre.options,
        )
        return dq, dk, dv, dsinks

    if runner:
        runner(dqa, delta)
        return dq_from_accumulator()
    cfg_kv = portable_config()
    atomic = cfg_kv.DQ_ATOMIC
    qk_scale = scale * LOG2E
    BM, BN = cfg_kv.BLOCK_M, cfg_kv.BLOCK_N
    tma = cfg_kv.TMA and tma_ok(q, k, v, do, dk, dv)
    tma_reduce = atomic and tma and cfg_kv.DQ_TMA_REDUCE
    if tma:
        q_arg, k_arg, v_arg, do_arg = _desc(q, BM, DP), _desc(k, BN, DP), _desc(v, BN, DP), _desc(do, BM, DP)
        dk_arg, dv_arg = _desc(dk, BN, DP), _desc(dv, BN, DP)
    else:
        q_arg, k_arg, v_arg, do_arg, dk_arg, dv_arg = q, k, v, do, dk, dv
    launch(
        _attn_bwd_dkdv_kernel,
        (B * HKV * cdiv(SK, BN),),
        # Pointers
        Q=q_arg,
        K=k_arg,
        V=v_arg,
        DO=do_arg,
        DK=dk_arg,
        DV=dv_arg,
        LSE=lse,
        DELTA=delta,
        DQA=_desc(dqa, BM, DP) if tma_reduce else dqa,
        KB=lse if bounds is None else bounds,
        QR=lse
        if bounds is None
        else derived(bounds, ("rows", SQ, SK, BM, BN), lambda: _query_rows(bounds, SQ, SK, BM, BN)),
        # Sizes
        HQ=HQ,
        HKV=HKV,
        GROUP=HQ // HKV,
        SEQ_Q=SQ,
        SEQ_K=SK,
        SEQ_PAD=lse.shape[-1],
        BOUNDS_HI=B * lse.shape[-1],
        # Strides
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qs=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_ks=k.stride(2),
        stride_vb=v.stride(0),
        stride_vh=v.stride(1),
        stride_vs=v.stride(2),
        stride_dob=do.stride(0),
        stride_doh=do.stride(1),
        stride_dos=do.stride(2),
        stride_dkb=dk.stride(0),
        stride_dkh=dk.stride(1),
        stride_dks=dk.stride(2),
        stride_dvb=dv.stride(0),
        stride_dvh=dv.stride(1),
        stride_dvs=dv.stride(2),
        # Scales
        qk_scale=qk_scale,
        sm_scale=scale,
        # Meta-parameters
        D=D,
        DP=DP,
        BLOCK_M=BM,
        BLOCK_N=BN,
        CAUSAL=bool(causal),
        BOUNDS=bounds is not None,
        TMA=tma,
        DQ_ATOMIC=atomic,
        DQ_TMA_REDUCE=tma_reduce,
        **cfg_kv.options,
    )

    if atomic:
        return dq_from_accumulator()

    cfg_q = launch_config(AttentionBackwardQ, q.device, lambda: _dq_default(DP), **problem)
    BM, BN = cfg_q.BLOCK_M, cfg_q.BLOCK_N
    tma = cfg_q.TMA and tma_ok(q, k, v, do, dq)
    if tma:
        q_arg, k_arg, v_arg, do_arg = _desc(q, BM, DP), _desc(k, BN, DP), _desc(v, BN, DP), _desc(do, BM, DP)
        dq_arg = _desc(dq, BM, DP)
    else:
        q_arg, k_arg, v_arg, do_arg, dq_arg = q, k, v, do, dq
    launch(
        _attn_bwd_dq_kernel,
        (B * HQ * cdiv(SQ, BM),),
        # Pointers
        Q=q_arg,
        K=k_arg,
        V=v_arg,
        DO=do_arg,
        DQ=dq_arg,
        LSE=lse,
        DELTA=delta,
        KB=lse if bounds is None else bounds,
        # Sizes
        HQ=HQ,
        GROUP=HQ // HKV,
        SEQ_Q=SQ,
        SEQ_K=SK,
        SEQ_PAD=lse.shape[-1],
        BOUNDS_HI=B * lse.shape[-1],
        # Strides
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qs=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_ks=k.stride(2),
        stride_vb=v.stride(0),
        stride_vh=v.stride(1),
        stride_vs=v.stride(2),
        stride_dob=do.stride(0),
        stride_doh=do.stride(1),
        stride_dos=do.stride(2),
        stride_dqb=dq.stride(0),
        stride_dqh=dq.stride(1),
        stride_dqs=dq.stride(2),
        # Scales
        qk_scale=qk_scale,
        sm_scale=scale,
        # Meta-parameters
        D=D,
        DP=DP,
        BLOCK_M=BM,
        BLOCK_N=BN,
        CAUSAL=bool(causal),
        BOUNDS=bounds is not None,
        TMA=tma,
        **cfg_q.options,
    )
    return dq, dk, dv, dsinks


# The op. Opaque custom ops under torch.compile, not triton_op: the sm90 launches pass host
# TensorDescriptors, which torch.library's Triton kernel tracing does not take. Inductor calls them
# as they are, with no graph break. The forward returns (out, lse), of which the caller sees out;
# the backward saves q, k, v, out, lse, the padded key bounds and the sinks, and takes causal and scale again.
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    *,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, scale, bounds, sinks)


def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _out_like(q), q.new_empty((q.shape[0], q.shape[1], _padded_len(q.shape[2])), dtype=torch.float32)


def _attention_save(inputs: tuple, outputs: tuple) -> tuple:
    (q, k, v, bounds, sinks, _, _), (o, lse) = inputs, outputs
    return q, k, v, o, lse, bounds, sinks


def _attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    bounds: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    *,
    in_place: bool,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dsinks = attention_backward(do, q, k, v, o, lse, causal, scale, bounds, sinks)
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks  # no sinks: a placeholder no input takes


def _attention_backward_fake(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    bounds: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


ATTENTION = Op(
    "attention",
    forward=_attention,
    fake=_attention_fake,
    save=_attention_save,
    backward=_attention_backward,
    backward_fake=_attention_backward_fake,
    statics=(5, 6),
    grads=(0, 1, 2, None, 3, None, None),
    opaque=True,
)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def check_inputs(op: str, q, k, v, scale, key_bounds, sinks) -> float:
    """What every attention op checks (errors name the op and the argument): q, k, v, key bounds, sinks and the
    scale; returns the resolved scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, ndim=4)
    check_same_device(op, q=q, k=k, v=v)
    check_same_dtype(op, q=q, k=k, v=v)
    if q.dtype == torch.float32 and q.device.type != "cpu":
        raise TypeError(
            f"{op}: argument 'q' has dtype {q.dtype}, not supported on {q.device.type} (float32 "
            "only on the CPU interpreter); use torch.float16 or torch.bfloat16"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{op}: arguments 'k' and 'v' must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    B, HQ, SQ, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"{op}: argument 'k' has batch {k.shape[0]} but 'q' has {B}")
    if k.shape[3] != D:
        raise ValueError(
            f"{op}: argument 'k' has head_dim {k.shape[3]} but 'q' has {D}; q, k and v must share head_dim"
        )
    HKV = k.shape[1]
    if HKV == 0 or HQ % HKV:
        raise ValueError(
            f"{op}: argument 'q' has {HQ} heads, which is not a positive multiple of the {HKV} heads of 'k' and 'v'"
        )
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: argument 'q' has head_dim {D}; supported are 1..{MAX_HEAD_DIM}")
    if key_bounds is not None:
        if not isinstance(key_bounds, torch.Tensor):
            raise TypeError(f"{op}: argument 'key_bounds' must be a torch.Tensor, got {type(key_bounds).__name__}")
        check_same_device(op, q=q, key_bounds=key_bounds)
        if key_bounds.dtype not in (torch.int32, torch.int64) or tuple(key_bounds.shape) != (2, B, SQ):
            raise ValueError(
                f"{op}: argument 'key_bounds' must be an int32 or int64 tensor of shape (2, batch, seq_q) = "
                f"{(2, B, SQ)}, got {key_bounds.dtype} {tuple(key_bounds.shape)}"
            )
    if sinks is not None:
        check_tensor(op, "sinks", sinks, ndim=1)
        check_same_device(op, q=q, sinks=sinks)
        if sinks.shape[0] != HQ or not sinks.dtype.is_floating_point:
            raise ValueError(
                f"{op}: argument 'sinks' must be a floating-point tensor of shape (heads_q,) = ({HQ},), "
                f"got {sinks.dtype} {tuple(sinks.shape)}"
            )
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale == 0:
        raise ValueError(f"{op}: argument 'scale' must be a finite non-zero number, got {scale!r}")
    return float(scale)


def _check(q, k, v, causal, scale, key_bounds, sinks) -> float:
    """Validate the arguments (errors name the argument); returns the resolved scale."""
    if not isinstance(causal, bool):
        raise TypeError(f"attention: argument 'causal' must be a bool, got {type(causal).__name__}")
    if causal and key_bounds is not None:
        raise ValueError(
            "attention: arguments 'causal' and 'key_bounds' exclude each other: key_bounds already says "
            "which keys each query sees (build causal ones with causal_key_bounds)"
        )
    scale = check_inputs("attention", q, k, v, scale, key_bounds, sinks)
    if k.shape[2] == 0 and q.shape[2] > 0 and key_bounds is None:
        raise ValueError("attention: argument 'k' has seq_k = 0; every query needs at least one key")
    return scale


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_bounds: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [+ mask]) v, differentiable in q, k, v (and sinks).

    Args:
        q: ``(batch, heads_q, seq_q, head_dim)``, bfloat16 or float16 (float32 on the CPU interpreter).
        k, v: ``(batch, heads_kv, seq_k, head_dim)``, same dtype and device; ``heads_q % heads_kv == 0``.
        causal: SDPA's ``is_causal``: top-left aligned lower-triangular mask (query i sees keys j <= i).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        key_bounds: the keys each query sees, as one interval: ``(2, batch, seq_q)`` integers, query ``i`` of
            batch ``b`` sees keys ``key_bounds[0, b, i] <= j < key_bounds[1, b, i]`` (clipped to ``[0, seq_k)``).
            Padding, packed sequences, sliding windows and their mixes are such intervals
            (:func:`causal_key_bounds`, :func:`key_bounds_from_mask`); a query that sees no key outputs 0
            and passes no gradient, as SDPA's fully masked rows. Excludes ``causal``.
        sinks: ``(heads_q,)`` logits, one per q head, added to each row's softmax denominator with no value
            (GPT-OSS's attention sinks); differentiable.
    Returns:
        ``(batch, heads_q, seq_q, head_dim)`` in q's dtype, a ``transpose(1, 2)`` view of contiguous
        ``(batch, seq_q, heads_q, head_dim)`` memory (as SDPA's flash backend). The gradients of q, k
        and v come in the layouts of q, k and v (Hugging Face's transposed projections stay copy-free).
    Example:
        >>> out = attention(q, k, v, causal=True)  # doctest: +SKIP
        >>> out = attention(q, k, v, key_bounds=causal_key_bounds(cu_seqlens=cu, window=4096))  # doctest: +SKIP
    """
    scale = _check(q, k, v, causal, scale, key_bounds, sinks)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        # Triton's interpreter (3.6 to 3.9) feeds bf16 tl.dot operands to numpy as their raw uint16
        # bits; computing in fp32 and rounding the result keeps interpreted bf16 calls correct.
        out = attention(q.float(), k.float(), v.float(), causal=causal, scale=scale, key_bounds=key_bounds, sinks=sinks)
        return out.to(torch.bfloat16)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if key_bounds is None:
        bounds = None
    else:
        bounds = derived(key_bounds, ("padded", k.shape[2]), lambda: _padded_bounds(key_bounds, k.shape[2]))
    return ATTENTION(q, k, v, bounds, sinks, causal, scale)


def causal_key_bounds(
    *,
    seq_len: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    window: int | None = None,
    device=None,
) -> torch.Tensor:
    """Causal ``key_bounds`` within sequences, optionally a sliding window: query ``i`` sees keys
    ``max(start, i - window + 1) <= j <= i``, ``start`` the first position of its sequence.

    Sequences come from one of: ``seq_len`` (one sequence, batch 1); ``cu_seqlens`` (FlashAttention's varlen
    layout: sequences packed in batch 1, ``cu_seqlens[0] == 0``, the last entry the token count); or
    ``position_ids`` (``(batch, seq)``: a sequence starts wherever a position is not its predecessor's + 1,
    as transformers' and LLaMA-Factory's packing). ``window`` is transformers' ``sliding_window``.
    """
    given = [
        n
        for n, x in (("seq_len", seq_len), ("cu_seqlens", cu_seqlens), ("position_ids", position_ids))
        if x is not None
    ]
    if len(given) != 1:
        raise ValueError(
            f"causal_key_bounds: pass exactly one of seq_len, cu_seqlens, position_ids (got {given or 'none'})"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"causal_key_bounds: argument 'window' must be a positive int or None, got {window!r}")
    if seq_len is not None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise ValueError(f"causal_key_bounds: argument 'seq_len' must be an int >= 0, got {seq_len!r}")
        pos = torch.arange(seq_len, device=device)[None]
        starts = torch.zeros_like(pos)
    elif cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"causal_key_bounds: argument 'cu_seqlens' must be a 1-D int32/int64 tensor, got "
                f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        cu = cu_seqlens.long()
        lens = cu.diff()
        if int(cu[0]) != 0 or bool((lens < 0).any()):
            raise ValueError("causal_key_bounds: argument 'cu_seqlens' must start at 0 and never decrease")
        total = int(cu[-1])
        pos = torch.arange(total, device=cu.device)[None]
        starts = torch.repeat_interleave(cu[:-1], lens, output_size=total)[None]
    else:
        if position_ids.dim() != 2 or position_ids.dtype.is_floating_point:
            raise ValueError(
                f"causal_key_bounds: argument 'position_ids' must be an integer (batch, seq) tensor, got "
                f"{position_ids.dtype} {tuple(position_ids.shape)}"
            )
        n = position_ids.shape[1]
        pos = torch.arange(n, device=position_ids.device).expand(position_ids.shape[0], n)
        new = torch.ones_like(position_ids, dtype=torch.bool)
        new[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        starts = torch.where(new, pos, 0).cummax(1).values
    lo = starts if window is None else torch.maximum(starts, pos - (window - 1))
    return torch.stack((lo, pos + 1)).int()


def key_bounds_from_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """``key_bounds`` of a boolean mask ``(batch, 1, seq_q, seq_k)`` or ``(batch, seq_q, seq_k)`` (True: attend),
    or None when some query's keys are not one interval (such a mask needs SDPA)."""
    if mask.dtype != torch.bool or mask.dim() not in (3, 4) or (mask.dim() == 4 and mask.shape[1] != 1):
        raise ValueError(
            "key_bounds_from_mask: argument 'mask' must be a bool tensor of shape (batch, 1, seq_q, seq_k) or "
            f"(batch, seq_q, seq_k), got {mask.dtype} {tuple(mask.shape)}"
        )
    mask = mask.reshape(mask.shape[0], mask.shape[-2], mask.shape[-1])
    seq_k = mask.shape[-1]
    count = mask.sum(-1)
    lo = mask.to(torch.int8).argmax(-1)
    hi = seq_k - mask.flip(-1).to(torch.int8).argmax(-1)
    seen = count > 0
    if not bool((~seen | (count == hi - lo)).all()):
        return None
    return torch.stack((torch.where(seen, lo, 0), torch.where(seen, hi, 0))).int()


def attention_ref(q, k, v, *, causal: bool = False, scale: float | None = None, key_bounds=None, sinks=None):
    """float64 reference with the same semantics (GQA, top-left causal, key bounds, sinks); differentiable."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k64 = k64.repeat_interleave(group, dim=1)
        v64 = v64.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    sq, sk = q.shape[2], k.shape[2]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril()
    if key_bounds is not None:
        j = torch.arange(sk, device=q.device)
        keep = (j >= key_bounds[0][..., None]) & (j < key_bounds[1][..., None])  # (batch, seq_q, seq_k)
        keep = keep[:, None]
    empty = ~keep.any(-1, keepdim=True)  # rows that see no key output 0, with no gradient
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    if sinks is not None:
        s = torch.cat((s, sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)), -1)
    p = torch.softmax(s, dim=-1)[..., :sk].masked_fill(empty, 0.0)
    return torch.matmul(p[..., :sk], v64)
