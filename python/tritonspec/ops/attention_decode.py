"""Attention for decode steps, split over the keys (flash-decoding), forward only.

A decode step has a few queries per sequence (one token, or up to :data:`MAX_QUERIES` for speculative
verification) against a long KV cache: the time is reading K and V once, and :mod:`tritonspec.ops.attention`'s
grid (one program per q block of one q head) would run ``batch * heads_q`` programs that each read their kv
head's whole cache, GQA's group re-reading it. Here, as in flash-decoding (Tri Dao, Daniel Haziza, Francisco
Massa, Grigory Sizov, 2023) and FlashAttention-2's split-KV path:

* ``_decode_partial_kernel``, grid ``(batch * heads_kv * row blocks, n_splits)``: one program takes all
  ``G = heads_q // heads_kv`` q heads times ``seq_q`` queries of one kv head as the rows of one tile (padded to
  16 for ``tl.dot``; Llama-3's 32/8 heads give 4 rows per query), so each K/V block is read once for the group,
  and walks one contiguous range of key blocks with an online softmax (fp32, exp2 with log2(e) in the scale).
  It writes its rows' normalized partial output and base-2 logsumexp to an fp32 workspace.
* ``_decode_combine_kernel``, one program per (batch, query, q head) row: rescales the splits' partials by
  their logsumexps, adds the sink (GPT-OSS) to the denominator, writes the output.

``n_splits`` is a host function of (batch, heads_kv, rows, seq_k, the device's SM count) and the launch config:
enough programs for ``programs_per_unit`` per SM, each split at least ``min_split_keys`` keys. Nothing reads
tensor data on the host, so a step is graph-capturable and traces under torch.compile. When one split covers
the keys, the partial kernel writes the output itself (``DIRECT``): the combine would be a second launch, whose
start-up (a microsecond or more even replayed from a CUDA graph; reasoned, not measured) exceeds what reading a
512-key Llama-3 layer's K and V takes at 3 TB/s (2 MB, 0.7 us).

Keys a tile's rows cannot see are not read: with ``key_bounds`` a program walks only the key blocks between its
rows' lowest start and highest end (within its split); with a boolean ``mask`` it first reads its split's mask
to find the first and last key some row of the tile sees, then walks only those blocks, the mask applied
(holes inside cost their reads), so a 32k-slot static cache holding 300 tokens reads 300 tokens of K/V plus
the mask. Every path's key loop is branch-free, so Triton pipelines its K/V loads.

On sm90 the backend's table launches both kernels with programmatic dependent launch (``PDL``): the partial
kernel starts while the kernel before it ends, prefetching its split's first K/V block into L2 before it waits
for that kernel's writes, and lets the combine start once its key loop is done, so the combine's launch
overlaps the partials' stores instead of following them (eager launches, and graphs captured from them; a
launch traced for torch.compile goes without, as :func:`._library.launch` says).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..devices import compute_units
from ..kernel_table import AttentionDecode, AttentionDecodeCombine
from ..launch import launch_config
from ._checks import check_same_device
from ._dependent_launch import prefetch_l2
from ._library import PlanCache, _schema_of, cdiv, launch, library_op, next_pow2, use_library_op
from .attention import LOG2E, _head_dim_pad, check_inputs

__all__ = ["MAX_QUERIES", "attention_decode"]

MAX_QUERIES = 16  # queries per sequence and step: a speculative-decoding verification block at most

_OP = "attention_decode"


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _decode_block(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    cols,
    col_ok,
    valid,
    dims,
    stride_ks,
    stride_vs,
    qk_scale,
    D: tl.constexpr,
    DP: tl.constexpr,
    GUARD: tl.constexpr,
):
    """One key block of the online softmax: scores where ``valid``, -inf elsewhere. GUARD: a row may have seen
    no key yet (mask, bounds), so its running max can be -inf; subtracting 0 then keeps its probabilities 0."""
    offs = cols.to(tl.int64)[:, None]
    if D == DP:
        kv_ok = col_ok[:, None]
    else:
        kv_ok = col_ok[:, None] & (dims[None, :] < D)
    k = tl.load(k_base + offs * stride_ks + dims[None, :], mask=kv_ok, other=0.0)
    s = tl.where(valid, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs * stride_vs + dims[None, :], mask=kv_ok, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _decode_partial_kernel(
    # Pointers: q (batch, heads_q, seq_q, head_dim), k and v (batch, heads_kv, seq_k, head_dim), all by strides
    # (head_dim contiguous); mask (batch, seq_q, seq_k) bools by strides where HAS_MASK; kb the key intervals
    # (2, batch, seq_q) by strides where HAS_BOUNDS; sinks (heads_q,) where HAS_SINKS and DIRECT; po (rows,
    # N_SPLITS, DP) fp32 and plse (rows, N_SPLITS) fp32, each row's partials, rows in the output's (batch,
    # query, q head) order, unless DIRECT; o (batch, heads_q, seq_q, head_dim) by strides where DIRECT
    Q,
    K,
    V,
    MASK,
    KB,
    SINKS,
    PO,
    PLSE,
    O,
    # Sizes
    HQ,
    HKV,
    GROUP,  # q heads per kv head
    SEQ_Q,
    SEQ_K,
    ROW_BLOCKS,  # tiles of BLOCK_M rows per kv head: cdiv(GROUP * SEQ_Q, BLOCK_M)
    BLOCKS_PER_SPLIT,  # key blocks of BLOCK_N per split
    N_SPLITS,
    # Strides
    stride_qb,
    stride_qh,
    stride_qs,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_mb,
    stride_mq,
    stride_mk,
    stride_bw,  # key bounds: lo -> hi
    stride_bb,
    stride_bq,
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
    HAS_MASK: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One kv head's rows (its q heads x queries, row = query * GROUP + head in group) over one split's keys."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rb = pid % ROW_BLOCKS
    bhk = pid // ROW_BLOCKS
    b = bhk // HKV
    hk = bhk % HKV
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * SEQ_Q
    qi = rows // GROUP
    h = hk * GROUP + rows % GROUP
    dims = tl.arange(0, DP)
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64: the softmax stays fp32
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    if PDL:
        # Launched while the kernel before ends: the split's first K/V block into L2 (the cache's older keys;
        # the newest may be that kernel's write, which L2 then holds), then wait for its writes.
        keys = tl.minimum(split * (BLOCKS_PER_SPLIT * BLOCK_N) + offs_n, SEQ_K - 1).to(tl.int64)[:, None]
        lines = tl.minimum(tl.arange(0, (DP + 63) // 64) * 64, D - 1)[None, :]  # 128-byte lines, 16-bit K/V
        prefetch_l2(k_base + keys * stride_ks + lines)
        prefetch_l2(v_base + keys * stride_vs + lines)
        gdc_wait()
    q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh + qi[:, None] * stride_qs
    q = tl.load(q_ptrs + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)

    lo = split * (BLOCKS_PER_SPLIT * BLOCK_N)
    hi = tl.minimum(lo + BLOCKS_PER_SPLIT * BLOCK_N, SEQ_K)
    if HAS_BOUNDS:
        kb = KB + b.to(tl.int64) * stride_bb + qi * stride_bq
        row_lo = tl.minimum(tl.maximum(tl.load(kb, mask=row_ok, other=0), 0), SEQ_K).to(tl.int32)
        row_hi = tl.minimum(tl.maximum(tl.load(kb + stride_bw, mask=row_ok, other=0), 0), SEQ_K).to(tl.int32)
        seen = row_hi > row_lo
        # only the blocks some row of the tile sees
        lo = tl.maximum(lo, tl.min(tl.where(seen, row_lo, SEQ_K), 0) // BLOCK_N * BLOCK_N)
        hi = tl.minimum(hi, tl.max(tl.where(seen, row_hi, 0), 0))
    else:
        row_lo = rows
        row_hi = rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    m_base = MASK + b.to(tl.int64) * stride_mb + qi.to(tl.int64)[:, None] * stride_mq
    if HAS_MASK:  # narrow [lo, hi) to the keys some row of the tile sees (mask loads only: they pipeline)
        first = hi
        last = lo
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            seen_here = tl.load(
                m_base + cols.to(tl.int64)[None, :] * stride_mk, mask=row_ok[:, None] & (cols < hi)[None, :], other=0
            )
            col_seen = tl.max((seen_here != 0).to(tl.int32), 0) > 0
            first = tl.minimum(first, tl.min(tl.where(col_seen, cols, hi), 0))
            last = tl.maximum(last, tl.max(tl.where(col_seen, cols + 1, lo), 0))
        lo = first // BLOCK_N * BLOCK_N
        hi = last
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < SEQ_K
        if HAS_MASK:
            seen_here = tl.load(
                m_base + cols.to(tl.int64)[None, :] * stride_mk, mask=row_ok[:, None] & col_ok[None, :], other=0
            )
            valid = seen_here != 0
        elif HAS_BOUNDS:
            valid = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None])
        else:
            valid = col_ok[None, :]
        acc, l_i, m_i = _decode_block(
            acc, l_i, m_i, q, k_base, v_base, cols, col_ok, valid, dims, stride_ks, stride_vs, qk_scale,
            D, DP, HAS_BOUNDS or HAS_MASK,
        )  # fmt: skip
    if PDL:  # the combine may start: this program's loads are done
        gdc_launch_dependents()

    if DIRECT:
        if HAS_SINKS:
            sink = tl.load(SINKS + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.math.exp2(sink - m_sub)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key: acc is 0, so is out
        o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64)[:, None] * stride_oh + qi[:, None] * stride_os
        tl.store(o_ptrs + dims[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dims[None, :] < D))
    else:
        seen_any = l_i > 0.0
        lse = tl.where(seen_any, m_i + tl.math.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
        slot = ((b.to(tl.int64) * SEQ_Q + qi) * HQ + h) * N_SPLITS + split
        tl.store(PLSE + slot, lse, mask=row_ok)
        tl.store(PO + slot[:, None] * DP + dims[None, :], out, mask=row_ok[:, None])


@triton.jit
def _decode_combine_kernel(
    # Pointers: po (rows, N_SPLITS, DP) and plse (rows, N_SPLITS), the partial kernel's; sinks (heads_q,) where
    # HAS_SINKS; o (batch, heads_q, seq_q, head_dim) by strides
    PO,
    PLSE,
    SINKS,
    O,
    # Sizes
    HQ,
    SEQ_Q,
    N_SPLITS,
    # Strides
    stride_ob,
    stride_oh,
    stride_os,
    # Meta-parameters
    D: tl.constexpr,
    DP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (batch, query, q head) row: sum_s 2^(lse_s - M) o_s / (sum_s 2^(lse_s - M) + 2^(sink - M)), in one
    pass over the splits (a running max rescales what was summed), so BLOCK_S >= N_SPLITS loads each partial
    once with no dependent second round of loads."""
    row = tl.program_id(0).to(tl.int64)
    h = row % HQ
    qi = (row // HQ) % SEQ_Q
    b = row // (HQ * SEQ_Q)
    offs_s = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, DP)
    base = row * N_SPLITS
    m = tl.full([1], float("-inf"), tl.float32)
    if HAS_SINKS:  # a parameter, not the partial kernel's: read before the wait
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    if PDL:  # launched while the partial kernel ends: its partials are complete after the wait
        gdc_wait()
    acc = tl.zeros([DP], tl.float32)
    total = tl.zeros([1], tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        s = s0 + offs_s
        s_ok = s < N_SPLITS
        lse = tl.load(PLSE + base + s, mask=s_ok, other=float("-inf"))
        o = tl.load(PO + (base + s)[:, None] * DP + dims[None, :], mask=s_ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every weight 0
        alpha = tl.math.exp2(m - m_sub)
        w = tl.math.exp2(lse - m_sub)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    if HAS_SINKS:
        total += tl.math.exp2(sink - tl.where(m == float("-inf"), 0.0, m))
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_ptrs = O + b * stride_ob + h * stride_oh + qi * stride_os + dims
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=dims < D)


# ----------------------------------------------------------------------------------------------
# launch parameters
# ----------------------------------------------------------------------------------------------
def _default(dp: int, rows: int) -> AttentionDecode:
    """Portable: a 16-row tile (one MMA's height) for the usual step, at most 64 rows (more rows take more row
    blocks: 128 x 128 on 8 warps spilled on sm80), 8 warps past 32 rows x 128 dims (64 x 128 on 4 warps took
    218 to 255 registers), two K/V stages of 16 KB each. ``tritonspec check --kernels`` shows each's resources."""
    block_m = max(16, min(next_pow2(rows), 64))
    return AttentionDecode(
        BLOCK_M=block_m,
        BLOCK_N=64 if dp <= 128 else 32,
        num_warps=4 if block_m * dp <= 32 * 128 else 8,
        num_stages=2,
    )


def _combine_default(dp: int, n_splits: int) -> AttentionDecodeCombine:
    """Every split's partial in one step up to 64 (64 x 128 fp32 on 4 warps: 64 registers a thread)."""
    return AttentionDecodeCombine(BLOCK_S=max(2, min(64, next_pow2(n_splits))), num_warps=4 if dp >= 128 else 2)


def _pow2_bucket(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def splits(programs: int, seq_k: int, units: int, cfg: AttentionDecode) -> tuple[int, int]:
    """(n_splits, key blocks per split) for ``programs`` (batch x kv heads x row blocks) over ``seq_k`` keys.

    As many splits as bring the grid to ``programs_per_unit`` programs per SM but not past them (flash-decoding
    fills the GPU when batch x heads cannot; a part of a second wave of programs would wait on the first), each
    at least ``min_split_keys`` keys, and no empty split."""
    n_blocks = max(1, cdiv(seq_k, cfg.BLOCK_N))
    most = max(1, n_blocks // max(1, cdiv(cfg.min_split_keys, cfg.BLOCK_N)))
    wanted = max(1, cfg.programs_per_unit * units // max(1, programs))
    per = cdiv(n_blocks, max(1, min(wanted, most)))
    return cdiv(n_blocks, per), per


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
# Eager LaunchPlans (see _launch_cache): a decoder repeats one step's shapes every layer and step, and at
# decode sizes the host's time per launch is what the step waits on. key -> (partial plan, combine plan or
# None, n_splits).
_PLANS = PlanCache()


def _problem(q, k, mask, key_bounds) -> dict:
    return dict(
        head_dim=q.shape[-1],
        dtype=str(q.dtype),
        group=q.shape[1] // k.shape[1],
        seq_q=q.shape[2],
        seq_k=_pow2_bucket(k.shape[2]),
        keys="mask" if mask is not None else "bounds" if key_bounds is not None else "all",
    )


def _tensors(q, k, v, mask, key_bounds, sinks, work, out):
    """Each kernel's tensor arguments in parameter order (absent ones stand in as the workspace or output:
    never read), and the workspace's partial outputs / logsumexps."""
    po, plse = work
    partial = (q, k, v, out if mask is None else mask, out if key_bounds is None else key_bounds)
    partial += (out if sinks is None else sinks, po, plse, out)
    return partial, (po, plse, out if sinks is None else sinks, out)


def _workspace(out, rows: int, n_splits: int, dp: int, traced: bool):
    """The partial outputs and logsumexps: one fp32 allocation eagerly, two when traced (torch.compile then
    sees two written tensors, not two views of one, which its functionalization would copy around). DIRECT has
    none: the output stands in, a placeholder no kernel touches and a tensor the launch writes anyway, so no
    input looks written to torch.library's analysis of the kernels."""
    if n_splits == 1:
        return out, out
    if traced:
        po = torch.empty(rows * n_splits * dp, device=out.device, dtype=torch.float32)
        return po, torch.empty(rows * n_splits, device=out.device, dtype=torch.float32)
    work = torch.empty(rows * n_splits * (dp + 1), device=out.device, dtype=torch.float32)
    return work[: rows * n_splits * dp], work[rows * n_splits * dp :]


def _forward(q, k, v, mask, key_bounds, sinks, scale: float, *, traced: bool) -> torch.Tensor:
    """Launch the partial (and, over several splits, the combine) kernel; ``mask`` is (batch, 1, seq_q, seq_k)
    by strides (broadcast dims stride 0)."""
    B, HQ, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    DP = _head_dim_pad(D)
    out = q.new_empty((B, SQ, HQ, D)).transpose(1, 2)
    if out.numel() == 0:
        return out
    if SK == 0:  # no key for any query: zeros, and no launch over K/V pointers that may be null
        return out.zero_()
    rows = B * SQ * HQ
    key = None
    if not traced:
        key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, scale, q.device)
        key += tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in (mask, key_bounds, sinks))
        plans = _PLANS.get(key)
        if plans is not None:
            partial, combine, n_splits = plans
            first, second = _tensors(q, k, v, mask, key_bounds, sinks, _workspace(out, rows, n_splits, DP, False), out)
            if partial(*first) and (combine is None or combine(*second)):
                return out
    cfg = launch_config(
        AttentionDecode, q.device, lambda: _default(DP, (HQ // HKV) * SQ), **_problem(q, k, mask, key_bounds)
    )
    row_blocks = cdiv((HQ // HKV) * SQ, cfg.BLOCK_M)
    n_splits, per_split = splits(B * HKV * row_blocks, SK, compute_units(q.device), cfg)
    work = _workspace(out, rows, n_splits, DP, traced)
    (Q, K, V, MASK, KB, SINKS, PO, PLSE, O), second = _tensors(q, k, v, mask, key_bounds, sinks, work, out)
    m_strides = (mask.stride(0), mask.stride(2), mask.stride(3)) if mask is not None else (0, 0, 0)
    b_strides = key_bounds.stride() if key_bounds is not None else (0, 0, 0)
    partial = launch(
        _decode_partial_kernel,
        (B * HKV * row_blocks, n_splits),
        # Pointers
        Q=Q,
        K=K,
        V=V,
        MASK=MASK,
        KB=KB,
        SINKS=SINKS,
        PO=PO,
        PLSE=PLSE,
        O=O,
        # Sizes
        HQ=HQ,
        HKV=HKV,
        GROUP=HQ // HKV,
        SEQ_Q=SQ,
        SEQ_K=SK,
        ROW_BLOCKS=row_blocks,
        BLOCKS_PER_SPLIT=per_split,
        N_SPLITS=n_splits,
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
        stride_mb=m_strides[0],
        stride_mq=m_strides[1],
        stride_mk=m_strides[2],
        stride_bw=b_strides[0],
        stride_bb=b_strides[1],
        stride_bq=b_strides[2],
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_os=out.stride(2),
        # Scales
        qk_scale=scale * LOG2E,
        # Meta-parameters
        D=D,
        DP=DP,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        HAS_MASK=mask is not None,
        HAS_BOUNDS=key_bounds is not None,
        HAS_SINKS=sinks is not None,
        DIRECT=n_splits == 1,
        PDL=cfg.PDL,
        **cfg.options,
        traced=traced,
        plan=not traced,
    )
    combine = None
    if n_splits > 1:
        cfg_c = launch_config(
            AttentionDecodeCombine, q.device, lambda: _combine_default(DP, n_splits), head_dim=D, splits=n_splits
        )
        PO, PLSE, SINKS, O = second
        combine = launch(
            _decode_combine_kernel,
            (rows,),
            # Pointers
            PO=PO,
            PLSE=PLSE,
            SINKS=SINKS,
            O=O,
            # Sizes
            HQ=HQ,
            SEQ_Q=SQ,
            N_SPLITS=n_splits,
            # Strides
            stride_ob=out.stride(0),
            stride_oh=out.stride(1),
            stride_os=out.stride(2),
            # Meta-parameters
            D=D,
            DP=DP,
            BLOCK_S=cfg_c.BLOCK_S,
            HAS_SINKS=sinks is not None,
            PDL=cfg_c.PDL,
            **cfg_c.options,
            traced=traced,
            plan=not traced,
        )
    if key is not None and partial is not None and (n_splits == 1 or combine is not None):
        _PLANS[key] = (partial, combine, n_splits)
    return out


# The op under torch.compile: forward only, so one torch.library op (a triton_op where kernels are compiled,
# so Inductor sees the two Triton launches; an opaque custom_op under the interpreter).
def _attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    scale: float,
    *,
    traced: bool,
) -> torch.Tensor:
    return _forward(q, k, v, mask, key_bounds, sinks, scale, traced=traced)


def _attention_decode_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    key_bounds: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    B, HQ, SQ, D = q.shape
    return q.new_empty((B, SQ, HQ, D)).transpose(1, 2)


def _traced_impl(*inputs):
    return _attention_decode(*inputs, traced=True)


ATTENTION_DECODE = library_op(_OP, _traced_impl, _attention_decode_fake, _schema_of(_attention_decode, f"op {_OP!r}"))


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def _check(q, k, v, scale, mask, key_bounds, sinks) -> float:
    """Validate the arguments (errors name the argument); returns the resolved scale."""
    op = _OP
    if mask is not None and key_bounds is not None:
        raise ValueError(
            f"{op}: arguments 'mask' and 'key_bounds' exclude each other: each says which keys each query sees"
        )
    scale = check_inputs(op, q, k, v, scale, key_bounds, sinks)
    B, _, SQ, _ = q.shape
    if not 1 <= SQ <= MAX_QUERIES:
        raise ValueError(
            f"{op}: argument 'q' has seq_q = {SQ}; supported are 1..{MAX_QUERIES} queries a step "
            "(tritonspec.ops.attention takes longer query blocks, e.g. a prefill)"
        )
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{op}: argument 'mask' must be a torch.Tensor, got {type(mask).__name__}")
        check_same_device(op, q=q, mask=mask)
        shape, target = tuple(mask.shape), (B, 1, SQ, k.shape[2])
        fits = len(shape) <= 4 and all(n in (1, t) for n, t in zip(shape[::-1], target[::-1]))
        if mask.dtype != torch.bool or not fits:
            raise ValueError(
                f"{op}: argument 'mask' must be a bool tensor (True: attend) broadcastable to (batch, 1, seq_q, "
                f"seq_k) = {target}, got {mask.dtype} {shape}"
            )
    return scale


def _check_no_grad(q, k, v, sinks) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{_OP}: argument '{name}' requires grad, but attention_decode is forward only (inference): "
                "use tritonspec.ops.attention for gradients, or call it under torch.no_grad() / "
                "torch.inference_mode()"
            )


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    key_bounds: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale [masked]) v for a decode step: K and V read once, split over the keys.

    Args:
        q: ``(batch, heads_q, seq_q, head_dim)`` with ``1 <= seq_q <= MAX_QUERIES``, bfloat16 or float16
            (float32 on the CPU interpreter); any strides with a contiguous last dim.
        k, v: ``(batch, heads_kv, seq_k, head_dim)``, same dtype and device, ``heads_q % heads_kv == 0`` (q head
            ``h`` reads kv head ``h // (heads_q // heads_kv)``); any strides with a contiguous last dim, e.g. a
            view of a static KV cache or a transposed ``(batch, seq, heads, dim)`` tensor.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        mask: bool, broadcastable to ``(batch, 1, seq_q, seq_k)`` (SDPA's boolean ``attn_mask``, True: attend;
            what transformers builds for a static cache). Any pattern; key blocks no query of a program
            attends to are not read.
        key_bounds: ``(2, batch, seq_q)`` int32/int64: query ``i`` of batch ``b`` sees keys
            ``key_bounds[0, b, i] <= j < key_bounds[1, b, i]`` (clipped to ``[0, seq_k)``). Excludes ``mask``.
            Neither: every query sees all ``seq_k`` keys.
        sinks: ``(heads_q,)`` logits added to each row's softmax denominator with no value (GPT-OSS).
    Returns:
        ``(batch, heads_q, seq_q, head_dim)`` in q's dtype, a ``transpose(1, 2)`` view of contiguous
        ``(batch, seq_q, heads_q, head_dim)`` memory (as :func:`tritonspec.ops.attention`). A query that sees no
        key outputs 0. Forward only: with grad enabled, inputs that require grad are an error.
    """
    scale = _check(q, k, v, scale, mask, key_bounds, sinks)
    _check_no_grad(q, k, v, sinks)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        # Triton's interpreter (3.6 to 3.9) feeds bf16 tl.dot operands to numpy as their raw uint16 bits:
        # compute in float32 and round the result, as tritonspec.ops.attention does.
        out = attention_decode(
            q.float(), k.float(), v.float(), scale=scale, mask=mask, key_bounds=key_bounds, sinks=sinks
        )
        return out.to(torch.bfloat16)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if mask is not None:
        mask = mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    if use_library_op():
        return ATTENTION_DECODE(q, k, v, mask, key_bounds, sinks, scale)
    return _forward(q, k, v, mask, key_bounds, sinks, scale, traced=False)
