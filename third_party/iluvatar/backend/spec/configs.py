"""Iluvatar launch parameters: smaller tiles, at most 2 pipeline stages, no TMA / warp specialization.

Why: CoreX parts pipeline at most two stages and have neither TMA nor Hopper warp specialization,
and FlagTree's iluvatar backend shipped its own attention configs for that reason. The numbers
below were chosen for those limits, not tuned on CoreX hardware (we have none); on the NVIDIA GPU
that runs the emulation they are merely valid, not fast.
"""

from __future__ import annotations

import copy

from tritonspec.launch import ConfigTable

MAX_STAGES = 2


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


def _rows(kernel: str, **problem):
    """Row kernels: one pass over memory, nothing to pipeline; fewer warps per program."""
    n = int(problem.get("N", problem.get("head_dim", 1024)))
    return {"num_warps": 4 if n <= 2048 else 8, "num_stages": 1}


def _attention(kernel: str, **problem):
    """Flash-attention tiles for CoreX limits: <= 2 stages, TMA and warp specialization off."""
    dp = _pow2_at_least(problem.get("head_dim", 64), 16)
    stages = MAX_STAGES if dp <= 128 else 1
    if kernel == "attention_fwd":
        return {
            "BLOCK_M": 64,
            "BLOCK_N": 64 if dp <= 64 else 32,
            "num_warps": 4,
            "num_stages": stages,
            "TMA": False,
            "WARP_SPECIALIZE": False,
        }
    if kernel == "attention_bwd_dkdv":
        return {
            "BLOCK_M": 32 if dp <= 128 else 16,
            "BLOCK_N": 32 if dp <= 128 else 16,
            "num_warps": 4,
            "num_stages": stages,
            "TMA": False,
            "DQ_ATOMIC": False,
            "DQ_TMA_REDUCE": False,
        }
    if kernel == "attention_bwd_dq":
        return {
            "BLOCK_M": 32 if dp <= 128 else 16,
            "BLOCK_N": 32 if dp <= 128 else 16,
            "num_warps": 4,
            "num_stages": stages,
            "TMA": False,
        }
    return {"num_stages": 1}  # attention_bwd_preprocess


def _moe(kernel: str, **problem):
    """MoE grouped GEMMs: at most 2 stages and 4 warps; 64-row blocks at most once experts get many rows."""
    if kernel == "moe_combine":
        return {"num_warps": 4, "num_stages": 1}
    cfg = {"num_warps": 4, "num_stages": MAX_STAGES}
    if kernel in ("moe_up", "moe_rows"):
        cfg["BLOCK_K"] = 32
    if kernel == "moe_up" and problem.get("tokens_per_expert", 1) > 16:
        cfg["BLOCK_M"] = 64
    if kernel == "moe_weight_grad":
        cfg.update(BLOCK_M=64, BLOCK_N=64)
    return cfg


kernel_config = ConfigTable(
    {
        **dict.fromkeys(("moe_up", "moe_rows", "moe_weight_grad", "moe_combine"), _moe),
        **dict.fromkeys(("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope"), _rows),
        **dict.fromkeys(
            ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "attention_bwd_preprocess"), _attention
        ),
    }
)


def _config_key(cfg):
    kwargs = tuple(sorted((k, repr(v)) for k, v in getattr(cfg, "kwargs", {}).items()))
    return (
        kwargs,
        getattr(cfg, "num_warps", None),
        getattr(cfg, "num_stages", None),
        getattr(cfg, "num_ctas", None),
        getattr(cfg, "maxnreg", None),
        id(getattr(cfg, "pre_hook", None)),
    )


def get_pruned_configs(configs, named_args):
    """Clamp each autotuner config to 2 stages and drop the duplicates that clamping creates.

    Without this, configs differing only in num_stages > 2 compile to the same kernel and are each
    benchmarked. The caller's Config objects are not modified.
    """
    seen, kept = set(), []
    for cfg in configs:
        if getattr(cfg, "num_stages", 0) and cfg.num_stages > MAX_STAGES:
            cfg = copy.copy(cfg)
            cfg.num_stages = MAX_STAGES
        key = _config_key(cfg)
        if key not in seen:
            seen.add(key)
            kept.append(cfg)
    return kept
