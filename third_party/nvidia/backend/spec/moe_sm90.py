"""Hopper's grouped GEMM of the experts: the ``moe_experts_gemm`` hook, in Gluon.

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
MIN_EXPERT_ELEMENTS = 1 << 25  # gate/up: K * N of one expert's weight (Mixtral's 4096 x 14336 is 2^25.8)

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_compat import tma_load, tma_store

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
