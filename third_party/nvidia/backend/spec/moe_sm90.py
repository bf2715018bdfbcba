"""Hopper's grouped GEMMs of the experts, in Gluon: the ``moe_experts_gemm`` and ``moe_weight_grad`` hooks.

Why a second kernel: the portable ``tl`` GEMMs issue each K step's gate and up products as two 64 x 128
wgmmas a warpgroup with one MMA in flight, and reach ~540 TFLOP/s on Mixtral's gate/up projection on an
H100 where cuBLAS does ~710 on a dense GEMM of that size. Here the gate rows and the up rows of the
expert's weight land in one 2*BLOCK_N-row shared-memory tile, so each K step is one 64 x 256 wgmma a
warpgroup, the TMA loads run two steps ahead of it and each wgmma is issued before the last one is waited
for: 609 TFLOP/s, bit for bit the ``tl`` kernel's result (the same products, summed in the same order).
The rows come sorted (the op gathers them first, a 44 us copy at Mixtral's 4096 tokens), so the A tiles are
TMA loads too.

It takes only what it was measured faster on: sm90, fp16/bf16, 512 rows an expert or more on average
(DeepSeek-V3's 128 were slower), 128-row blocks, 16-byte aligned rows, no bias; the gate/up projection, whose
rows the op gathers for it, only for experts of ``MIN_EXPERT_ELEMENTS`` or more (Mixtral-8x7B: Qwen3-30B-A3B's
small experts gained nothing once the gather is paid), the GEMMs over rows that are sorted already at any size
(Qwen3-30B-A3B forward+backward 2-4 % faster). Anything else declines and the op runs its portable kernels.

The weight gradients of smaller experts (Qwen3-30B-A3B, DeepSeek-V3) sum over each expert's rows, one operand
being the tokens' rows in the sort's order: sorting them first cost more than it saved, and the ``tl`` kernel,
which gathers them in its K loop, reached ~350 TFLOP/s. Here the gathered rows come by cp.async, each thread
copying 16-byte pieces of one row (one pair read and one address computed a step), the sorted operand by TMA,
into the same 64 x 256 wgmma a warpgroup: 480-530 TFLOP/s at Qwen3's 32768 tokens, bit for bit the ``tl``
kernel's result again. Where both operands are sorted rows (large experts) the ``tl`` TMA kernel is as fast.
"""

from __future__ import annotations

import functools

import torch

from tritonspec.ops._library import cdiv, launch

from .gluon_compat import GLUON

