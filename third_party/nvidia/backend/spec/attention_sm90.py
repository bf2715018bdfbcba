"""Hopper's attention forward and backward: warp-specialized Gluon kernels the ``tl`` kernels cannot express.

Why a second kernel: in the portable kernel both warpgroups of a CTA share one software pipeline, so
every key block ends in a CTA-wide barrier and the two run in lockstep: both wait on q.k^T, both
compute the softmax while the tensor cores idle. Here the CTA holds 128 query rows split over two
consumer warpgroups (64 rows each) and one producer warp that streams K/V through a TMA ring guarded
by mbarriers. Nothing ties the consumers to each other, so one's softmax runs under the other's
matmuls. On an H100 this took the head_dim-128 forward from 450-500 to 550-610 TFLOP/s, cuDNN's
speed. The forward is persistent (a CTA per SM walks its list of query tiles, ``fwd_schedule``):
each tile's Q and K/V load while the previous tile finishes and its output leaves, which took the
2048-token causal shapes from 93-95% of cuDNN's speed to 102-107% (GPU time).

The backward is one pass over the keys, built the same way: a CTA holds 128 keys of one kv head, 64
per consumer warpgroup, and the producer streams 64-row (at head_dim 64, 128-row) Q and dO blocks of
every q head of the group (block by block, each block for all the group's heads: the CTAs of a kv
head then share them in L2), with each block's lse and delta rows.
dK and dV stay in registers; dQ = dS K goes out every step, each warpgroup taking half the head dim
over all 128 keys (the dS^T halves meet in shared memory), as TMA reduce-adds into an fp32
accumulator. That is 5 matmuls per step where the portable kernels' separate dQ pass spends 7;
per-element atomics instead of TMA cost a third more time.

The op asks for them through the ``attention_forward`` / ``attention_backward`` hooks; both decline
(return False, the op then runs its ``tl`` kernels) for anything they were not measured on: a device
other than sm90, head_dim outside 64..128, dtypes other than fp16/bf16, scale <= 0, strides TMA cannot
address, more than 65535 batch x heads, decode-sized queries (forward), or a Triton without Gluon's
Hopper API.
"""
from __future__ import annotations

import functools
import heapq
import itertools

import torch

from tritonspec.ops._library import PlanCache, cdiv, launch
from tritonspec.ops.attention import LOG2E, tma_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # a Triton without Gluon: the hook always declines
    _GLUON = False

__all__ = ["attention_forward", "attention_backward", "eligible"]

HALF_M = 64  # query rows per consumer warpgroup; a CTA covers 2 or 3 * HALF_M (``fwd_warpgroups``)
BLOCK_N = 128  # keys per pipeline stage
STAGES = 2  # ring depth (forward K/V, backward Q/dO): 3 measured no faster in either
HEAD_DIM = 128  # the tile's head dim (64 at head_dim 64); other head dims below it are zero-filled by TMA
BWD_HALF_N = 64  # backward: keys per consumer warpgroup; a CTA covers 2 * BWD_HALF_N
BWD_BLOCK_M = 64  # backward: query rows per pipeline stage (Q and dO rings)
# the same at head_dim 64, where 64-row steps leave the matmuls too short: 128 took 1x32/8x8192x64 from
# 1.877 to 1.767 ms on an H100 (ptxas spills 408 bytes in the causal kernel; 64 rows spilled none)
BWD_BLOCK_M_D64 = 128
MAX_GRID_Y = 65535  # batch x heads index the grid's second axis (tiles go first: the CTAs sharing K/V or Q/dO)

