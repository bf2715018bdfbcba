"""The ``attention_forward`` and ``attention_backward`` hooks on sm90: whether the Gluon kernels take a
problem, their TMA descriptors, and their launches, remembered as plans so that a repeated problem skips
the host work a 2048-token step would otherwise wait on.
"""

from __future__ import annotations

import functools

import torch

from tritonspec.ops._library import PlanCache, cdiv, derived, launch, tma_ok
from tritonspec.ops.attention import LOG2E, query_block_table

from ..gluon_compat import GLUON
from .schedule import (
    BLOCK_N,
    BWD_BLOCK_M,
    BWD_BLOCK_M_D64,
    BWD_HALF_N,
    HALF_M,
    HEAD_DIM,
    MAX_GRID_Y,
    STAGES,
    fwd_schedule,
    fwd_warpgroups,
    key_block_table,
    maxnreg,
    tile_pairs,
)

if GLUON:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .backward import _attn_bwd_ws_kernel
    from .forward import _attn_fwd_ws_kernel


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def eligible(q: torch.Tensor, k: torch.Tensor, scale: float, *tensors: torch.Tensor) -> bool:
    """Whether these kernels take the problem: what they were measured and tested on. ``tensors`` are
    the others the kernel reads or writes through TMA (v, o or dO, dK, dV)."""
    if not GLUON or not q.is_cuda or getattr(torch.version, "hip", None):
        return False
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and 64 <= d <= HEAD_DIM
        and scale > 0
        and k.shape[2] > 0
        and q.shape[0] * q.shape[1] <= MAX_GRID_Y
        and _is_sm90(q.device.index if q.device.index is not None else torch.cuda.current_device())
        and tma_ok(q, k, *tensors)
    )  # the op's own TMA rules: aligned base and strides, unit last stride


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The persistent forward's CTA count: one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(device: torch.device) -> int:
    """The L2 cache the forward's schedule sizes its head sections by."""
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.lru_cache(maxsize=None)
def _fwd_schedule_on(device: torch.device, *problem) -> torch.Tensor:
    """``fwd_schedule(*problem)`` on ``device``, kept for the life of the process (a few KB a problem):
    a CUDA graph that captured a launch holds its address, so it outlives the launch plans."""
    return torch.tensor(fwd_schedule(*problem), dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------------
# TMA descriptors
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype, swizzle: int | None, rank: int = 4):
    """A tile's swizzled shared-memory layout (the widest swizzle unless ``swizzle`` bytes are asked
    for), built once: ``get_default_for`` costs ~19 us a call, and a forward + backward builds thirteen."""
    if swizzle is not None:
        return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=dtype.itemsize * 8, rank=rank)
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gl_dtype)


def _descriptor(t: torch.Tensor, rows: int, cols: int = HEAD_DIM, swizzle: int | None = None):
    """Blocks of ``rows`` rows and ``cols`` columns of one (batch, head) of a 4-D tensor."""
    layout = _smem_layout(rows, cols, t.dtype, swizzle)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols], layout)


def _rows_descriptor(t: torch.Tensor, rows: int):
    """Per-row fp32 state (lse, delta: (batch, heads, padded rows)) as one q block's TMA tiles of
    (batch * heads, rows)."""
    flat = t.view(-1, t.shape[-1])
    layout = _smem_layout(1, rows, t.dtype, 0, rank=2)  # unswizzled: read row-wise at use
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, rows], layout)


