"""How the sm90 attention kernels cut up the work, decided on the host: tile sizes, consumer warpgroups,
the register budget, the persistent forward's list of query tiles per CTA, and under key bounds each
query tile's key blocks and the backward's pairs of key tiles (each key tile's q blocks: the op's
``query_block_table``, which the portable kernels use too).

No GPU or Gluon needed, so the choices are tested offline; ``launchers`` applies them.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from tritonspec.ops._library import cdiv

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


def fwd_schedule(
    batch_heads: int, group: int, tiles: int, rows: int, seq_k: int, causal: bool, ctas: int, kv_heads_per_section: int
) -> list[int]:
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


def key_block_table(bounds: torch.Tensor, seq_q: int, rows: int, block_n: int) -> torch.Tensor:
    """The forward's key blocks per query tile of ``rows`` rows under key bounds (int32 ``(2, batch, padded
    rows)``): int32 ``(batch, tiles, 4)`` rows (first, a, c, n). The tile walks key blocks first ..
    first + n - 1, from first + a on and around; the blocks [a, c) of those (counted from the first)
    hold keys every row of the tile sees, so need no mask (a = c = 0 where there are none). A tile whose
    rows see no key still walks one block, all masked."""
    b = bounds.shape[1]
    tiles = cdiv(seq_q, rows)
    lo = bounds[0, :, : tiles * rows].view(b, tiles, rows)
    hi = bounds[1, :, : tiles * rows].view(b, tiles, rows)
    seen = hi > lo
    top = torch.where(seen, hi, 0).amax(-1)
    bottom = torch.minimum(torch.where(seen, lo, top[..., None]).amin(-1), top)
    first = bottom // block_n
    end = torch.maximum((top + block_n - 1) // block_n, first + 1)
    a = ((lo.amax(-1) + block_n - 1) // block_n).clamp(min=first)
    a = torch.minimum(a, end)
    c = torch.minimum(torch.maximum(hi.amin(-1) // block_n, a), end)
    some = c > a  # no unmasked block: a = c = first (the kernel walks from block first + a)
    a, c = torch.where(some, a, first), torch.where(some, c, first)
    return torch.stack((first, a - first, c - first, end - first), -1).int()


def tile_pairs(table: torch.Tensor) -> torch.Tensor:
    """The backward's key tiles in pairs of about equal summed work, from the op's ``query_block_table``'s
    ``table``: per batch row the i-th longest tile with the i-th shortest, int32 ``(batch, tiles / 2
    rounded up, 2)`` (an odd count's middle tile pairs with itself). Causal tiles pair as the causal
    grid pairs them. Pairs of like tiles, heaviest first (the grid's order then runs the heavy ones
    early), took 1.1-1.5x as long on an H100: padded, packed, windowed and causal bounds alike."""
    tiles = table.shape[1]
    order = torch.sort(table[..., 3], dim=1, descending=True, stable=True).indices
    half = cdiv(tiles, 2)
    return torch.stack((order[:, :half], order.flip(1)[:, :half]), -1).int()