if _GLUON:
    # Later Tritons renamed the TMA copies and the barrier; the kernels call whichever this Triton has.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # a partition's own threads (named barrier)
    _tma_add = getattr(tma, "async_atomic_add", None)
    if _tma_add is None:  # Triton 3.6 has the IR op but no Gluon wrapper for it
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def _tma_add(tensor_desc, coord, src, _semantic=None):
            """Bulk reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                      src.handle)

    @gluon.jit
    def _to_pairs(x, dtype: gl.constexpr):
        """x.to(dtype) for 16-bit dtypes, two columns per instruction straight into the packed register
        the wgmma A operand reads (``.to`` converts one at a time and ptxas then swaps the halves of
        every pair: a PRMT per register per step)."""
        if dtype == gl.bfloat16:
            y = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            y = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                          is_pure=True, pack=2)
        return y

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, j, offs_m, SEQ_K, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                 MASKED: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr):
        """Online-softmax step on the raw scores of key block j: (p as p.v's A operand, alpha, m, l).

        Valid only for qk_scale > 0 (the row max is taken before scaling); the launcher checks."""
        if MASKED:
            # one compare a score: the block's own column against the row's last visible one
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if CAUSAL:
                last = gl.minimum(offs_m, SEQ_K - 1) - j * BLOCK_N
            else:
                last = gl.full_like(offs_m, SEQ_K - 1 - j * BLOCK_N)
            s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        p = gl.convert_layout(_to_pairs(p, dtype), p_layout)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _consume_blocks(acc, p, m_i, l_i, s0, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lo, hi, ring,
                        qk_scale, offs_m, SEQ_K, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                        s_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr):
        """Steps lo..hi-1: q.k^T of block j+1 and p.v of block j in flight together, then the softmax of j+1.
        Block j sits in ring slot ``ring + j`` (the K/V blocks of the CTA's earlier tiles came first)."""
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        D: gl.constexpr = k_smem.shape[4]
        NSTAGES: gl.constexpr = k_smem.shape[0]
        for j in range(lo, hi):
            stage = (ring + j) % NSTAGES
            nstage = (ring + j + 1) % NSTAGES
            mbarrier.wait(k_ready.index(nstage), ((ring + j + 1) // NSTAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(nstage).reshape([BLOCK_N, D]).permute((1, 0)), s0, use_acc=False,
                              is_async=True)
            mbarrier.wait(v_ready.index(stage), ((ring + j) // NSTAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_N, D]), acc, is_async=True)
            s, p = warpgroup_mma_wait(1, deps=(s, p))
            mbarrier.arrive(k_empty.index(nstage), count=1)
            p_next, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, j + 1, offs_m, SEQ_K, BLOCK_N, CAUSAL, MASKED,
                                               s_layout, p_layout, q.dtype)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(stage), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p = p_next
        return acc, p, m_i, l_i

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
    def _consumer(o_desc, LSE, q_smem, o_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                  SCHED, HQ, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale, CAUSAL: gl.constexpr, C: gl.constexpr):
        """Warpgroup C: query rows C*HALF_M .. +HALF_M of each of the CTA's tiles against their key blocks.
        Q is double-buffered (tile t in buffer t % 2), so the next tile's Q arrives while this one runs;
        the output leaves through o_smem by TMA while the next tile runs."""
        WGS: gl.constexpr = q_smem.shape[0] // 2
        HALF_M: gl.constexpr = q_smem.shape[3]
        D: gl.constexpr = q_smem.shape[4]
        BLOCK_N: gl.constexpr = k_smem.shape[3]
        NSTAGES: gl.constexpr = k_smem.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
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
        for i in range(begin, end):
            following = gl.load(SCHED + i + 1)  # the next tile's, read ahead (the table ends in a spare entry)
            bh = code // n_m
            b = bh // HQ
            h = bh % HQ
            start_m, n, mask_from = _fwd_tile(code % n_m, SEQ_K, CAUSAL, WGS * HALF_M, BLOCK_N)
            row0 = start_m + C * HALF_M
            offs_m = row0 + gl.arange(0, HALF_M, layout=row_s)
            m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
            acc = gl.zeros([HALF_M, D], gl.float32, layout=o_layout)

            q_buf = (done % 2) * WGS + C
            q = q_smem.index(q_buf).reshape([HALF_M, D])
            mbarrier.wait(q_bars.index(q_buf), (done // 2) & 1)
            first = ring % NSTAGES
            mbarrier.wait(k_ready.index(first), (ring // NSTAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(first).reshape([BLOCK_N, D]).permute((1, 0)), s0, use_acc=False,
                              is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            mbarrier.arrive(k_empty.index(first), count=1)
            if mask_from == 0:
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, offs_m, SEQ_K, BLOCK_N, CAUSAL, True,
                                              s_layout, p_layout, q.dtype)
            else:
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, offs_m, SEQ_K, BLOCK_N, CAUSAL, False,
                                              s_layout, p_layout, q.dtype)
            # key block j+1 needs the mask iff j+1 >= mask_from: two loops keep the mask out of the first
            split = gl.maximum(gl.minimum(mask_from - 1, n - 1), 0)
            acc, p, m_i, l_i = _consume_blocks(acc, p, m_i, l_i, s0, q, k_smem, v_smem, k_ready, v_ready,
                                               k_empty, v_empty, 0, split, ring, qk_scale, offs_m, SEQ_K, CAUSAL,
                                               False, s_layout, p_layout, row_o)
            acc, p, m_i, l_i = _consume_blocks(acc, p, m_i, l_i, s0, q, k_smem, v_smem, k_ready, v_ready,
                                               k_empty, v_empty, split, n - 1, ring, qk_scale, offs_m, SEQ_K,
                                               CAUSAL, True, s_layout, p_layout, row_o)
            mbarrier.arrive(q_empty.index(q_buf), count=1)  # every q.k^T is done: a later tile's Q may load
            last = ring + n - 1
            stage = last % NSTAGES
            mbarrier.wait(v_ready.index(stage), (last // NSTAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_N, D]), acc, is_async=True)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(stage), count=1)

            lse = m_i + gl.log2(l_i)
            gl.store(LSE + bh.to(gl.int64) * SEQ_PAD + offs_m, lse, mask=offs_m < SEQ_Q)
            out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
            tma.store_wait(0)  # the previous tile's output has left o_smem
            _barrier()
            o_tile.reshape([HALF_M, D]).store(out.to(o_smem.dtype))
            fence_async_shared()
            _tma_store(o_desc, [b, h, row0, 0], o_tile)  # rows past seq_q are clipped by TMA
            ring += n
            done += 1
            code = following
        tma.store_wait(0)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                  SCHED, HQ, GROUP, SEQ_Q, SEQ_K, CAUSAL: gl.constexpr):
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
        for i in range(begin, end):
            following = gl.load(SCHED + i + 1)
            bh = code // n_m
            b = bh // HQ
            h = bh % HQ
            hk = h // GROUP
            start_m, n, mask_from = _fwd_tile(code % n_m, SEQ_K, CAUSAL, WGS * HALF_M, BLOCK_N)
            for c in gl.static_range(WGS):  # (a fresh mbarrier counts as "previous phase complete")
                q_buf = (done % 2) * WGS + c
                mbarrier.wait(q_empty.index(q_buf), ((done // 2) & 1) ^ 1)
                mbarrier.expect(q_bars.index(q_buf), q_desc.block_type.nbytes)
                _tma_load(q_desc, [b, h, start_m + c * HALF_M, 0], q_bars.index(q_buf), q_smem.index(q_buf))
            for j in range(ring, ring + n):
                stage = j % NSTAGES
                phase = ((j // NSTAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(stage), phase)
                mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
                _tma_load(k_desc, [b, hk, (j - ring) * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
                mbarrier.wait(v_empty.index(stage), phase)
                mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
                _tma_load(v_desc, [b, hk, (j - ring) * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))
            ring += n
            done += 1
            code = following

    @gluon.jit
    def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, LSE, SCHED, HQ, GROUP, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale,
                            CAUSAL: gl.constexpr, STAGES: gl.constexpr, WGS: gl.constexpr):
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
            gl.warp_specialize([
                (_consumer, (o_desc, LSE, q_smem, o_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty,
                             v_empty, SCHED, HQ, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale, CAUSAL, 0)),
                (_consumer, (o_desc, LSE, q_smem, o_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty,
                             v_empty, SCHED, HQ, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale, CAUSAL, 1)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready,
                             k_empty, v_empty, SCHED, HQ, GROUP, SEQ_Q, SEQ_K, CAUSAL)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (o_desc, LSE, q_smem, o_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty,
                             v_empty, SCHED, HQ, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale, CAUSAL, 0)),
                (_consumer, (o_desc, LSE, q_smem, o_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty,
                             v_empty, SCHED, HQ, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale, CAUSAL, 1)),
                (_consumer, (o_desc, LSE, q_smem, o_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready, k_empty,
                             v_empty, SCHED, HQ, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale, CAUSAL, 2)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, q_empty, k_ready, v_ready,
                             k_empty, v_empty, SCHED, HQ, GROUP, SEQ_Q, SEQ_K, CAUSAL)),
            ], [4, 4, 1], [160, 160, 24])

    @gluon.jit
    def _bwd_span(tile, SEQ_Q, HALF_N: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """Key tile ``tile``'s first key, its first q block and its number of q blocks."""
        start_n = tile * (2 * HALF_N)
        if CAUSAL:  # q rows < start_n see none of these keys
            lo = gl.minimum(start_n, SEQ_Q) // BLOCK_M
        else:
            lo = 0
        return start_n, lo, gl.cdiv(SEQ_Q, BLOCK_M) - lo

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
    def _bwd_steps(dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem, q_ready,
                   do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, b, hk, tile, t0, t1, base, lo,
                   n_m, GROUP, offs_n, qk_scale, sm_scale, desc, MASKED: gl.constexpr, C: gl.constexpr):
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
            dp_t = warpgroup_mma(v_tile, do_t.permute((1, 0)), s0 - delta_smem.index(stage).load(s_layout),
                                 is_async=True)
            s_t = warpgroup_mma_wait(1, deps=(s_t, ))
            lse = lse_smem.index(stage).load(s_layout)  # [1, BLOCK_M]; padded rows: +inf, so p = 0 there
            p_t = gl.exp2(s_t * qk_scale - lse)
            if MASKED:
                p_t = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), p_t, 0.0)
            p_a = gl.convert_layout(p_t.to(dtype), a_layout)
            dv = warpgroup_mma(p_a, do_t, dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
            ds_t = (p_t * dp_t).to(dtype)
            dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_t, dk, is_async=True)

            ds_buf = ds_smem.index(t % 2)
            ds_buf.slice(C * HALF_N, HALF_N, dim=0).store(ds_t)
            fence_async_shared()
            _barrier()  # the whole warpgroup's half is written before its one arrival
            mbarrier.arrive(ds_bar.index(t % 2), count=1)
            mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)
            dq = warpgroup_mma(ds_buf.slice(0, HALF_N, dim=0).permute((1, 0)), k_dq0, dq0, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma(ds_buf.slice(HALF_N, HALF_N, dim=0).permute((1, 0)), k_dq1, dq, is_async=True)
            dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
            mbarrier.arrive(q_empty.index(stage), count=1)
            mbarrier.arrive(do_empty.index(stage), count=1)

            tma.store_wait(0)  # the previous step's reduce has read the staging tile
            _barrier()
            dq_tile.reshape([BLOCK_M, D // 2]).store(dq * sm_scale)
            fence_async_shared()
            _barrier()
            _tma_add(dqa_desc, [b, h, row0, C * (D // 2)], dq_tile)  # rows past seq_q are clipped by TMA
        return dk, dv

    @gluon.jit
    def _bwd_tile(dk_desc, dv_desc, dqa_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem, ds_smem,
                  dq_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, ds_bar, end_bar, b, hk, tile, base,
                  nth, desc, GROUP, SEQ_Q, qk_scale, sm_scale, CAUSAL: gl.constexpr, C: gl.constexpr):
        """Warpgroup C, the CTA's nth key tile (its steps from ring step ``base``): keys
        start_n + C*HALF_N .. +HALF_N of one kv head against every q block of the GROUP q heads that
        read it (GQA reduced in registers), dQ for half C of the head dim; returns the next tile's base."""
        HALF_N: gl.constexpr = k_smem.shape[3]
        D: gl.constexpr = k_smem.shape[4]
        BLOCK_M: gl.constexpr = q_smem.shape[3]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D // 2, 16])
        rows_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        start_n, lo, n_m = _bwd_span(tile, SEQ_Q, HALF_N, BLOCK_M, CAUSAL)

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
        if CAUSAL:  # the q blocks that cross the tile's keys (its first two) need the mask, the rest do not
            n_diag = gl.minimum(n_m, 2 * HALF_N // BLOCK_M)
            mask_lo = base + desc * (n_m - n_diag) * GROUP
            mask_hi = mask_lo + n_diag * GROUP
        else:
            mask_lo = end
            mask_hi = end
        dk, dv = _bwd_steps(dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem, q_ready,
                            do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, b, hk, tile, base,
                            mask_lo, base, lo, n_m, GROUP, offs_n, qk_scale, sm_scale, desc, False, C)
        if CAUSAL:
            dk, dv = _bwd_steps(dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem,
                                q_ready, do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, b, hk,
                                tile, mask_lo, mask_hi, base, lo, n_m, GROUP, offs_n, qk_scale, sm_scale, desc, True, C)
            dk, dv = _bwd_steps(dk, dv, s0, dq0, k_tile, v_tile, k_dq0, k_dq1, q_smem, do_smem, ds_smem, dq_smem,
                                q_ready, do_ready, q_empty, do_empty, ds_bar, dqa_desc, lse_smem, delta_smem, b, hk,
                                tile, mask_hi, end, base, lo, n_m, GROUP, offs_n, qk_scale, sm_scale, desc, False, C)
        # K and V are dead: stage dK and dV in their tiles, once the other warpgroup's last dQ has read K
        mbarrier.arrive(end_bar, count=1)
        mbarrier.wait(end_bar, nth & 1)
        k_tile.store((dk * sm_scale).to(dtype))
        v_tile.store(dv.to(dtype))
        fence_async_shared()
        _tma_store(dk_desc, [b, hk, key0, 0], k_smem.index(C))  # rows past seq_k are clipped by TMA
        _tma_store(dv_desc, [b, hk, key0, 0], v_smem.index(C))
        tma.store_wait(0)
        _barrier()
        mbarrier.arrive(kv_free, count=1)  # the tiles may take the next key tile's K and V
        return end

    @gluon.jit
    def _bwd_consumer(dk_desc, dv_desc, dqa_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem, ds_smem,
                      dq_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, ds_bar, end_bar, b, hk, tile,
                      twin, GROUP, SEQ_Q, qk_scale, sm_scale, CAUSAL: gl.constexpr, C: gl.constexpr):
        """Warpgroup C over the CTA's key tiles: ``tile`` (q blocks down), then ``twin`` (up) unless the same."""
        base = 0
        for nth in range(1 + (twin != tile).to(gl.int32)):
            base = _bwd_tile(dk_desc, dv_desc, dqa_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem,
                             ds_smem, dq_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, ds_bar, end_bar,
                             b, hk, tile + nth * (twin - tile), base, nth, 1 - nth, GROUP, SEQ_Q, qk_scale, sm_scale,
                             CAUSAL, C)

    @gluon.jit
    def _bwd_load_tile(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                       lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, b, hk, tile, base, desc,
                       SEQ_Q, GROUP, HQ, CAUSAL: gl.constexpr):
        """Both K and V halves of key tile ``tile``, then Q and dO block by block in ``_bwd_block``'s
        order, into ring steps from ``base``; returns the next tile's base."""
        HALF_N: gl.constexpr = k_desc.block_type.shape[2]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        NSTAGES: gl.constexpr = q_smem.shape[0]
        start_n, lo, n_m = _bwd_span(tile, SEQ_Q, HALF_N, BLOCK_M, CAUSAL)
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for c in gl.static_range(2):
            _tma_load(k_desc, [b, hk, start_n + c * HALF_N, 0], kv_bar, k_smem.index(c))
            _tma_load(v_desc, [b, hk, start_n + c * HALF_N, 0], kv_bar, v_smem.index(c))
        for t in range(base, base + GROUP * n_m):
            h = _bwd_head(t - base, tile, hk, GROUP)
            row = (lo + _bwd_block(t - base, n_m, GROUP, desc)) * BLOCK_M
            stage = t % NSTAGES
            phase = ((t // NSTAGES) & 1) ^ 1
            mbarrier.wait(q_empty.index(stage), phase)
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, row, 0], q_ready.index(stage), q_smem.index(stage))
            _tma_load(lse_desc, [b * HQ + h, row], q_ready.index(stage), lse_smem.index(stage))
            mbarrier.wait(do_empty.index(stage), phase)
            mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            _tma_load(do_desc, [b, h, row, 0], do_ready.index(stage), do_smem.index(stage))
            _tma_load(delta_desc, [b * HQ + h, row], do_ready.index(stage), delta_smem.index(stage))
        return base + GROUP * n_m

    @gluon.jit
    def _bwd_producer(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
                      delta_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, b, hk, tile, twin, SEQ_Q,
                      GROUP, HQ, CAUSAL: gl.constexpr):
        """One warp: the CTA's key tiles in turn; the twin's K and V once the consumers have stored the
        first tile's dK and dV from those buffers."""
        base = 0
        for nth in range(1 + (twin != tile).to(gl.int32)):
            mbarrier.wait(kv_free, (nth & 1) ^ 1)  # a fresh mbarrier counts as "previous phase complete"
            base = _bwd_load_tile(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem,
                                  do_smem, lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, b, hk,
                                  tile + nth * (twin - tile), base, 1 - nth, SEQ_Q, GROUP, HQ, CAUSAL)

    @gluon.jit
    def _attn_bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, lse_desc, delta_desc, HQ,
                            HKV, GROUP, SEQ_Q, SEQ_K, qk_scale, sm_scale, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        """The whole backward in one pass over the keys: two consumer warpgroups (64 keys each, one CTA
        tile of 128) and a TMA producer warp; dQ is reduce-added into an fp32 accumulator.

        Causal grids give each CTA two key tiles, the i-th from the start and the i-th from the end
        (the first's q blocks from the last down, then the twin's from its first up): every CTA has the
        same work, so no tail, and at any moment the CTAs of a kv head are on one of two q blocks, so
        the group's Q, dO and dQ tiles come from DRAM about twice instead of once per key tile. One tile
        per CTA, longest first, in head-major order took 1.02-1.41x as long at the GQA model shapes."""
        HALF_N: gl.constexpr = k_desc.block_type.shape[2]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        # grid (key tiles or causal's tile pairs, batch * kv heads), tiles fastest: a kv head's CTAs run
        # side by side and share each Q/dO tile and its dQ rows in L2 (``_bwd_block``). Heads fastest put
        # one CTA per head in flight once batch x kv heads reached the SM count: the 4x32x4096x128 causal
        # backward ran at 234 TFLOP/s, where the tiles-fastest order (one tile a CTA) had run 419
        tile = gl.program_id(0)
        bhk = gl.program_id(1)
        b = bhk // HKV
        hk = bhk % HKV
        if CAUSAL:
            twin = gl.cdiv(SEQ_K, 2 * HALF_N) - 1 - tile
        else:
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
        gl.warp_specialize([
            (_bwd_consumer, (dk_desc, dv_desc, dqa_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem, ds_smem,
                             dq_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, ds_bar, end_bar, b, hk,
                             tile, twin, GROUP, SEQ_Q, qk_scale, sm_scale, CAUSAL, 0)),
            (_bwd_consumer, (dk_desc, dv_desc, dqa_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem, ds_smem,
                             dq_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, ds_bar, end_bar, b, hk,
                             tile, twin, GROUP, SEQ_Q, qk_scale, sm_scale, CAUSAL, 1)),
            (_bwd_producer, (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                             lse_smem, delta_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, do_empty, b, hk, tile,
                             twin, SEQ_Q, GROUP, HQ, CAUSAL)),
        ], [4, 1], [240, 24])


def fwd_warpgroups(head_dim: int, causal: bool) -> int:
    """Consumer warpgroups of the forward's CTA. Three (192 query rows) at head dim 64 without the
    mask, where each K/V tile then feeds three q.k^T and p.v pairs: 8x32x2048x64 went from 0.617-0.634
    to 0.560-0.590 ms on an H100. Causal stays at two: the 192-row tiles' diagonal took
    4x32/8x2048x64 from 0.192 to 0.215 ms, even with each warpgroup stopping at its own last key block."""
    return 3 if head_dim == 64 and not causal else 2


def maxnreg(warpgroups: int) -> int:
    """The kernel-wide register cap for ``warpgroups`` (consumers and the producer's, rounded up) of
    128 threads sharing the SM's 64K registers. ``warp_specialize`` then moves them between partitions:
    the worker consumers take 240 (two consumers) or 160 (three) and the producer warp 24; the default
    partition (consumer 0) gets what is left."""
    return 65536 // (128 * warpgroups) // 8 * 8


def fwd_schedule(batch_heads: int, group: int, tiles: int, rows: int, seq_k: int, causal: bool, ctas: int,
                 kv_heads_per_section: int) -> list[int]:
    """The persistent forward's work list: ``ctas + 1`` offsets into the list itself (CTA c takes the
    entries ``offsets[c]:offsets[c + 1]``, in order), then the query tiles, each coded
    ``bh * tiles + t``, then a spare entry the kernel may read ahead into.

    Heads go in sections of ``kv_heads_per_section`` GQA groups (whose K/V fit in L2: the CTAs working
    on a section share it). A causal section's tiles go longest first, each to the CTA with the least
    work so far (FlashAttention-3's scheduler also hands out causal tiles longest first by L2-sized head
    sections, at run time): the launch then ends on the shortest tiles, where pairing a head's tiles
    n-1-u and u into equal units left 1024 units on 132 SMs (4x32x2048 at 128 rows, 1x32x8192) to end
    in a round with 100 busy. Unmasked tiles are all alike: round robin, a head's tiles side by side."""
    section = kv_heads_per_section * group
    sections = [range(s, min(s + section, batch_heads)) for s in range(0, batch_heads, section)]
    if not causal:
        work = [bh * tiles + t for heads in sections for bh in heads for t in range(tiles)]
        lists = [work[c::ctas] for c in range(ctas)]
    else:
        lists = [[] for _ in range(ctas)]
        load = [(0, c) for c in range(ctas)]
        for heads in sections:
            for t in reversed(range(tiles)):
                # a tile costs its key blocks plus about one more (its first q.k^T waited alone, its output)
                cost = cdiv(min((t + 1) * rows, seq_k), BLOCK_N) + 1
                for bh in heads:
                    done, c = heapq.heappop(load)
                    lists[c].append(bh * tiles + t)
                    heapq.heappush(load, (done + cost, c))
    offsets = list(itertools.accumulate((len(work) for work in lists), initial=ctas + 1))
    return offsets + [code for work in lists for code in work] + [0]


@functools.lru_cache(maxsize=None)
def _fwd_schedule_on(device: torch.device, *problem) -> torch.Tensor:
    """``fwd_schedule(*problem)`` on ``device``, kept for the life of the process (a few KB a problem):
    a CUDA graph that captured a launch holds its address, so it outlives the launch plans."""
    return torch.tensor(fwd_schedule(*problem), dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def eligible(q: torch.Tensor, k: torch.Tensor, scale: float, *tensors: torch.Tensor) -> bool:
    """Whether these kernels take the problem: what they were measured and tested on. ``tensors`` are
    the others the kernel reads or writes through TMA (v, o or dO, dK, dV)."""
    if not _GLUON or not q.is_cuda or getattr(torch.version, "hip", None):
        return False
    d = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and 64 <= d <= HEAD_DIM and scale > 0
            and k.shape[2] > 0 and q.shape[0] * q.shape[1] <= MAX_GRID_Y
            and _is_sm90(q.device.index if q.device.index is not None else torch.cuda.current_device())
            and tma_ok(q, k, *tensors))  # the op's own TMA rules: aligned base and strides, unit last stride


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The persistent forward's CTA count: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(device: torch.device) -> int:
    """The L2 cache the forward's schedule sizes its head sections by."""
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype, swizzle: int | None, rank: int = 4):
    """A tile's swizzled shared-memory layout (the widest swizzle unless ``swizzle`` bytes are asked
    for), built once: ``get_default_for`` costs ~19 us a call, and a forward + backward builds thirteen."""
    if swizzle is not None:
        return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=dtype.itemsize * 8, rank=rank)
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gl_dtype)


def _descriptor(t: torch.Tensor, rows: int, cols: int = HEAD_DIM, swizzle: int | None = None):
    layout = _smem_layout(rows, cols, t.dtype, swizzle)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols], layout)


# Eager launch plans by problem (every shape and stride, dtype, causal, scale, device): a repeated
# call skips eligible(), the descriptors' validation and the launch key, host time that a
# 2048-token step waits on. A plan holds no tensor: each call rebases the recorded descriptors.
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def _problem_key(causal: bool, scale: float, *tensors: torch.Tensor) -> tuple:
    return (tensors[0].dtype, tensors[0].device, bool(causal), scale,
            *[(t.shape, t.stride()) for t in tensors])


def _rebased(desc, t):
    """``desc`` over tensor ``t`` of the same shape and strides (a plan's key fixed them), without
    TensorDescriptor's validation; ``t=None`` for the copy a plan keeps."""
    rebased = object.__new__(TensorDescriptor)
    rebased.__dict__.update(desc.__dict__)
    rebased.base = t
    return rebased


def _launch_planned(plans: PlanCache, key: tuple, kernel, grid, descriptors: tuple, args: tuple, kwargs: dict,
                    kept: tuple = ()):
    """Launch, and keep the plan with its descriptors' copies and ``kept``: the tensors among ``args``
    that belong to the problem, not the call (the forward's schedule)."""
    plan = launch(kernel, grid, (*descriptors, *args), kwargs, plan=True)
    if plan is not None:
        plans[key] = (plan, [_rebased(d, None) for d in descriptors], kept)


def attention_forward(q, k, v, o, lse, causal: bool, scale: float) -> bool:
    """The ``attention_forward`` hook: fill ``o`` and ``lse`` (base-2 logsumexp of the scaled scores,
    rows padded with +inf beforehand) and return True, or return False to leave the problem to the op."""
    key = _problem_key(causal, scale, q, k, v, o, lse)
    hit = _FWD_PLANS.get(key)
    if hit is not None:
        plan, descs, (schedule, ) = hit
        if plan(_rebased(descs[0], q), _rebased(descs[1], k), _rebased(descs[2], v), _rebased(descs[3], o), lse,
                schedule):
            return True
    if q.shape[2] <= HALF_M or not eligible(q, k, scale, v, o):  # decode-sized queries: half a tile idles
        return False
    batch, heads_q, seq_q, d = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    tile_d = 64 if d == 64 else HEAD_DIM
    wgs = fwd_warpgroups(tile_d, causal)
    tiles = cdiv(seq_q, wgs * HALF_M)
    ctas = min(batch * heads_q * tiles, _sm_count(q.device))
    kv_head_bytes = 2 * seq_k * tile_d * k.element_size()
    schedule = _fwd_schedule_on(q.device, batch * heads_q, heads_q // heads_kv, tiles, wgs * HALF_M, seq_k,
                                bool(causal), ctas, max(1, _l2_bytes(q.device) // 2 // kv_head_bytes))
    _launch_planned(_FWD_PLANS, key, _attn_fwd_ws_kernel, (ctas, ),
                    (_descriptor(q, HALF_M, tile_d), _descriptor(k, BLOCK_N, tile_d),
                     _descriptor(v, BLOCK_N, tile_d), _descriptor(o, HALF_M, tile_d)),
                    (lse, schedule, heads_q, heads_q // heads_kv, seq_q, seq_k, lse.shape[-1], scale * LOG2E),
                    dict(CAUSAL=bool(causal), STAGES=STAGES, WGS=wgs, num_warps=4, maxnreg=maxnreg(wgs + 1)),
                    kept=(schedule, ))
    return True


def _rows_descriptor(t: torch.Tensor, rows: int):
    """Per-row fp32 state (lse, delta: (batch, heads, padded rows)) as one q block's TMA tiles of
    (batch * heads, rows)."""
    flat = t.view(-1, t.shape[-1])
    layout = _smem_layout(1, rows, t.dtype, 0, rank=2)  # unswizzled: read row-wise at use
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, rows], layout)


def _bwd_descriptors(q, k, v, do, dk, dv, dqa, lse, delta):
    """The backward kernel's tiles, head dim padded as ``dqa`` is (64 at d=64, else 128)."""
    tile_d = dqa.shape[-1]
    block_m = BWD_BLOCK_M_D64 if tile_d == 64 else BWD_BLOCK_M
    # dQ's B operand is half the head dim of the K tile: the slice must start on a swizzle atom
    k_swizzle = tile_d  # bytes: half a row of 16-bit elements
    return (_descriptor(q, block_m, tile_d), _descriptor(k, BWD_HALF_N, tile_d, k_swizzle),
            _descriptor(v, BWD_HALF_N, tile_d), _descriptor(do, block_m, tile_d),
            _descriptor(dk, BWD_HALF_N, tile_d, k_swizzle), _descriptor(dv, BWD_HALF_N, tile_d),
            _descriptor(dqa, block_m, tile_d // 2), _rows_descriptor(lse, block_m), _rows_descriptor(delta, block_m))


def attention_backward(q, k, v, do, dqa, dk, dv, lse, delta, causal: bool, scale: float) -> bool:
    """The ``attention_backward`` hook: in one pass over the keys, add dQ into the op's zeroed fp32
    accumulator ``dqa`` (head dim padded to 64 or 128) by TMA reduce-adds and fill ``dk`` and ``dv``,
    from the forward's lse and the op's delta (rowsum(dO * O)), both per q row with padded rows +inf
    and 0; or return False. dQ's fp32 sums land in arrival order, so its last bits may differ between
    runs (as FlashAttention's dQ); dK and dV are deterministic."""
    key = _problem_key(causal, scale, q, k, v, do, dk, dv, dqa, lse, delta)
    hit = _BWD_PLANS.get(key)
    if hit is not None:
        plan, descs, _ = hit
        tensors = (q, k, v, do, dk, dv, dqa, lse.view(-1, lse.shape[-1]), delta.view(-1, delta.shape[-1]))
        if plan(*[_rebased(d, t) for d, t in zip(descs, tensors)]):
            return True
    if not eligible(q, k, scale, v, do, dk, dv):
        return False
    batch, heads_q, seq_q, _ = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    tiles = cdiv(seq_k, 2 * BWD_HALF_N)
    grid = (cdiv(tiles, 2) if causal else tiles, batch * heads_kv)  # causal: a CTA takes tiles i and -1-i
    _launch_planned(_BWD_PLANS, key, _attn_bwd_ws_kernel, grid, _bwd_descriptors(q, k, v, do, dk, dv, dqa, lse, delta),
                    (heads_q, heads_kv, heads_q // heads_kv, seq_q, seq_k, scale * LOG2E, scale),
                    dict(CAUSAL=bool(causal), STAGES=STAGES, num_warps=4, maxnreg=maxnreg(3)))
    return True
