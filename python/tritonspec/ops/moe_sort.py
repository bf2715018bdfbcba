"""The experts' sort: the router's (token, expert) pairs grouped by expert into blocks of rows.

``sort_by_expert`` turns the router's ids (T, k) into the row metadata the grouped GEMMs of
:mod:`tritonspec.ops.moe` read: the ``T*k`` pairs sorted by expert, stably (token order within an
expert), each expert's rows padded to a multiple of the GEMMs' BLOCK_M, and each block of rows knowing
its expert. It is a counting sort in three launches, sized from static bounds (no ``.item()``, no host
synchronization), so a CUDA graph can capture it and torch.compile sees static shapes. Pairs whose id
is outside ``[0, E)`` (transformers' expert-parallel sentinels) are dropped.

Not the router: choosing each token's experts and weights is :mod:`tritonspec.ops.moe_routing`'s.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._library import cdiv, launch, next_pow2

__all__ = ["SortedPairs", "sort_by_expert", "padded_rows"]

_SLICE_PAIRS = 8192  # pairs one program of the count and scatter launches scans (more slices beyond 64 of them)


@triton.jit
def _moe_sort_count_kernel(
    # Pointers
    IDS,  # (P,) each pair's expert id
    SLICE_ROWS,  # (E, S) out: each expert's number of pairs in each slice
    # Sizes
    P,  # pairs (T * k)
    SLICE,  # pairs per slice
    # Meta-parameters
    BLOCK_P: tl.constexpr,
):
    """Program (e, s): expert e's number of pairs in slice s of the pairs (ids stay in L2)."""
    e = tl.program_id(0)
    s = tl.program_id(1)
    count = tl.zeros([BLOCK_P], dtype=tl.int32)
    end = tl.minimum(s * SLICE + SLICE, P)
    for p0 in range(s * SLICE, end, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        count += (tl.load(IDS + pairs, mask=pairs < end, other=-1) == e).to(tl.int32)
    tl.store(SLICE_ROWS + e * tl.num_programs(1) + s, tl.sum(count, axis=0))


@triton.jit
def _moe_sort_offsets_kernel(
    # Pointers
    SLICE_ROWS,  # (E, S) each expert's number of pairs in each slice
    SLICE_START,  # (E, S) out: the first row of each expert's pairs of each slice
    EXPERT_ROWS,  # (E,) out: each expert's number of pairs
    EXPERT_START,  # (E,) out: each expert's first row
    BLOCK_EXPERT,  # (R / ALIGN,) out: -1 in the blocks after the last expert's
    ROW_PAIR,  # (R,) out: -1 in the rows after the last expert's
    # Sizes
    E,  # experts
    S,  # slices
    R,  # rows
    # Meta-parameters
    ALIGN: tl.constexpr,
    E_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: each expert's pairs and first row (its rows padded to ALIGN, experts in order), each
    (expert, slice)'s first row (slices in order: token order within an expert), and -1 in every row and
    block after the last expert's."""
    experts = tl.arange(0, E_PAD)
    slices = tl.arange(0, S_PAD)
    ok = (experts < E)[:, None] & (slices < S)[None, :]
    offs = experts[:, None] * S + slices[None, :]
    per_slice = tl.load(SLICE_ROWS + offs, mask=ok, other=0)
    count = tl.sum(per_slice, axis=1)
    padded = (count + ALIGN - 1) // ALIGN * ALIGN
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    tl.store(EXPERT_ROWS + experts, count, mask=experts < E)
    tl.store(EXPERT_START + experts, start, mask=experts < E)
    tl.store(SLICE_START + offs, start[:, None] + tl.cumsum(per_slice, axis=1) - per_slice, mask=ok)
    used = tl.sum(padded, axis=0)
    for r0 in range(used, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        tl.store(ROW_PAIR + rows, tl.full([BLOCK_R], -1, tl.int32), mask=rows < R)
    for b0 in range(used // ALIGN, R // ALIGN, BLOCK_R):
        blocks = b0 + tl.arange(0, BLOCK_R)
        tl.store(BLOCK_EXPERT + blocks, tl.full([BLOCK_R], -1, tl.int32), mask=blocks < R // ALIGN)


@triton.jit
def _moe_sort_scatter_kernel(
    # Pointers
    IDS,  # (P,) each pair's expert id
    SLICE_START,  # (E, S) the first row of each expert's pairs of each slice
    EXPERT_START,  # (E,) each expert's first row
    EXPERT_ROWS,  # (E,) each expert's number of pairs
    ROW_PAIR,  # (R,) out: the pair in each row, -1 in padding rows
    PAIR_POS,  # (P,) out: each pair's row, -1 for a dropped pair
    BLOCK_EXPERT,  # (R / ALIGN,) out: each block's expert
    # Sizes
    P,  # pairs (T * k)
    E,  # experts
    SLICE,  # pairs per slice
    # Meta-parameters
    ALIGN: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Program (e, s) places expert e's pairs of slice s in token order from their first row (ROW_PAIR[row]
    = pair, PAIR_POS[pair] = row). Program (e, 0) also writes -1 in e's padding rows and e in its blocks;
    program (0, s) marks the slice's pairs whose id is outside [0, E) as dropped (PAIR_POS -1)."""
    e = tl.program_id(0)
    s = tl.program_id(1)
    row = tl.load(SLICE_START + e * tl.num_programs(1) + s)
    end = tl.minimum(s * SLICE + SLICE, P)
    for p0 in range(s * SLICE, end, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        in_range = pairs < end
        key = tl.load(IDS + pairs, mask=in_range, other=-1)
        mine = key == e
        rows = row + tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(ROW_PAIR + rows, pairs, mask=mine)
        tl.store(PAIR_POS + pairs, rows, mask=mine)
        if e == 0:
            tl.store(PAIR_POS + pairs, tl.full([BLOCK_P], -1, tl.int32), mask=in_range & ((key < 0) | (key >= E)))
        row += tl.sum(mine.to(tl.int32), axis=0)
    if s == 0:
        start = tl.load(EXPERT_START + e)
        count = tl.load(EXPERT_ROWS + e)
        n_blocks = (count + ALIGN - 1) // ALIGN
        pad = tl.arange(0, ALIGN)
        tl.store(ROW_PAIR + start + count + pad, tl.full([ALIGN], -1, tl.int32), mask=pad < n_blocks * ALIGN - count)
        for b0 in range(0, n_blocks, BLOCK_P):
            blocks = b0 + tl.arange(0, BLOCK_P)
            tl.store(
                BLOCK_EXPERT + start // ALIGN + blocks, tl.full([BLOCK_P], 0, tl.int32) + e, mask=blocks < n_blocks
            )


def padded_rows(pairs: int, experts: int, block_m: int) -> int:
    """Rows of the sort of ``pairs`` pairs over ``experts`` experts whatever the ids: every expert's rows
    padded to ``block_m`` fit in ``pairs + experts * (block_m - 1)``, rounded up to ``block_m``."""
    return -(-(pairs + experts * (block_m - 1)) // block_m) * block_m


class SortedPairs(NamedTuple):
    """The (token, expert) pairs sorted by expert; pair ``t * k + j`` is token t's j-th choice. int32, all."""

    row_pair: torch.Tensor  # (R,) the pair in each padded expert-sorted row, -1 for padding
    block_expert: torch.Tensor  # (R / block_m,) each block's expert, -1 past the last expert's rows
    pair_pos: torch.Tensor  # (T*k,) each pair's row, -1 when its id is outside [0, E) (dropped)
    expert_start: torch.Tensor  # (E,) each expert's first row
    expert_rows: torch.Tensor  # (E,) each expert's number of pairs


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, traced: bool = False) -> SortedPairs:
    """The pairs of ``ids`` (T, k) sorted by expert into blocks of ``block_m`` rows of one expert each, in
    ``padded_rows(T*k, num_experts, block_m)`` rows. Program (e, s) of the count and scatter launches
    handles expert e in slice s of the pairs."""
    device = ids.device
    P = ids.numel()
    E = num_experts
    R = padded_rows(P, E, block_m)
    slice_pairs = max(_SLICE_PAIRS, next_pow2(cdiv(P, 64)))
    S = max(1, cdiv(P, slice_pairs))
    i32 = dict(dtype=torch.int32, device=device)
    row_pair, block_expert, pair_pos = torch.empty(R, **i32), torch.empty(R // block_m, **i32), torch.empty(P, **i32)
    expert_start, expert_rows = torch.empty(E, **i32), torch.empty(E, **i32)
    slice_rows, slice_start = torch.empty((E, S), **i32), torch.empty((E, S), **i32)
    flat = ids.reshape(-1)
    block_p = min(next_pow2(P), 1024, slice_pairs)
    launch(
        _moe_sort_count_kernel,
        (E, S),
        IDS=flat,
        SLICE_ROWS=slice_rows,
        P=P,
        SLICE=slice_pairs,
        BLOCK_P=block_p,
        traced=traced,
    )
    launch(
        _moe_sort_offsets_kernel,
        (1,),
        SLICE_ROWS=slice_rows,
        SLICE_START=slice_start,
        EXPERT_ROWS=expert_rows,
        EXPERT_START=expert_start,
        BLOCK_EXPERT=block_expert,
        ROW_PAIR=row_pair,
        E=E,
        S=S,
        R=R,
        ALIGN=block_m,
        E_PAD=next_pow2(E),
        S_PAD=next_pow2(S),
        BLOCK_R=1024,
        traced=traced,
    )
    launch(
        _moe_sort_scatter_kernel,
        (E, S),
        IDS=flat,
        SLICE_START=slice_start,
        EXPERT_START=expert_start,
        EXPERT_ROWS=expert_rows,
        ROW_PAIR=row_pair,
        PAIR_POS=pair_pos,
        BLOCK_EXPERT=block_expert,
        P=P,
        E=E,
        SLICE=slice_pairs,
        ALIGN=block_m,
        BLOCK_P=block_p,
        traced=traced,
    )
    return SortedPairs(row_pair, block_expert, pair_pos, expert_start, expert_rows)