BLOCK_M = 128  # rows a tile: the sort's block, one expert's
BLOCK_N = 128  # columns of h (gate/up), half the wgmma's 256 (plain GEMMs: the tile is 2 * BLOCK_N wide)
BLOCK_K = 64
STAGES = 4  # TMA ring; AHEAD + IN_FLIGHT <= STAGES - 1 keeps a slot from being loaded while a wgmma reads it
AHEAD = 2  # K steps the loads run ahead of the wgmma
IN_FLIGHT = 1  # wgmmas left in flight when the next is issued
GROUP_M = 8  # row blocks whose column tiles run together (each weight tile then serves them from L2)
MIN_ROWS_PER_EXPERT = 512
WG_MIN_ROWS_PER_EXPERT = 128  # the weight gradients: faster at DeepSeek-V3's 128 rows an expert already
MIN_EXPERT_ELEMENTS = 1 << 25  # gate/up: K * N of one expert's weight (Mixtral's 4096 x 14336 is 2^25.8)

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_compat import cp_async_load, thread_barrier, tma_load, tma_store

    @gluon.jit
    def _grouped_tile(pid, num_m, num_n, GROUP: gl.constexpr):
        """(pid_m, pid_n) with the column tiles of GROUP consecutive row blocks running together."""
        in_group = GROUP * num_n
        first_m = (pid // in_group) * GROUP
        size_m = gl.minimum(num_m - first_m, GROUP)
        return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m

    @gluon.jit
    def _load_step(
        i,
        a_desc,
        b_desc,
        off_m,
        b_row,
        b_row2,
        off_k0,
        bars,
        a_bufs,
        b_bufs,
        GATE_UP: gl.constexpr,
        K_MAJOR: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """K step i's A tile and B tile into ring slot i % STAGES. K-major B: rows b_row (and, GATE_UP, the
        up rows b_row2) of (E * N, K) at column i * BLOCK_K; else rows off_k0 + i * BLOCK_K of (E * K, N)."""
        BK: gl.constexpr = a_desc.block_type.shape[1]
        s = i % STAGES
        bar = bars.index(s)
        b_bytes: gl.constexpr = b_desc.block_type.nbytes * (2 if GATE_UP else 1)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_bytes)
        tma_load(a_desc, [off_m, i * BK], bar, a_bufs.index(s))
        if GATE_UP:
            half: gl.constexpr = b_desc.block_type.shape[0]
            tma_load(b_desc, [b_row, i * BK], bar, b_bufs.index(s).slice(0, half, dim=0))
            tma_load(b_desc, [b_row2, i * BK], bar, b_bufs.index(s).slice(half, half, dim=0))
        elif K_MAJOR:
            tma_load(b_desc, [b_row, i * BK], bar, b_bufs.index(s))
        else:
            tma_load(b_desc, [off_k0 + i * BK, b_row], bar, b_bufs.index(s))

    @gluon.jit
    def _moe_gemm_sm90_kernel(
        a_desc,  # (R, K) sorted rows, (BLOCK_M, BLOCK_K) tiles
        b_desc,  # the experts' weights: K-major (E * N', K) tiles (rows, BLOCK_K), else (E * K, N) (BLOCK_K, 2 BLOCK_N)
        c_desc,  # out: GATE_UP: the gate half of gu (R, N), row stride 2N; else c (R, N), (BLOCK_M, 2 BLOCK_N) tiles
        u_desc,  # GATE_UP: the up half of gu
        h_desc,  # GATE_UP: h = silu(gate) * up (R, N)
        BLOCK_EXPERT,  # (R / BLOCK_M,) each row block's expert, -1 past the last expert's rows
        N,  # output columns (GATE_UP: of h)
        K,
        num_m,
        GATE_UP: gl.constexpr,
        STORE_GU: gl.constexpr,
        K_MAJOR: gl.constexpr,
        B_LAYOUT: gl.constexpr,  # the ring's B slot: (2 BLOCK_N, BLOCK_K) K-major, else (BLOCK_K, 2 BLOCK_N)
        C_LAYOUT: gl.constexpr,  # the (BLOCK_M, 2 BLOCK_N) result tile
        GROUP: gl.constexpr,
        STAGES: gl.constexpr,
        AHEAD: gl.constexpr,
        IN_FLIGHT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """One (BLOCK_M, 2 BLOCK_N) tile of a row block's product with its expert's weight; row blocks of
        no expert (-1) get zeros, padding rows of an expert's block are zero rows of A and so zeros too."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN2: gl.constexpr = c_desc.block_type.shape[1] * (2 if GATE_UP else 1)  # the wgmma's N
        dtype: gl.constexpr = a_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN2, 16]
        )
        out_n: gl.constexpr = BN2 // 2 if GATE_UP else BN2
        pid_m, pid_n = _grouped_tile(gl.program_id(0), num_m, gl.cdiv(N, out_n), GROUP)
        expert = gl.load(BLOCK_EXPERT + pid_m)
        off_m = pid_m * BM
        off_n = pid_n * out_n
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        b_shape: gl.constexpr = [BN2, BK] if K_MAJOR else [BK, BN2]
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_shape, B_LAYOUT)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(bars.index(slot), count=1)
        if GATE_UP:  # allocated here so that it cannot share the result tile's bytes, which TMA may still read
            h_smem = gl.allocate_shared_memory(dtype, [BM, BN2 // 2], h_desc.layout)
        acc = gl.zeros((BM, BN2), dtype=gl.float32, layout=acc_layout)
        if expert >= 0:
            if GATE_UP:  # the expert's gate rows [e 2N + off_n, +BN) and up rows N further
                b_row = expert * 2 * N + off_n
                b_row2 = b_row + N
                off_k0 = 0
            elif K_MAJOR:
                b_row = expert * N + off_n
                b_row2 = b_row
                off_k0 = 0
            else:
                b_row = off_n
                b_row2 = off_n
                off_k0 = expert * K
            n_k = gl.cdiv(K, BK)
            for p in gl.static_range(AHEAD):
                if p < n_k:
                    _load_step(
                        p, a_desc, b_desc, off_m, b_row, b_row2, off_k0, bars, a_bufs, b_bufs, GATE_UP, K_MAJOR, STAGES
                    )
            for i in range(n_k):
                if i + AHEAD < n_k:
                    _load_step(
                        i + AHEAD,
                        a_desc,
                        b_desc,
                        off_m,
                        b_row,
                        b_row2,
                        off_k0,
                        bars,
                        a_bufs,
                        b_bufs,
                        GATE_UP,
                        K_MAJOR,
                        STAGES,
                    )
                s = i % STAGES
                mbarrier.wait(bars.index(s), (i // STAGES) & 1)
                if K_MAJOR:
                    b = b_bufs.index(s).permute((1, 0))
                else:
                    b = b_bufs.index(s)
                acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
                acc = warpgroup_mma_wait(IN_FLIGHT, deps=(acc,))
            acc = warpgroup_mma_wait(0, deps=(acc,))
        for slot in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(slot))
        c_smem = gl.allocate_shared_memory(dtype, [BM, BN2], C_LAYOUT)
        c_smem.store(acc.to(dtype))
        fence_async_shared()
        if GATE_UP:
            # As a Hugging Face expert rounds: the projections' outputs, the activation, the product
            half: gl.constexpr = BN2 // 2
            if STORE_GU:
                tma_store(c_desc, [off_m, off_n], c_smem.slice(0, half, dim=1))
                tma_store(u_desc, [off_m, off_n], c_smem.slice(half, half, dim=1))
            ew: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            gate = c_smem.slice(0, half, dim=1).load(ew).to(gl.float32)
            up = c_smem.slice(half, half, dim=1).load(ew).to(gl.float32)
            h = (gate * (1.0 / (1.0 + gl.exp(-gate)))).to(dtype).to(gl.float32) * up
            h_smem.store(h.to(dtype))
            fence_async_shared()
            tma_store(h_desc, [off_m, off_n], h_smem)
        else:
            tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(0)

    @gluon.jit
    def _step_pairs(ROW_PAIR, first, step, n_k, BK: gl.constexpr, layout: gl.constexpr):
        """The pairs of K step ``step``'s sort rows (-1: a padding row, or past the expert's last step), in the
        row layout of a gathered tile's registers."""
        rows = first + step * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
        return gl.load(ROW_PAIR + rows, mask=rows < first + n_k * BK, other=-1)

    @gluon.jit
    def _wg_load_step(
        i, first, l_desc, r_desc, src, stride, pairs, TOP_K, off_m, off_n, bar, l_smem, r_smem,
        GATHER: gl.constexpr, G_LAYOUT: gl.constexpr,
    ):  # fmt: skip
        """K step i (sort rows first + i * BK ..) of both operands into one ring slot: the sorted rows by TMA
        (``bar``), the gathered operand's tokens' rows (GATHER 1: L's, 2: R's; ``pairs``, the step's) by
        cp.async, padding rows zero-filled."""
        BK: gl.constexpr = l_smem.shape[0]
        row0 = first + i * BK
        if GATHER == 1:
            smem = l_smem
            off_c = off_m
            mbarrier.expect(bar, r_desc.block_type.nbytes)
            tma_load(r_desc, [row0, off_n], bar, r_smem)
        else:
            smem = r_smem
            off_c = off_n
            mbarrier.expect(bar, l_desc.block_type.nbytes)
            tma_load(l_desc, [row0, off_m], bar, l_smem)
        BC: gl.constexpr = smem.shape[1]
        tokens = gl.where(pairs >= 0, pairs // TOP_K, 0).to(gl.int64)
        cols = off_c + gl.arange(0, BC, layout=gl.SliceLayout(0, G_LAYOUT))
        ptrs = src + gl.expand_dims(tokens * stride, 1) + gl.expand_dims(cols, 0)
        cp_async_load(smem, ptrs, mask=gl.expand_dims(pairs >= 0, 1))

    @gluon.jit
    def _moe_weight_grad_sm90_kernel(
        l_desc,  # (R, M) sorted rows, (BLOCK_K, BLOCK_M) tiles (GATHER 1: stands in for the block shape only)
        r_desc,  # (R, N) sorted rows, (BLOCK_K, BLOCK_N) tiles (GATHER 2: likewise)
        dw_desc,  # out: the gradients (E * M, N), (BLOCK_M, BLOCK_N) tiles
        SRC,  # GATHER: the gathered operand's tokens' rows, (T, M) or (T, N) by row stride stride_src
        stride_src,
        ROW_PAIR,  # the sort (moe_sort.SortedPairs): each row's pair, -1 in padding rows
        EXPERT_START,
        EXPERT_ROWS,
        M,
        N,
        TOP_K,
        GATHER: gl.constexpr,  # 1: L gathered from the tokens' rows, R sorted rows; 2: the other way round
        G_LAYOUT: gl.constexpr,  # the registers' layout of a gathered (BLOCK_K, BLOCK_M or BLOCK_N) tile
        GROUP: gl.constexpr,
        STAGES: gl.constexpr,
        AHEAD: gl.constexpr,
        IN_FLIGHT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """dW_e tile (BLOCK_M, BLOCK_N) = the sum over expert e's rows of L_row^T R_row: one 64 x BLOCK_N wgmma a
        warpgroup a K step of 64 rows, A being L's tile read transposed. An expert without rows gets zeros;
        padding rows are zeros in the sorted operands and zero-filled in the gathered one."""
        BK: gl.constexpr = l_desc.block_type.shape[0]
        BM: gl.constexpr = l_desc.block_type.shape[1]
        BN: gl.constexpr = r_desc.block_type.shape[1]
        dtype: gl.constexpr = dw_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        e = gl.program_id(1)
        pid_m, pid_n = _grouped_tile(gl.program_id(0), M // BM, N // BN, GROUP)
        off_m = pid_m * BM
        off_n = pid_n * BN
        first = gl.load(EXPERT_START + e)
        n_k = gl.cdiv(gl.load(EXPERT_ROWS + e), BK)
        l_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BM], l_desc.layout)
        r_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], r_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(STAGES):
            mbarrier.init(bars.index(slot), count=1)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        if n_k > 0:  # (a loop that may run no step makes ptxas serialize the wgmmas)
            for p in gl.static_range(AHEAD):
                if p < n_k:
                    pairs = _step_pairs(ROW_PAIR, first, p, n_k, BK, G_LAYOUT)
                    _wg_load_step(
                        p, first, l_desc, r_desc, SRC, stride_src, pairs, TOP_K, off_m, off_n, bars.index(p),
                        l_bufs.index(p), r_bufs.index(p), GATHER, G_LAYOUT,
                    )  # fmt: skip
                async_copy.commit_group()
            # each step's pairs are loaded a step before its copies: their latency off the copies' issue (Qwen3's
            # weight gradients at 32768 tokens 480-487 -> 516-529 TFLOP/s on an H100)
            pairs = _step_pairs(ROW_PAIR, first, AHEAD, n_k, BK, G_LAYOUT)
            for i in range(n_k):
                s = i % STAGES
                # step i's copies, from every thread, visible to the tensor cores' proxy
                async_copy.wait_group(AHEAD - 1)
                fence_async_shared()
                thread_barrier()
                mbarrier.wait(bars.index(s), (i // STAGES) & 1)
                acc = warpgroup_mma(l_bufs.index(s).permute((1, 0)), r_bufs.index(s), acc, is_async=True)
                # while it runs, the loads of step i + AHEAD, into the slot step i + AHEAD - STAGES's wgmmas read:
                # both warpgroups waited for those before the barrier (AHEAD + IN_FLIGHT <= STAGES - 1)
                if i + AHEAD < n_k:
                    t = (i + AHEAD) % STAGES
                    _wg_load_step(
                        i + AHEAD, first, l_desc, r_desc, SRC, stride_src, pairs, TOP_K, off_m, off_n,
                        bars.index(t), l_bufs.index(t), r_bufs.index(t), GATHER, G_LAYOUT,
                    )  # fmt: skip
                    pairs = _step_pairs(ROW_PAIR, first, i + AHEAD + 1, n_k, BK, G_LAYOUT)
                async_copy.commit_group()
                acc = warpgroup_mma_wait(IN_FLIGHT, deps=(acc,))
            acc = warpgroup_mma_wait(0, deps=(acc,))
        for slot in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(slot))
        c_smem = gl.allocate_shared_memory(dtype, [BM, BN], dw_desc.layout)
        c_smem.store(acc.to(dtype))
        fence_async_shared()
        tma_store(dw_desc, [e * M + off_m, off_n], c_smem)
        tma.store_wait(0)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.lru_cache(maxsize=None)
def _layout(shape: tuple, dtype: torch.dtype):
    """A tile's swizzled shared-memory layout, built once (``get_default_for`` costs ~19 us a call)."""
    return gl.NVMMASharedLayout.get_default_for(
        list(shape), {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    )


def _desc(t: torch.Tensor, shape, strides, block):
    return TensorDescriptor(t, list(shape), list(strides), list(block), _layout(tuple(block), t.dtype))


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _weight_tiles(b: torch.Tensor, gate_up: bool):
    """(descriptor, k_major) over the experts' weights ``b`` ((E, K, N') by strides) as the 2-D tensor
    their storage is, or None: K-major (E * N', K) or (E * K, N') with K a multiple of BLOCK_K (a K tile
    must not run into the next expert's rows); gate/up weights only K-major ([gate; up] rows)."""
    E, K, N = b.shape
    size = b.element_size()
    if b.stride() == (K * N, 1, K) and K * size % 16 == 0:
        return _desc(b, [E * N, K], [K, 1], [BLOCK_N if gate_up else 2 * BLOCK_N, BLOCK_K]), True
    if not gate_up and b.stride() == (K * N, N, 1) and N * size % 16 == 0 and K % BLOCK_K == 0:
        return _desc(b, [E * K, N], [N, 1], [BLOCK_K, 2 * BLOCK_N]), False
    return None


def moe_experts_gemm(b, c, block_expert, *, gate_up: bool, gu=None):
    """The ``moe_experts_gemm`` hook: take the problem by returning ``run(a)``, or return None before the op
    gathers the rows it would need."""
    if not GLUON or not c.is_cuda or getattr(torch.version, "hip", None):
        return None
    R, N = c.shape
    E, K = b.shape[0], b.shape[1]
    if (
        c.dtype not in (torch.float16, torch.bfloat16)
        or b.dtype != c.dtype
        or R != block_expert.numel() * BLOCK_M
        or R < MIN_ROWS_PER_EXPERT * E
        or (gate_up and K * N < MIN_EXPERT_ELEMENTS)
        or not c.is_contiguous()
        or (gu is not None and not gu.is_contiguous())
        or N * c.element_size() % 16
        or K * c.element_size() % 16
        or not _aligned(b, c, *(() if gu is None else (gu,)))
        or not _is_sm90(c.device.index if c.device.index is not None else torch.cuda.current_device())
    ):
        return None
    tiles = _weight_tiles(b, gate_up)
    if tiles is None:
        return None
    b_desc, k_major = tiles
    bn2 = 2 * BLOCK_N
    if gate_up:  # without gu the kernel reads no gate/up descriptor: h's stands in for them
        h_desc = _desc(c, [R, N], [N, 1], [BLOCK_M, BLOCK_N])
        gate = h_desc if gu is None else _desc(gu, [R, N], [2 * N, 1], [BLOCK_M, BLOCK_N])
        up = h_desc if gu is None else _desc(gu[:, N:], [R, N], [2 * N, 1], [BLOCK_M, BLOCK_N])
        out = dict(c_desc=gate, u_desc=up, h_desc=h_desc)
        tile_n = BLOCK_N
    else:  # one output: the other two descriptors are never read
        c_desc = _desc(c, [R, N], [N, 1], [BLOCK_M, bn2])
        out = dict(c_desc=c_desc, u_desc=c_desc, h_desc=c_desc)
        tile_n = bn2
    dtype = c.dtype

    def run(a: torch.Tensor) -> None:
        if a.shape != (R, K) or a.dtype != dtype or not a.is_contiguous() or not _aligned(a):
            raise ValueError(f"moe_experts_gemm: rows must be contiguous ({R}, {K}) {dtype}, got {tuple(a.shape)}")
        launch(
            _moe_gemm_sm90_kernel,
            (R // BLOCK_M * cdiv(N, tile_n),),
            a_desc=_desc(a, [R, K], [K, 1], [BLOCK_M, BLOCK_K]),
            b_desc=b_desc,
            **out,
            BLOCK_EXPERT=block_expert,
            N=N,
            K=K,
            num_m=R // BLOCK_M,
            GATE_UP=gate_up,
            STORE_GU=gu is not None,
            K_MAJOR=k_major,
            B_LAYOUT=_layout((bn2, BLOCK_K) if k_major else (BLOCK_K, bn2), dtype),
            C_LAYOUT=_layout((BLOCK_M, bn2), dtype),
            GROUP=GROUP_M,
            STAGES=STAGES,
            AHEAD=AHEAD,
            IN_FLIGHT=IN_FLIGHT,
            num_warps=8,
        )

    return run


WG_BLOCK_M = 128  # the weight gradient's tile: rows of dW (L's columns), one 64-row half a warpgroup
WG_BLOCK_N = 256  # columns of dW (R's columns): the wgmma's N


@functools.lru_cache(maxsize=None)
def _gather_layout():
    """Registers of a gathered (BLOCK_K, columns) tile over 8 warps: each thread's 16-byte copies in one row (4
    threads a row, each thread's pieces 64 bytes apart), so that each thread reads one pair and computes one
    token's address a step."""
    return gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])


def _weight_grad_taken(lhs, rhs, dw, rows: int, block_m: int, gather_l: bool, gather_r: bool) -> bool:
    """What the weight-gradient kernel was measured faster on and can tile, whatever the device: exactly one
    operand gathered (both sorted, large experts: the portable TMA kernel was as fast), fp16/bf16, a contiguous
    dw of whole (WG_BLOCK_M, WG_BLOCK_N) tiles, K steps that stay in an expert's padded rows, 128 rows an expert
    or more on average, and rows TMA and 16-byte copies can read."""
    E, M, N = dw.shape
    dtype = dw.dtype
    return not (
        dtype not in (torch.float16, torch.bfloat16)
        or lhs.dtype != dtype
        or rhs.dtype != dtype
        or gather_l == gather_r
        or not dw.is_contiguous()
        or M % WG_BLOCK_M
        or N % WG_BLOCK_N
        or block_m % BLOCK_K
        or rows < WG_MIN_ROWS_PER_EXPERT * E
        or lhs.shape[1] != M
        or rhs.shape[1] != N
        or lhs.stride(1) != 1
        or rhs.stride(1) != 1
        or any(t.stride(0) * t.element_size() % 16 for t in (lhs, rhs))
        or (not gather_l and lhs.shape[0] != rows)
        or (not gather_r and rhs.shape[0] != rows)
        or not _aligned(lhs, rhs, dw)
    )


def moe_weight_grad(lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m, *, gather_l, gather_r, top_k):
    """The ``moe_weight_grad`` hook: dw[e] = sum over expert e's sort rows of lhs_row^T rhs_row, or False."""
    if (
        not GLUON
        or not dw.is_cuda
        or getattr(torch.version, "hip", None)
        or not _weight_grad_taken(lhs, rhs, dw, row_pair.numel(), block_m, gather_l, gather_r)
        or not _is_sm90(dw.device.index if dw.device.index is not None else torch.cuda.current_device())
    ):
        return False
    E, M, N = dw.shape
    launch(
        _moe_weight_grad_sm90_kernel,
        (M // WG_BLOCK_M * (N // WG_BLOCK_N), E),
        l_desc=_desc(lhs, lhs.shape, lhs.stride(), [BLOCK_K, WG_BLOCK_M]),
        r_desc=_desc(rhs, rhs.shape, rhs.stride(), [BLOCK_K, WG_BLOCK_N]),
        dw_desc=_desc(dw, [E * M, N], [N, 1], [WG_BLOCK_M, WG_BLOCK_N]),
        SRC=lhs if gather_l else rhs,
        stride_src=(lhs if gather_l else rhs).stride(0),
        ROW_PAIR=row_pair,
        EXPERT_START=expert_start,
        EXPERT_ROWS=expert_rows,
        M=M,
        N=N,
        TOP_K=top_k,
        GATHER=1 if gather_l else 2,
        G_LAYOUT=_gather_layout(),
        GROUP=GROUP_M,
        STAGES=STAGES,
        AHEAD=AHEAD,
        IN_FLIGHT=IN_FLIGHT,
        num_warps=8,
    )
    return True
