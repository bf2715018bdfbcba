"""Per-SM launch parameters for tritonspec kernels on NVIDIA GPUs, as a table keyed by kernel.

The ops' defaults were written for sm80/sm90; what changes per SM generation here:
- before sm80 (Volta/Turing) the row kernels (RMSNorm, SwiGLU, RoPE) keep to 4 warps, or 8 for
  rows longer than 2048;
- on sm90 the portable attention kernels take the H100 tiles of ``TABLES``: every entry was picked by
  ``bench/bench_attention.py --sweep`` on an H100 (bf16, the four benchmark shapes), not derived.

The SM is the one of the tensors' device (``launch_config`` passes ``device``), so a host with GPUs
of two generations gets each its own tiles. A problem may carry ``capability`` (e.g. 90) instead;
this is how the choices are tested without a GPU.
"""

from __future__ import annotations

import functools

from tritonspec.launch import ConfigTable


@functools.lru_cache(maxsize=None)
def _device_capability(index: int):
    import torch

    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def _capability(problem) -> int | None:
    cap = problem.get("capability")
    if cap is not None:
        return int(cap)
    device = problem.get("device")
    if device is None or device.type != "cuda":
        return None
    try:
        return _device_capability(device.index)
    except Exception:  # no driver: nothing capability-specific to say
        return None


def _pre_ampere_rows(kernel: str, **problem):
    cap = _capability(problem)
    if cap is None or cap >= 80:
        return None
    return {"num_warps": 4 if int(problem.get("N", 1024)) <= 2048 else 8}


def _cfg(bm, bn, warps, stages, **flags):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, TMA=True, **flags)


# kernel -> (padded head_dim, causal) -> config. Picked by `bench_attention.py --sweep` on an H100
# (2026-11-22, torch 2.11, triton 3.6.0): best summed bf16 TFLOP/s over the group's benchmark shapes;
# the same table then passed tests/gpu/test_attention_gpu.py and produced bench/RESULTS.md.
# TMA: host tensor descriptors. WARP_SPECIALIZE stays False: Triton 3.6's Hopper auto warp
# specialization does not compile this loop.
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
        # single causal loop it beat 64x128x8x3 by 2-7% on every d128 shape
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


def _hopper_attention(kernel: str, **problem):
    cap = _capability(problem)
    if cap is None or cap // 10 != 9:
        return None
    return h100_attention_config(kernel, **{k: v for k, v in problem.items() if k not in ("capability", "device")})


kernel_config = ConfigTable(
    {
        **dict.fromkeys(("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope"), _pre_ampere_rows),
        **dict.fromkeys(TABLES, _hopper_attention),
    }
)
