"""Hopper's attention forward: a warp-specialized, persistent Gluon kernel the ``tl`` kernels cannot express.

Why a second kernel: in the portable kernel both warpgroups of a CTA share one software pipeline, so
every key block ends in a CTA-wide barrier and the two run in lockstep: both wait on q.k^T, both
compute the softmax while the tensor cores idle. Here the CTA holds 128 query rows split over two
consumer warpgroups (64 rows each) and one producer warp that streams K/V through a TMA ring guarded
by mbarriers. Nothing ties the consumers to each other, so one's softmax runs under the other's
matmuls. On an H100 this took the head_dim-128 forward from 450-500 to 550-610 TFLOP/s, cuDNN's
speed. The forward is persistent (a CTA per SM walks its list of query tiles, ``schedule.fwd_schedule``):
each tile's Q and K/V load while the previous tile finishes and its output leaves, which took the
2048-token causal shapes from 93-95% of cuDNN's speed to 102-107% (GPU time).

Imported only where Gluon's Hopper API is (``gluon_compat.GLUON``); ``launchers`` launches it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..gluon_compat import thread_barrier, tma_load, tma_store


@gluon.jit
def _to_pairs(x, dtype: gl.constexpr):
    """x.to(dtype) for 16-bit dtypes, two columns per instruction straight into the packed register
    the wgmma A operand reads (``.to`` converts one at a time and ptxas then swaps the halves of
    every pair: a PRMT per register per step)."""
    if dtype == gl.bfloat16:
        y = gl.inline_asm_elementwise(
            "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16, is_pure=True, pack=2
        )
    else:
        y = gl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16, is_pure=True, pack=2
        )
    return y


@gluon.jit
def _softmax(
    s,
    m_i,
    l_i,
    qk_scale,
    j,
    offs_m,
    lo,
    hi,
    SEQ_K,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
    MASKED: gl.constexpr,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    dtype: gl.constexpr,
):
    """Online-softmax step on the raw scores of key block j: (p as p.v's A operand, alpha, m, l).
    With BOUNDS, row r sees the block's columns [lo[r], hi[r]) (``_block_bounds``) and may have seen
    no key yet: its max is then -inf, and subtracting 0 instead keeps its probabilities 0 rather than NaN.

    Valid only for qk_scale > 0 (the row max is taken before scaling); the launcher checks."""
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if MASKED and BOUNDS:
        # two compares a score: the block's own column against the row's interval, shifted to the block
        c = gl.expand_dims(cols, 0)
        s = gl.where((c >= gl.expand_dims(lo, 1)) & (c < gl.expand_dims(hi, 1)), s, float("-inf"))
    elif MASKED:
        # one compare a score: the block's own column against the row's last visible one
        if CAUSAL:
            last = gl.minimum(offs_m, SEQ_K - 1) - j * BLOCK_N
        else:
            last = gl.full_like(offs_m, SEQ_K - 1 - j * BLOCK_N)
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if MASKED and BOUNDS:
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    p = gl.convert_layout(_to_pairs(p, dtype), p_layout)
    return p, alpha, m_new, l_i


@gluon.jit
def _block_bounds(kb_lo, kb_hi, offs_m, block, BLOCK_N: gl.constexpr, BOUNDS: gl.constexpr, MASKED: gl.constexpr):
    """Where the mask takes key bounds, the rows' intervals shifted to key block ``block``'s columns, read
    (from L1) where the mask needs them: read before the step's waits on its matmuls, the causal tiles as
    key bounds ran at 581 TFLOP/s instead of 656 on an H200."""
    if MASKED and BOUNDS:
        lo = gl.load(kb_lo + offs_m) - block * BLOCK_N
        hi = gl.load(kb_hi + offs_m) - block * BLOCK_N
    else:
        lo = offs_m
        hi = offs_m
    return lo, hi


@gluon.jit
def _consume_blocks(
    acc,
    p,
    m_i,
    l_i,
    s0,
    q,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    lo,
    hi,
    ring,
    first,
    rot,
    n,
    qk_scale,
    offs_m,
    kb_lo,
    kb_hi,
    SEQ_K,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
    MASKED: gl.constexpr,
    s_layout: gl.constexpr,
    p_layout: gl.constexpr,
    row_o: gl.constexpr,
):
    """Steps lo..hi-1: q.k^T of block j+1 and p.v of block j in flight together, then the softmax of j+1.
    Block j is the tile's jth (key block ``first + (rot + j) % n``: ``_bounded_tile``) and sits in ring slot
    ``ring + j`` (the K/V blocks of the CTA's earlier tiles came first)."""
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    D: gl.constexpr = k_smem.shape[4]
    NSTAGES: gl.constexpr = k_smem.shape[0]
    for j in range(lo, hi):
        if BOUNDS:
            block = _wrapped(first, rot + j + 1, n)
        else:
            block = j + 1
        stage = (ring + j) % NSTAGES
        nstage = (ring + j + 1) % NSTAGES
        mbarrier.wait(k_ready.index(nstage), ((ring + j + 1) // NSTAGES) & 1)
        s = warpgroup_mma(
            q, k_smem.index(nstage).reshape([BLOCK_N, D]).permute((1, 0)), s0, use_acc=False, is_async=True
        )
        mbarrier.wait(v_ready.index(stage), ((ring + j) // NSTAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_N, D]), acc, is_async=True)
        s, p = warpgroup_mma_wait(1, deps=(s, p))
        mbarrier.arrive(k_empty.index(nstage), count=1)
        row_lo, row_hi = _block_bounds(kb_lo, kb_hi, offs_m, block, BLOCK_N, BOUNDS, MASKED)
        p_next, alpha, m_i, l_i = _softmax(
            s,
            m_i,
            l_i,
            qk_scale,
            block,
            offs_m,
            row_lo,
            row_hi,
            SEQ_K,
            BLOCK_N,
            CAUSAL,
            BOUNDS,
            MASKED,
            s_layout,
            p_layout,
            q.dtype,
        )
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(stage), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p = p_next
    return acc, p, m_i, l_i


@gluon.jit
def _wrapped(first, r, n):
    """Key block ``first + r % n`` for 0 <= r < 2n, without the integer division."""
    return first + r - (r >= n).to(gl.int32) * n


@gluon.jit
def _fwd_tile(t, SEQ_K, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query tile t of a head: its first row, its key blocks and the first that needs the mask."""
    start_m = t * BLOCK_M
    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, SEQ_K)  # top-left aligned, as SDPA's is_causal
        mask_from = gl.minimum(start_m, SEQ_K) // BLOCK_N
    else:
        hi = SEQ_K
        mask_from = SEQ_K // BLOCK_N
    return start_m, gl.cdiv(hi, BLOCK_N), mask_from


@gluon.jit
def _bounded_tile(TILES, code, n_m, HQ):
    """Under key bounds, the query tile ``code``'s key blocks (TILES' row ``b * n_m + t``, ``launchers``):
    its n blocks from ``first``, walked from block ``first + rot`` on and around (``_wrapped``), and the
    first of those that needs the mask, after which all do. The blocks [a, c) of TILES need no mask:
    walked from a, the masked head [0, a) comes after the masked tail, and the masked blocks run in one
    loop (a third loop for the head took ptxas past the consumers' registers: 28 bytes spilled)."""
    entry = TILES + (code // n_m // HQ * n_m + code % n_m) * 4
    rot = gl.load(entry + 1)
    return gl.load(entry), rot, gl.load(entry + 3), gl.load(entry + 2) - rot


@gluon.jit
def _fwd_consumer(
    o_desc,
    LSE,
    KB,
    TILES,
    q_smem,
    o_smem,
    k_smem,
    v_smem,
    q_bars,
    q_empty,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    SCHED,
    HQ,
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,
    BOUNDS_HI,
    qk_scale,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
    C: gl.constexpr,
):
    """Warpgroup C: query rows C*HALF_M .. +HALF_M of each of the CTA's tiles against their key blocks.
    Q is double-buffered (tile t in buffer t % 2), so the next tile's Q arrives while this one runs;
    the output leaves through o_smem by TMA while the next tile runs."""
    WGS: gl.constexpr = q_smem.shape[0] // 2
    HALF_M: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    NSTAGES: gl.constexpr = k_smem.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_tile = o_smem.index(C)
    s0 = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)

    n_m = gl.cdiv(SEQ_Q, WGS * HALF_M)
    begin = gl.load(SCHED + gl.program_id(0))  # the CTA's tiles: SCHED[begin:end] (``fwd_schedule``)
    end = gl.load(SCHED + gl.program_id(0) + 1)
    code = gl.load(SCHED + begin)
    ring = 0  # K/V blocks of the CTA's earlier tiles: the ring slot of this tile's first
    done = 0  # the CTA's earlier tiles: the Q barrier's phase
    if BOUNDS:  # each tile's TILES row is read a tile ahead, as its code: the loads' latency hides under a tile
        next_first, next_rot, next_n, next_mask_from = _bounded_tile(TILES, code, n_m, HQ)
    for i in range(begin, end):
        following = gl.load(SCHED + i + 1)  # the next tile's, read ahead (the table ends in a spare entry)
        bh = code // n_m
        b = bh // HQ
        h = bh % HQ
        if BOUNDS:
            start_m = code % n_m * (WGS * HALF_M)
            first, rot, n, mask_from = next_first, next_rot, next_n, next_mask_from
            next_first, next_rot, next_n, next_mask_from = _bounded_tile(TILES, following, n_m, HQ)
        else:
            first = 0
            rot = 0
            start_m, n, mask_from = _fwd_tile(code % n_m, SEQ_K, CAUSAL, WGS * HALF_M, BLOCK_N)
        row0 = start_m + C * HALF_M
        offs_m = row0 + gl.arange(0, HALF_M, layout=row_s)
        kb_lo = KB + b.to(gl.int64) * SEQ_PAD  # with BOUNDS, the rows' key intervals (padding: empty)
        kb_hi = kb_lo + BOUNDS_HI
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
        acc = gl.zeros([HALF_M, D], gl.float32, layout=o_layout)

        q_buf = (done % 2) * WGS + C
        q = q_smem.index(q_buf).reshape([HALF_M, D])
        mbarrier.wait(q_bars.index(q_buf), (done // 2) & 1)
        slot = ring % NSTAGES
        mbarrier.wait(k_ready.index(slot), (ring // NSTAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, D]).permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot), count=1)
        row_lo, row_hi = _block_bounds(kb_lo, kb_hi, offs_m, first + rot, BLOCK_N, BOUNDS, True)
        if mask_from <= 0:
            p, alpha, m_i, l_i = _softmax(
                s, m_i, l_i, qk_scale, first + rot, offs_m, row_lo, row_hi, SEQ_K,
                BLOCK_N, CAUSAL, BOUNDS, True, s_layout, p_layout, q.dtype,
            )  # fmt: skip
        else:
            p, alpha, m_i, l_i = _softmax(
                s, m_i, l_i, qk_scale, first + rot, offs_m, row_lo, row_hi, SEQ_K,
                BLOCK_N, CAUSAL, BOUNDS, False, s_layout, p_layout, q.dtype,
            )  # fmt: skip
        # key block j+1 needs the mask iff j+1 >= mask_from: two loops keep the mask out of the first
        split = gl.maximum(gl.minimum(mask_from - 1, n - 1), 0)
        acc, p, m_i, l_i = _consume_blocks(
            acc, p, m_i, l_i, s0, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
            0, split, ring, first, rot, n, qk_scale, offs_m, kb_lo, kb_hi, SEQ_K,
            CAUSAL, BOUNDS, False, s_layout, p_layout, row_o,
        )  # fmt: skip
        acc, p, m_i, l_i = _consume_blocks(
            acc, p, m_i, l_i, s0, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
            split, n - 1, ring, first, rot, n, qk_scale, offs_m, kb_lo, kb_hi, SEQ_K,
            CAUSAL, BOUNDS, True, s_layout, p_layout, row_o,
        )  # fmt: skip
        mbarrier.arrive(q_empty.index(q_buf), count=1)  # every q.k^T is done: a later tile's Q may load
        last = ring + n - 1
        stage = last % NSTAGES
        mbarrier.wait(v_ready.index(stage), (last // NSTAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_N, D]), acc, is_async=True)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        mbarrier.arrive(v_empty.index(stage), count=1)

        if BOUNDS:
            # a row that sees no key: output 0 (as SDPA's fully masked rows), lse +inf (probability 0 in the backward)
            empty = l_i == 0.0
            l_i = gl.where(empty, 1.0, l_i)
            lse = gl.where(empty, float("inf"), m_i + gl.log2(l_i))
        else:
            lse = m_i + gl.log2(l_i)
        gl.store(LSE + bh.to(gl.int64) * SEQ_PAD + offs_m, lse, mask=offs_m < SEQ_Q)
        out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
        tma.store_wait(0)  # the previous tile's output has left o_smem
        thread_barrier()
        o_tile.reshape([HALF_M, D]).store(out.to(o_smem.dtype))
        fence_async_shared()
        tma_store(o_desc, [b, h, row0, 0], o_tile)  # rows past seq_q are clipped by TMA
        ring += n
        done += 1
        code = following
    tma.store_wait(0)


@gluon.jit
def _fwd_producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_bars,
    q_empty,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    SCHED,
    TILES,
    HQ,
    GROUP,
    SEQ_Q,
    SEQ_K,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
):
    """One warp: for each of the CTA's tiles every consumer's Q block (into the buffer of the tile two
    before, once that consumer is past its last q.k^T), then K and V block by block; a stage is refilled
    once every consumer released it (the empty barriers count WGS arrivals)."""
    WGS: gl.constexpr = q_smem.shape[0] // 2
    HALF_M: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    NSTAGES: gl.constexpr = k_smem.shape[0]
    n_m = gl.cdiv(SEQ_Q, WGS * HALF_M)
    begin = gl.load(SCHED + gl.program_id(0))
    end = gl.load(SCHED + gl.program_id(0) + 1)
    code = gl.load(SCHED + begin)
    ring = 0
    done = 0
    if BOUNDS:  # read a tile ahead, as the consumers do
        next_first, next_rot, next_n = _bounded_tile(TILES, code, n_m, HQ)[:3]
    for i in range(begin, end):
        following = gl.load(SCHED + i + 1)
        bh = code // n_m
        b = bh // HQ
        h = bh % HQ
        hk = h // GROUP
        if BOUNDS:
            start_m = code % n_m * (WGS * HALF_M)
            first, rot, n = next_first, next_rot, next_n
            next_first, next_rot, next_n = _bounded_tile(TILES, following, n_m, HQ)[:3]
        else:
            first = 0
            rot = 0
            start_m, n, mask_from = _fwd_tile(code % n_m, SEQ_K, CAUSAL, WGS * HALF_M, BLOCK_N)
        for c in gl.static_range(WGS):  # (a fresh mbarrier counts as "previous phase complete")
            q_buf = (done % 2) * WGS + c
            mbarrier.wait(q_empty.index(q_buf), ((done // 2) & 1) ^ 1)
            mbarrier.expect(q_bars.index(q_buf), q_desc.block_type.nbytes)
            tma_load(q_desc, [b, h, start_m + c * HALF_M, 0], q_bars.index(q_buf), q_smem.index(q_buf))
        for j in range(ring, ring + n):
            if BOUNDS:
                row = _wrapped(first, rot + j - ring, n) * BLOCK_N
            else:
                row = (j - ring) * BLOCK_N
            stage = j % NSTAGES
            phase = ((j // NSTAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load(k_desc, [b, hk, row, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma_load(v_desc, [b, hk, row, 0], v_ready.index(stage), v_smem.index(stage))
        ring += n
        done += 1
        code = following


@gluon.jit
def _attn_fwd_ws_kernel(
    # Pointers (TMA descriptors): q, k, v, o (batch, heads, seq, head_dim), blocks of HALF_M (q, o) or BLOCK_N
    # (k, v) rows of the tile's head dim
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    # Pointers
    LSE,  # (batch, heads_q, SEQ_PAD) fp32: base-2 logsumexp of the scaled scores per q row
    SCHED,  # int32: the CTAs' work list (``fwd_schedule``)
    KB,  # where BOUNDS, int32 (2, batch, SEQ_PAD): each query's key interval, lo rows then hi rows
    TILES,  # where BOUNDS, int32 (batch, q tiles, 4): each tile's first key block, a, c and count (``_fwd_keys``)
    # Sizes
    HQ,  # q heads
    GROUP,  # q heads per kv head
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,  # LSE's and KB's row length
    BOUNDS_HI,  # batch * SEQ_PAD: where KB's hi rows start
    # Scales
    qk_scale,  # softmax scale * log2(e)
    # Meta-parameters
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,  # each query sees the keys KB gives it (CAUSAL is then unused)
    STAGES: gl.constexpr,  # K/V ring depth
    WGS: gl.constexpr,  # consumer warpgroups (``fwd_warpgroups``): query rows WGS * HALF_M a tile
):
    """The whole forward, persistent: each CTA runs the query tiles SCHED lists for it, WGS consumer
    warpgroups against one producer warp that streams Q and K/V by TMA."""
    dtype: gl.constexpr = q_desc.dtype

    # Persistent: one CTA per SM at most, taking the query tiles SCHED lists for it (``fwd_schedule``:
    # heads in sections whose K/V stay in L2; heads fastest over all of them ran the 4x32x4096x128
    # causal forward at 352 TFLOP/s instead of 529). A CTA's next tile loads while its last one
    # finishes and its output leaves. WGS consumer warpgroups (``fwd_warpgroups``) take HALF_M rows
    # of a tile each and share its K/V ring; Q has two buffers per consumer (at head dim 128 the shared
    # memory is then 224 KB of the 227).
    q_smem = gl.allocate_shared_memory(dtype, [2 * WGS] + q_desc.block_type.shape, q_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [WGS] + o_desc.block_type.shape, o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2 * WGS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * WGS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * WGS):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=WGS)
        mbarrier.init(v_empty.index(i), count=WGS)
    fence_async_shared()

    # (argument tuples written out in the call: a tuple held in a variable would turn its
    # constexprs into tensors)
    if WGS == 2:
        gl.warp_specialize(
            [
                (
                    _fwd_consumer,
                    (
                        o_desc,
                        LSE,
                        KB,
                        TILES,
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        HQ,
                        SEQ_Q,
                        SEQ_K,
                        SEQ_PAD,
                        BOUNDS_HI,
                        qk_scale,
                        CAUSAL,
                        BOUNDS,
                        0,
                    ),
                ),
                (
                    _fwd_consumer,
                    (
                        o_desc,
                        LSE,
                        KB,
                        TILES,
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        HQ,
                        SEQ_Q,
                        SEQ_K,
                        SEQ_PAD,
                        BOUNDS_HI,
                        qk_scale,
                        CAUSAL,
                        BOUNDS,
                        1,
                    ),
                ),
                (
                    _fwd_producer,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        TILES,
                        HQ,
                        GROUP,
                        SEQ_Q,
                        SEQ_K,
                        CAUSAL,
                        BOUNDS,
                    ),
                ),
            ],
            [4, 1],
            [240, 24],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _fwd_consumer,
                    (
                        o_desc,
                        LSE,
                        KB,
                        TILES,
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        HQ,
                        SEQ_Q,
                        SEQ_K,
                        SEQ_PAD,
                        BOUNDS_HI,
                        qk_scale,
                        CAUSAL,
                        BOUNDS,
                        0,
                    ),
                ),
                (
                    _fwd_consumer,
                    (
                        o_desc,
                        LSE,
                        KB,
                        TILES,
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        HQ,
                        SEQ_Q,
                        SEQ_K,
                        SEQ_PAD,
                        BOUNDS_HI,
                        qk_scale,
                        CAUSAL,
                        BOUNDS,
                        1,
                    ),
                ),
                (
                    _fwd_consumer,
                    (
                        o_desc,
                        LSE,
                        KB,
                        TILES,
                        q_smem,
                        o_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        HQ,
                        SEQ_Q,
                        SEQ_K,
                        SEQ_PAD,
                        BOUNDS_HI,
                        qk_scale,
                        CAUSAL,
                        BOUNDS,
                        2,
                    ),
                ),
                (
                    _fwd_producer,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_bars,
                        q_empty,
                        k_ready,
                        v_ready,
                        k_empty,
                        v_empty,
                        SCHED,
                        TILES,
                        HQ,
                        GROUP,
                        SEQ_Q,
                        SEQ_K,
                        CAUSAL,
                        BOUNDS,
                    ),
                ),
            ],
            [4, 4, 1],
            [160, 160, 24],
        )
