"""Hopper's attention backward: one warp-specialized Gluon kernel, one pass over the keys.

Built as the forward is (``forward.py``): a CTA holds 128 keys of one kv head, 64 per consumer
warpgroup, and the producer streams 64-row (at head_dim 64, 128-row) Q and dO blocks of every q head
of the group (block by block, each block for all the group's heads: the CTAs of a kv head then share
them in L2), with each block's lse and delta rows.
dK and dV stay in registers; dQ = dS K goes out every step, each warpgroup taking half the head dim
over all 128 keys (the dS^T halves meet in shared memory), as TMA reduce-adds into an fp32
accumulator. That is 5 matmuls per step where the portable kernels' separate dQ pass spends 7;
per-element atomics instead of TMA cost a third more time.

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

from ..gluon_compat import thread_barrier, tma_load, tma_reduce_add, tma_store


@gluon.jit
def _bwd_span(
    QT,
    b,
    tile,
    SEQ_Q,
    SEQ_K,
    HALF_N: gl.constexpr,
    BLOCK_M: gl.constexpr,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
):
    """Key tile ``tile``'s first key, its first q block, its number n_m of q blocks and, with BOUNDS, the
    q blocks [a, c) of those (counted from the first) that see all its keys: no mask (QT's row
    ``b * tiles + tile``, ``launchers``)."""
    start_n = tile * (2 * HALF_N)
    if BOUNDS:
        entry = QT + (b * gl.cdiv(SEQ_K, 2 * HALF_N) + tile) * 4
        lo = gl.load(entry)
        a = gl.load(entry + 1)
        c = gl.load(entry + 2)
        n_m = gl.load(entry + 3)
    else:
        if CAUSAL:  # q rows < start_n see none of these keys
            lo = gl.minimum(start_n, SEQ_Q) // BLOCK_M
        else:
            lo = 0
        n_m = gl.cdiv(SEQ_Q, BLOCK_M) - lo
        a = 0
        c = n_m
    return start_n, lo, n_m, a, c


@gluon.jit
def _bwd_block(u, n_m, GROUP, desc):
    """The q block (counted from the tile's first) of the tile's step u: each block for the group's q
    heads in turn, blocks from the last down (desc = 1) or from the first up (desc = 0).

    With blocks outer, heads inner, the CTAs running a kv head's tiles side by side all read one
    Q/dO tile and reduce into its dQ rows within a few steps, while those sit in L2. In the head-major
    order each CTA drifted through its own heads, and at 4 x 32/4 x 2048 the kernel moved 2.4 GB of
    DRAM traffic at 47% L2 hits where cuDNN's backward moves 0.54 GB at 87%."""
    blk = u // GROUP
    return blk + desc * (n_m - 1 - 2 * blk)


@gluon.jit
def _bwd_head(u, tile, hk, GROUP):
    """The q head of the tile's step u: the group's heads in turn, starting at head ``tile % GROUP``,
    so that the CTAs on one q block at the same moment reduce into different heads' dQ rows (all on
    one head, their TMA reduce-adds queue on the same L2 lines: 4 x 32/4 x 2048 took 1.03 ms
    instead of 0.82)."""
    return hk * GROUP + (u + tile) % GROUP


@gluon.jit
def _bwd_steps(
    dk,
    dv,
    s0,
    dq0,
    k_tile,
    v_tile,
    k_dq0,
    k_dq1,
    q_smem,
    do_smem,
    ds_smem,
    dq_smem,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    ds_bar,
    dqa_desc,
    lse_smem,
    delta_smem,
    KB,
    SEQ_PAD,
    BOUNDS_HI,
    b,
    hk,
    tile,
    t0,
    t1,
    base,
    lo,
    n_m,
    GROUP,
    offs_n,
    qk_scale,
    sm_scale,
    desc,
    BOUNDS: gl.constexpr,
    MASKED: gl.constexpr,
    C: gl.constexpr,
):
    """Ring steps t0 .. t1-1 of the tile whose steps start at ring step ``base``: dV += P^T dO,
    dK += dS^T Q, and this warpgroup's half C of the head dim of dQ = dS K over the CTA's 128 keys,
    reduce-added to the fp32 accumulator by TMA.

    dQ needs the other warpgroup's dS^T too: each stages its half in ds_smem (two buffers) and both
    wait on that buffer's barrier. A buffer is rewritten two steps later, by which time the other
    warpgroup has passed the next step's barrier, so it has finished reading it.

    lse and delta arrive by TMA with Q and dO and are read from shared memory where they are used:
    loaded from global memory at the top of the step they held 32 registers across the matmuls,
    and at 240 registers the step spilled (ptxas: 540 bytes; now 108) and ran 14-18% longer. dP's
    accumulator starts at -delta, so dP - delta leaves the matmul and delta is dead before dS, the
    step's register peak (GPU-only backward 1-3% faster at the GQA shapes, head dims 64 and 128)."""
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    HALF_N: gl.constexpr = k_tile.shape[0]
    NSTAGES: gl.constexpr = q_smem.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = s0.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    cols_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    dq_tile = dq_smem.index(C)
    for t in range(t0, t1):
        stage = t % NSTAGES
        phase = (t // NSTAGES) & 1
        q_t = q_smem.index(stage).reshape([BLOCK_M, D])
        do_t = do_smem.index(stage).reshape([BLOCK_M, D])
        h = _bwd_head(t - base, tile, hk, GROUP)
        row0 = (lo + _bwd_block(t - base, n_m, GROUP, desc)) * BLOCK_M
        offs_m = row0 + gl.arange(0, BLOCK_M, layout=cols_l)
        mbarrier.wait(q_ready.index(stage), phase)
        s_t = warpgroup_mma(k_tile, q_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_t = warpgroup_mma(v_tile, do_t.permute((1, 0)), s0 - delta_smem.index(stage).load(s_layout), is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        lse = lse_smem.index(stage).load(s_layout)  # [1, BLOCK_M]; padded rows: +inf, so p = 0 there
        p_t = gl.exp2(s_t * qk_scale - lse)
        if MASKED and BOUNDS:  # each q row's key interval (rows past seq_q: empty)
            row_lo = gl.expand_dims(gl.load(KB + b.to(gl.int64) * SEQ_PAD + offs_m), 0)
            row_hi = gl.expand_dims(gl.load(KB + BOUNDS_HI + b.to(gl.int64) * SEQ_PAD + offs_m), 0)
            keys = gl.expand_dims(offs_n, 1)
            p_t = gl.where((keys >= row_lo) & (keys < row_hi), p_t, 0.0)
        elif MASKED:
            p_t = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), p_t, 0.0)
        p_a = gl.convert_layout(p_t.to(dtype), a_layout)
        dv = warpgroup_mma(p_a, do_t, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        ds_t = (p_t * dp_t).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_t, dk, is_async=True)

        ds_buf = ds_smem.index(t % 2)
        ds_buf.slice(C * HALF_N, HALF_N, dim=0).store(ds_t)
        fence_async_shared()
        thread_barrier()  # the whole warpgroup's half is written before its one arrival
        mbarrier.arrive(ds_bar.index(t % 2), count=1)
        mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)
        dq = warpgroup_mma(ds_buf.slice(0, HALF_N, dim=0).permute((1, 0)), k_dq0, dq0, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_buf.slice(HALF_N, HALF_N, dim=0).permute((1, 0)), k_dq1, dq, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        mbarrier.arrive(q_empty.index(stage), count=1)
        mbarrier.arrive(do_empty.index(stage), count=1)

        tma.store_wait(0)  # the previous step's reduce has read the staging tile
        thread_barrier()
        dq_tile.reshape([BLOCK_M, D // 2]).store(dq * sm_scale)
        fence_async_shared()
        thread_barrier()
        tma_reduce_add(dqa_desc, [b, h, row0, C * (D // 2)], dq_tile)  # rows past seq_q are clipped by TMA
    return dk, dv


@gluon.jit
def _bwd_tile(
    dk_desc,
    dv_desc,
    dqa_desc,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    ds_smem,
    dq_smem,
    kv_bar,
    kv_free,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    ds_bar,
    end_bar,
    KB,
    QT,
    b,
    hk,
    tile,
    base,
    nth,
    desc,
    GROUP,
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,
    BOUNDS_HI,
    qk_scale,
    sm_scale,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
    C: gl.constexpr,
):
    """Warpgroup C, the CTA's nth key tile (its steps from ring step ``base``): keys
    start_n + C*HALF_N .. +HALF_N of one kv head against every q block of the GROUP q heads that
    read it (GQA reduced in registers), dQ for half C of the head dim; returns the next tile's base."""
    HALF_N: gl.constexpr = k_smem.shape[3]
    D: gl.constexpr = k_smem.shape[4]
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D // 2, 16]
    )
    rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    start_n, lo, n_m, a, c = _bwd_span(QT, b, tile, SEQ_Q, SEQ_K, HALF_N, BLOCK_M, CAUSAL, BOUNDS)

    k_tile = k_smem.index(C).reshape([HALF_N, D])
    v_tile = v_smem.index(C).reshape([HALF_N, D])
    # dQ's B operands: both key halves of the CTA, this warpgroup's half of the head dim
    k_dq0 = k_smem.index(0).reshape([HALF_N, D]).slice(C * (D // 2), D // 2, dim=1)
    k_dq1 = k_smem.index(1).reshape([HALF_N, D]).slice(C * (D // 2), D // 2, dim=1)
    key0 = start_n + C * HALF_N
    offs_n = key0 + gl.arange(0, HALF_N, layout=rows_l)
    dk = gl.zeros([HALF_N, D], gl.float32, layout=o_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=o_layout)
    s0 = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    dq0 = gl.zeros([BLOCK_M, D // 2], gl.float32, layout=dq_layout)
    mbarrier.wait(kv_bar, nth & 1)
    end = base + n_m * GROUP
    # the steps [mask_lo, mask_hi) need no mask (BOUNDS) or need one (CAUSAL: the q blocks that cross
    # the tile's keys, its first two); blocks go from the last down where desc
    if BOUNDS:
        mask_lo = base + (desc * (n_m - c) + (1 - desc) * a) * GROUP
        mask_hi = base + (desc * (n_m - a) + (1 - desc) * c) * GROUP
    elif CAUSAL:
        n_diag = gl.minimum(n_m, 2 * HALF_N // BLOCK_M)
        mask_lo = base + desc * (n_m - n_diag) * GROUP
        mask_hi = mask_lo + n_diag * GROUP
    else:
        mask_lo = end
        mask_hi = end
    dk, dv = _bwd_steps(
        dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem,
        q_ready, do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, KB, SEQ_PAD, BOUNDS_HI,
        b, hk, tile, base, mask_lo, base, lo, n_m, GROUP, offs_n, qk_scale, sm_scale, desc,
        BOUNDS, BOUNDS, C,
    )  # fmt: skip
    if CAUSAL or BOUNDS:
        dk, dv = _bwd_steps(
            dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem,
            q_ready, do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, KB, SEQ_PAD, BOUNDS_HI,
            b, hk, tile, mask_lo, mask_hi, base, lo, n_m, GROUP, offs_n, qk_scale, sm_scale, desc,
            BOUNDS, not BOUNDS, C,
        )  # fmt: skip
        dk, dv = _bwd_steps(
            dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem,
            q_ready, do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, KB, SEQ_PAD, BOUNDS_HI,
            b, hk, tile, mask_hi, end, base, lo, n_m, GROUP, offs_n, qk_scale, sm_scale, desc,
            BOUNDS, BOUNDS, C,
        )  # fmt: skip
    # K and V are dead: stage dK and dV in their tiles, once the other warpgroup's last dQ has read K
    mbarrier.arrive(end_bar, count=1)
    mbarrier.wait(end_bar, nth & 1)
    k_tile.store((dk * sm_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [b, hk, key0, 0], k_smem.index(C))  # rows past seq_k are clipped by TMA
    tma_store(dv_desc, [b, hk, key0, 0], v_smem.index(C))
    tma.store_wait(0)
    thread_barrier()
    mbarrier.arrive(kv_free, count=1)  # the tiles may take the next key tile's K and V
    return end


@gluon.jit
def _bwd_consumer(
    dk_desc,
    dv_desc,
    dqa_desc,
    lse_smem,
    delta_smem,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    ds_smem,
    dq_smem,
    kv_bar,
    kv_free,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    ds_bar,
    end_bar,
    KB,
    QT,
    b,
    hk,
    tile,
    twin,
    GROUP,
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,
    BOUNDS_HI,
    qk_scale,
    sm_scale,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
    C: gl.constexpr,
):
    """Warpgroup C over the CTA's key tiles: ``tile`` (q blocks down), then ``twin`` (up) unless the same."""
    base = 0
    for nth in range(1 + (twin != tile).to(gl.int32)):
        base = _bwd_tile(
            dk_desc,
            dv_desc,
            dqa_desc,
            lse_smem,
            delta_smem,
            k_smem,
            v_smem,
            q_smem,
            do_smem,
            ds_smem,
            dq_smem,
            kv_bar,
            kv_free,
            q_ready,
            do_ready,
            q_empty,
            do_empty,
            ds_bar,
            end_bar,
            KB,
            QT,
            b,
            hk,
            tile + nth * (twin - tile),
            base,
            nth,
            1 - nth,
            GROUP,
            SEQ_Q,
            SEQ_K,
            SEQ_PAD,
            BOUNDS_HI,
            qk_scale,
            sm_scale,
            CAUSAL,
            BOUNDS,
            C,
        )


@gluon.jit
def _bwd_load_tile(
    k_desc,
    v_desc,
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    QT,
    b,
    hk,
    tile,
    base,
    desc,
    SEQ_Q,
    SEQ_K,
    GROUP,
    HQ,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
):
    """Both K and V halves of key tile ``tile``, then Q and dO block by block in ``_bwd_block``'s
    order, into ring steps from ``base``; returns the next tile's base."""
    HALF_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    NSTAGES: gl.constexpr = q_smem.shape[0]
    start_n, lo, n_m, a, c = _bwd_span(QT, b, tile, SEQ_Q, SEQ_K, HALF_N, BLOCK_M, CAUSAL, BOUNDS)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma_load(k_desc, [b, hk, start_n + c * HALF_N, 0], kv_bar, k_smem.index(c))
        tma_load(v_desc, [b, hk, start_n + c * HALF_N, 0], kv_bar, v_smem.index(c))
    for t in range(base, base + GROUP * n_m):
        h = _bwd_head(t - base, tile, hk, GROUP)
        row = (lo + _bwd_block(t - base, n_m, GROUP, desc)) * BLOCK_M
        stage = t % NSTAGES
        phase = ((t // NSTAGES) & 1) ^ 1
        mbarrier.wait(q_empty.index(stage), phase)
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, row, 0], q_ready.index(stage), q_smem.index(stage))
        tma_load(lse_desc, [b * HQ + h, row], q_ready.index(stage), lse_smem.index(stage))
        mbarrier.wait(do_empty.index(stage), phase)
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        tma_load(do_desc, [b, h, row, 0], do_ready.index(stage), do_smem.index(stage))
        tma_load(delta_desc, [b * HQ + h, row], do_ready.index(stage), delta_smem.index(stage))
    return base + GROUP * n_m


@gluon.jit
def _bwd_producer(
    k_desc,
    v_desc,
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    k_smem,
    v_smem,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_bar,
    kv_free,
    q_ready,
    do_ready,
    q_empty,
    do_empty,
    QT,
    b,
    hk,
    tile,
    twin,
    SEQ_Q,
    SEQ_K,
    GROUP,
    HQ,
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,
):
    """One warp: the CTA's key tiles in turn; the twin's K and V once the consumers have stored the
    first tile's dK and dV from those buffers."""
    base = 0
    for nth in range(1 + (twin != tile).to(gl.int32)):
        mbarrier.wait(kv_free, (nth & 1) ^ 1)  # a fresh mbarrier counts as "previous phase complete"
        base = _bwd_load_tile(
            k_desc,
            v_desc,
            q_desc,
            do_desc,
            lse_desc,
            delta_desc,
            k_smem,
            v_smem,
            q_smem,
            do_smem,
            lse_smem,
            delta_smem,
            kv_bar,
            q_ready,
            do_ready,
            q_empty,
            do_empty,
            QT,
            b,
            hk,
            tile + nth * (twin - tile),
            base,
            1 - nth,
            SEQ_Q,
            SEQ_K,
            GROUP,
            HQ,
            CAUSAL,
            BOUNDS,
        )


@gluon.jit
def _attn_bwd_ws_kernel(
    # Pointers (TMA descriptors): q, k, v, do, dk, dv (batch, heads, seq, head_dim), blocks of the tile's head
    # dim; dqa, the zeroed fp32 dQ accumulator (batch, heads_q, seq_q, head dim padded), blocks of half of it
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    dk_desc,
    dv_desc,
    dqa_desc,
    # Pointers (TMA descriptors) over (batch * heads_q, padded rows) fp32: one q block's rows each
    lse_desc,  # the forward's base-2 logsumexp, padded rows +inf
    delta_desc,  # rowsum(dO * O), padded rows 0
    # Pointers
    KB,  # where BOUNDS, int32 (2, batch, SEQ_PAD): each query's key interval, lo rows then hi rows
    QT,  # where BOUNDS, int32 (batch, key tiles, 4): each key tile's q blocks (``_bwd_span``)
    PAIRS,  # where BOUNDS, int32 (batch, key tiles / 2 rounded up, 2): each CTA's two key tiles
    # Sizes
    HQ,  # q heads
    HKV,  # kv heads
    GROUP,  # q heads per kv head
    SEQ_Q,
    SEQ_K,
    SEQ_PAD,  # KB's row length
    BOUNDS_HI,  # batch * SEQ_PAD: where KB's hi rows start
    # Scales
    qk_scale,  # softmax scale * log2(e)
    sm_scale,  # softmax scale
    # Meta-parameters
    CAUSAL: gl.constexpr,
    BOUNDS: gl.constexpr,  # each query sees the keys KB gives it
    STAGES: gl.constexpr,  # Q/dO ring depth
):
    """The whole backward in one pass over the keys: two consumer warpgroups (64 keys each, one CTA
    tile of 128) and a TMA producer warp; dQ is reduce-added into an fp32 accumulator.

    Causal grids give each CTA two key tiles, the i-th from the start and the i-th from the end
    (the first's q blocks from the last down, then the twin's from its first up): every CTA has the
    same work, so no tail, and at any moment the CTAs of a kv head are on one of two q blocks, so
    the group's Q, dO and dQ tiles come from DRAM about twice instead of once per key tile. One tile
    per CTA, longest first, in head-major order took 1.02-1.41x as long at the GQA model shapes.
    Under key bounds the pairs are the i-th longest and the i-th shortest (``tile_pairs``)."""
    HALF_N: gl.constexpr = k_desc.block_type.shape[2]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    # grid (key tiles or causal's tile pairs, batch * kv heads), tiles fastest: a kv head's CTAs run
    # side by side and share each Q/dO tile and its dQ rows in L2 (``_bwd_block``). Heads fastest put
    # one CTA per head in flight once batch x kv heads reached the SM count: the 4x32x4096x128 causal
    # backward ran at 234 TFLOP/s, where the tiles-fastest order (one tile a CTA) had run 419
    bhk = gl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    if BOUNDS:  # pairs of equal summed work from PAIRS (the tiles' work varies with the bounds)
        pair = PAIRS + (b * gl.cdiv(gl.cdiv(SEQ_K, 2 * HALF_N), 2) + gl.program_id(0)) * 2
        tile = gl.load(pair)
        twin = gl.load(pair + 1)
    elif CAUSAL:
        tile = gl.program_id(0)
        twin = gl.cdiv(SEQ_K, 2 * HALF_N) - 1 - tile
    else:
        tile = gl.program_id(0)
        twin = tile
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HALF_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * HALF_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dqa_desc.block_type.shape, dqa_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_free, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)
    mbarrier.init(end_bar, count=2)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _bwd_consumer,
                (
                    dk_desc,
                    dv_desc,
                    dqa_desc,
                    lse_smem,
                    delta_smem,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    ds_smem,
                    dq_smem,
                    kv_bar,
                    kv_free,
                    q_ready,
                    do_ready,
                    q_empty,
                    do_empty,
                    ds_bar,
                    end_bar,
                    KB,
                    QT,
                    b,
                    hk,
                    tile,
                    twin,
                    GROUP,
                    SEQ_Q,
                    SEQ_K,
                    SEQ_PAD,
                    BOUNDS_HI,
                    qk_scale,
                    sm_scale,
                    CAUSAL,
                    BOUNDS,
                    0,
                ),
            ),
            (
                _bwd_consumer,
                (
                    dk_desc,
                    dv_desc,
                    dqa_desc,
                    lse_smem,
                    delta_smem,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    ds_smem,
                    dq_smem,
                    kv_bar,
                    kv_free,
                    q_ready,
                    do_ready,
                    q_empty,
                    do_empty,
                    ds_bar,
                    end_bar,
                    KB,
                    QT,
                    b,
                    hk,
                    tile,
                    twin,
                    GROUP,
                    SEQ_Q,
                    SEQ_K,
                    SEQ_PAD,
                    BOUNDS_HI,
                    qk_scale,
                    sm_scale,
                    CAUSAL,
                    BOUNDS,
                    1,
                ),
            ),
            (
                _bwd_producer,
                (
                    k_desc,
                    v_desc,
                    q_desc,
                    do_desc,
                    lse_desc,
                    delta_desc,
                    k_smem,
                    v_smem,
                    q_smem,
                    do_smem,
                    lse_smem,
                    delta_smem,
                    kv_bar,
                    kv_free,
                    q_ready,
                    do_ready,
                    q_empty,
                    do_empty,
                    QT,
                    b,
                    hk,
                    tile,
                    twin,
                    SEQ_Q,
                    SEQ_K,
                    GROUP,
                    HQ,
                    CAUSAL,
                    BOUNDS,
                ),
            ),
        ],
        [4, 1],
        [240, 24],
    )
