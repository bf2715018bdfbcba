"""Tuned H100 (sm90) launch parameters for ``tritonspec.ops.attention``.

The nvidia spec's ``attention_config`` hook delegates here on sm90 devices; the op itself only knows
its portable defaults. Tables are keyed by the padded head dim (64 covers 16..64, 128 covers
65..128) and causality. Every entry was picked by ``bench/bench_attention.py --sweep`` on an H100
(bf16, the four benchmark shapes; numbers in bench/NOTES.md), not derived.

Keys: BLOCK_M/BLOCK_N (q rows / k-v rows per tile), num_warps, num_stages, TMA (host tensor
descriptors), WARP_SPECIALIZE (Triton 3.6's Hopper auto warp specialization does not compile this
loop: keep False), DQ_ATOMIC (dQ accumulated by the dK/dV kernel with fp32 atomics instead of a
separate dQ pass), DQ_TMA_REDUCE (those atomics as bulk TMA reduce-adds), and optionally maxnreg.
Missing keys fall back to the op's portable defaults.
"""
from __future__ import annotations

__all__ = ["h100_attention_config"]


def _cfg(bm, bn, warps, stages, **flags):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, TMA=True, **flags)


# kernel -> (padded head_dim, causal) -> config. Picked by `bench_attention.py --sweep` on an H100
# (2026-11-22, torch 2.11, triton 3.6.0): best summed bf16 TFLOP/s over the group's benchmark shapes;
# the same table then passed tests/gpu/test_attention_gpu.py and produced bench/RESULTS.md.
TABLES = {
    "attention_fwd": {
        (64, False): _cfg(128, 64, 4, 3, WARP_SPECIALIZE=False),
        (64, True): _cfg(64, 64, 4, 4, WARP_SPECIALIZE=False),
        (128, False): _cfg(128, 128, 8, 3, WARP_SPECIALIZE=False),
        (128, True): _cfg(128, 128, 8, 3, WARP_SPECIALIZE=False),
    },
    "attention_bwd_dkdv": {
        (64, False): _cfg(32, 128, 4, 3, DQ_ATOMIC=False, DQ_TMA_REDUCE=False),
        (64, True): _cfg(64, 64, 4, 2, DQ_ATOMIC=False, DQ_TMA_REDUCE=False),
        # 64x64x4x2: 247 registers and 99 KB of shared memory, so two CTAs share an SM; with the
        # single causal loop it beat 64x128x8x3 by 2-7% on every d128 shape (bench/NOTES.md)
        (128, False): _cfg(64, 64, 4, 2, DQ_ATOMIC=False, DQ_TMA_REDUCE=False),
        (128, True): _cfg(64, 64, 4, 2, DQ_ATOMIC=False, DQ_TMA_REDUCE=False),
    },
    "attention_bwd_dq": {
        (64, False): _cfg(64, 64, 4, 3),
        (64, True): _cfg(64, 64, 4, 3),
        (128, False): _cfg(128, 64, 8, 3),
        (128, True): _cfg(128, 64, 8, 3),
    },
}


def h100_attention_config(kernel: str, tables: dict | None = None, **problem) -> dict | None:
    """sm90 parameters for ``kernel`` given the op's problem keys, or None for the op's defaults.

    ``problem`` carries head_dim, causal, dtype (str), seq_q/seq_k (power-of-two buckets), group.
    Only 2-byte dtypes and head dims up to 128 are tuned; anything else keeps the portable defaults.
    ``tables`` replaces :data:`TABLES` (the sweep uses it to test a candidate table before it lands).
    """
    table = (TABLES if tables is None else tables).get(kernel)
    if table is None or problem.get("dtype") not in ("torch.bfloat16", "torch.float16"):
        return None
    head_dim = int(problem.get("head_dim", 0))
    if not 1 <= head_dim <= 128:
        return None
    cfg = table.get((64 if head_dim <= 64 else 128, bool(problem.get("causal", False))))
    if cfg is None:
        return None
    cfg = dict(cfg)
    if kernel in ("attention_fwd", "attention_bwd_dq") and int(problem.get("seq_q", 1 << 30)) <= 64:
        # decode-sized queries: a 128-row tile would be mostly padding
        cfg.update(BLOCK_M=64, BLOCK_N=64, num_warps=4)
    return cfg