def _bwd_descriptors(q, k, v, do, dk, dv, dqa, lse, delta):
    """The backward kernel's tiles, in its parameter order (q_desc .. delta_desc), head dim padded as
    ``dqa`` is (64 at d=64, else 128)."""
    tile_d = dqa.shape[-1]
    block_m = BWD_BLOCK_M_D64 if tile_d == 64 else BWD_BLOCK_M
    # dQ's B operand is half the head dim of the K tile: the slice must start on a swizzle atom
    k_swizzle = tile_d  # bytes: half a row of 16-bit elements
    return (
        _descriptor(q, block_m, tile_d),
        _descriptor(k, BWD_HALF_N, tile_d, k_swizzle),
        _descriptor(v, BWD_HALF_N, tile_d),
        _descriptor(do, block_m, tile_d),
        _descriptor(dk, BWD_HALF_N, tile_d, k_swizzle),
        _descriptor(dv, BWD_HALF_N, tile_d),
        _descriptor(dqa, block_m, tile_d // 2),
        _rows_descriptor(lse, block_m),
        _rows_descriptor(delta, block_m),
    )


# ----------------------------------------------------------------------------------------------
# launch plans
# ----------------------------------------------------------------------------------------------
# Eager launch plans by problem (every shape and stride, dtype, causal, scale, device): a repeated
# call skips eligible(), the descriptors' validation and the launch key, host time that a
# 2048-token step waits on. A plan holds no tensor: each call rebases the recorded descriptors.
_FWD_PLANS = PlanCache()
_BWD_PLANS = PlanCache()


def fwd_tiles(bounds: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The forward's key-block table for these bounds (``key_block_table``), once per batch: kept on them."""
    rows = fwd_warpgroups(q.shape[-1], True) * HALF_M
    return derived(bounds, ("sm90 key blocks", rows), lambda: key_block_table(bounds, q.shape[2], rows, BLOCK_N))


def bwd_tiles(bounds: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's q-block table for these bounds (``query_block_table``) and its key tiles' pairs
    (``tile_pairs``), once per batch: kept on them."""
    block_m = BWD_BLOCK_M_D64 if q.shape[-1] == 64 else BWD_BLOCK_M

    def make():
        table = query_block_table(bounds, q.shape[2], k.shape[2], block_m, 2 * BWD_HALF_N)
        return table, tile_pairs(table)

    return derived(bounds, ("sm90 query blocks", k.shape[2], block_m), make)


def _problem_key(causal: bool, scale: float, *tensors: torch.Tensor) -> tuple:
    return (tensors[0].dtype, tensors[0].device, bool(causal), scale, *[(t.shape, t.stride()) for t in tensors])


def _rebased(desc, t):
    """``desc`` at tensor ``t``'s address, with the shape and strides it was built with (a plan's key fixed
    them; a launch reads only the base's address), without TensorDescriptor's validation; ``t=None`` for
    the copy a plan keeps."""
    rebased = object.__new__(TensorDescriptor)
    rebased.__dict__.update(desc.__dict__)
    rebased.base = t
    return rebased


def _launch_planned(plans: PlanCache, key: tuple, kernel, grid, kept: tuple = (), **arguments):
    """Launch ``kernel`` with ``arguments`` (by name), and keep the plan with copies of its TMA descriptors
    (in the kernel's parameter order, as the plan takes them) and ``kept``: what belongs to the problem,
    not the call (the forward's schedule; the layouts of the backward's dqa and delta)."""
    plan = launch(kernel, grid, plan=True, **arguments)
    if plan is not None:
        descriptors = [
            arguments[name] for name in kernel.arg_names if isinstance(arguments.get(name), TensorDescriptor)
        ]
        plans[key] = (plan, [_rebased(d, None) for d in descriptors], kept)


# ----------------------------------------------------------------------------------------------
# the hooks
# ----------------------------------------------------------------------------------------------
def attention_forward(q, k, v, o, lse, causal: bool, scale: float, *, bounds=None) -> bool:
    """The ``attention_forward`` hook: fill ``o`` and ``lse`` (base-2 logsumexp of the scaled scores,
    rows padded with +inf beforehand) and return True, or return False to leave the problem to the op.
    ``bounds``: each query's key interval, int32 ``(2, batch, padded rows)``, or None."""
    key = _problem_key(causal, scale, q, k, v, o, lse, *(() if bounds is None else (bounds,)))
    hit = _FWD_PLANS.get(key)
    if hit is not None:
        plan, descs, (schedule,) = hit
        kb, tiles = (lse, lse) if bounds is None else (bounds, fwd_tiles(bounds, q))
        if plan(
            _rebased(descs[0], q),
            _rebased(descs[1], k),
            _rebased(descs[2], v),
            _rebased(descs[3], o),
            lse,
            schedule,
            kb,
            tiles,
        ):
            return True
    if q.shape[2] <= HALF_M or not eligible(q, k, scale, v, o):  # decode-sized queries: half a tile idles
        return False
    batch, heads_q, seq_q, d = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    tile_d = 64 if d == 64 else HEAD_DIM
    # key bounds cost as causal does: a tile's keys end near its rows (padding, packing, windows)
    tiled_causal = bool(causal) or bounds is not None
    wgs = fwd_warpgroups(tile_d, tiled_causal)
    tiles = cdiv(seq_q, wgs * HALF_M)
    ctas = min(batch * heads_q * tiles, _sm_count(q.device))
    kv_head_bytes = 2 * seq_k * tile_d * k.element_size()
    schedule = _fwd_schedule_on(
        q.device,
        batch * heads_q,
        heads_q // heads_kv,
        tiles,
        wgs * HALF_M,
        seq_k,
        tiled_causal,
        ctas,
        max(1, _l2_bytes(q.device) // 2 // kv_head_bytes),
    )
    _launch_planned(
        _FWD_PLANS,
        key,
        _attn_fwd_ws_kernel,
        (ctas,),
        kept=(schedule,),
        # Pointers (TMA descriptors)
        q_desc=_descriptor(q, HALF_M, tile_d),
        k_desc=_descriptor(k, BLOCK_N, tile_d),
        v_desc=_descriptor(v, BLOCK_N, tile_d),
        o_desc=_descriptor(o, HALF_M, tile_d),
        # Pointers
        LSE=lse,
        SCHED=schedule,
        KB=lse if bounds is None else bounds,
        TILES=lse if bounds is None else fwd_tiles(bounds, q),
        # Sizes
        HQ=heads_q,
        GROUP=heads_q // heads_kv,
        SEQ_Q=seq_q,
        SEQ_K=seq_k,
        SEQ_PAD=lse.shape[-1],
        BOUNDS_HI=0 if bounds is None else batch * lse.shape[-1],
        # Scales
        qk_scale=scale * LOG2E,
        # Meta-parameters
        CAUSAL=tiled_causal,
        BOUNDS=bounds is not None,
        STAGES=STAGES,
        WGS=wgs,
        num_warps=4,
        maxnreg=maxnreg(wgs + 1),
    )
    return True


def attention_backward(q, k, v, do, dk, dv, lse, causal: bool, scale: float, *, bounds=None):
    """The ``attention_backward`` hook: take the problem by returning ``run(dqa, delta)``, or return False
    before the op allocates anything for it. ``run`` adds dQ, in one pass over the keys, into the op's
    zeroed fp32 accumulator ``dqa`` (head dim padded to 64 or 128) by TMA reduce-adds and fills ``dk`` and
    ``dv``, from the forward's lse and the op's delta (rowsum(dO * O)), both per q row with padded rows
    +inf and 0. dQ's fp32 sums land in arrival order, so its last bits may differ between runs (as
    FlashAttention's dQ); dK and dV are deterministic. ``bounds``: each query's key interval, int32
    ``(2, batch, padded rows)``, or None."""
    key = _problem_key(causal, scale, q, k, v, do, dk, dv, lse, *(() if bounds is None else (bounds,)))
    hit = _BWD_PLANS.get(key)
    if hit is not None:  # eligible() passed on all the key holds; of the rest, TMA needs aligned addresses
        addresses = q.data_ptr() | k.data_ptr() | v.data_ptr() | do.data_ptr() | dk.data_ptr() | dv.data_ptr()
        if not addresses & 15:
            plan, descs, layout = hit

            def run_planned(dqa, delta):
                # lse and delta stand for their flat views (rows): the same addresses
                tensors = (q, k, v, do, dk, dv, dqa, lse, delta)
                kb, qt, pairs = (lse, lse, lse) if bounds is None else (bounds, *bwd_tiles(bounds, q, k))
                if layout != (dqa.shape, dqa.stride(), delta.shape, delta.stride()) or not plan(
                    *[_rebased(d, t) for d, t in zip(descs, tensors)], kb, qt, pairs
                ):
                    _launch_bwd(key, q, k, v, do, dk, dv, dqa, lse, delta, causal, scale, bounds)

            return run_planned
    if not eligible(q, k, scale, v, do, dk, dv):
        return False

    def run(dqa, delta):
        _launch_bwd(key, q, k, v, do, dk, dv, dqa, lse, delta, causal, scale, bounds)

    return run


def _launch_bwd(key, q, k, v, do, dk, dv, dqa, lse, delta, causal: bool, scale: float, bounds):
    """Launch the backward kernel on an eligible problem and keep its plan under ``key``, with the layout of
    ``dqa`` and ``delta`` it was built for (the op's, which the key does not hold)."""
    batch, heads_q, seq_q, _ = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    tiles = cdiv(seq_k, 2 * BWD_HALF_N)
    # causal: a CTA takes tiles i and -1-i; key bounds: the tiles ``tile_pairs`` pairs by their work (pairs
    # i, -1-i of packed sequences' tiles left a long tail: 4 x [2048, 4096] x 128 took 2.34 ms, one tile a
    # CTA 2.20, on an H200; one tile a CTA took padded batches from 2.02 to 2.17 ms on an H100)
    grid = (cdiv(tiles, 2) if causal or bounds is not None else tiles, batch * heads_kv)
    kb, qt, pairs = (lse, lse, lse) if bounds is None else (bounds, *bwd_tiles(bounds, q, k))
    q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, lse_desc, delta_desc = _bwd_descriptors(
        q, k, v, do, dk, dv, dqa, lse, delta
    )
    _launch_planned(
        _BWD_PLANS,
        key,
        _attn_bwd_ws_kernel,
        grid,
        kept=(dqa.shape, dqa.stride(), delta.shape, delta.stride()),
        # Pointers (TMA descriptors)
        q_desc=q_desc,
        k_desc=k_desc,
        v_desc=v_desc,
        do_desc=do_desc,
        dk_desc=dk_desc,
        dv_desc=dv_desc,
        dqa_desc=dqa_desc,
        lse_desc=lse_desc,
        delta_desc=delta_desc,
        # Pointers
        KB=kb,
        QT=qt,
        PAIRS=pairs,
        # Sizes
        HQ=heads_q,
        HKV=heads_kv,
        GROUP=heads_q // heads_kv,
        SEQ_Q=seq_q,
        SEQ_K=seq_k,
        SEQ_PAD=lse.shape[-1],
        BOUNDS_HI=0 if bounds is None else batch * lse.shape[-1],
        # Scales
        qk_scale=scale * LOG2E,
        sm_scale=scale,
        # Meta-parameters
        CAUSAL=bool(causal),
        BOUNDS=bounds is not None,
        STAGES=STAGES,
        num_warps=4,
        maxnreg=maxnreg(3),
    )
