"""Per-SM launch parameters for tritonspec kernels on NVIDIA GPUs, as a table keyed by kernel.

What changes per SM generation here:
- before sm80 (Volta/Turing) the row kernels (RMSNorm, SwiGLU, RoPE) keep to 4 warps, or 8 for
  rows longer than 2048;
- on sm90 the portable attention kernels take the H100 tiles of ``TABLES``: every entry was picked by
  ``bench/bench_attention.py --sweep`` on an H100 (bf16, the four benchmark shapes), not derived;
- on sm80 (A100: 164 KB of shared memory, cp.async pipelines, mma.sync, no TMA) attention and the
  experts' GEMMs take ``SM80``: tiles chosen for those limits (``tritonspec check --kernels`` shows
  what each compiles to), run for correctness on an H100; no A100 was at hand to tune them.

The SM is the one of the tensors' device (``launch_config`` passes ``device``), so a host with GPUs
of two generations gets each its own tiles. A problem may carry ``arch`` (e.g. 90) instead, as
``tritonspec.launch.for_arch`` sets it: how the choices are checked offline and tested without a GPU.
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
    arch = problem.get("arch")
    if arch is not None:
        return int(arch)
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
    return h100_attention_config(kernel, **{k: v for k, v in problem.items() if k not in ("arch", "device")})


def _sm80_cfg(bm, bn, warps, stages):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


# A100 attention tiles by padded head dim (larger ones keep the portable defaults): the Q tile stays in
# registers across the key loop, K and V tiles stream through 3 cp.async stages.
SM80 = {
    "attention_fwd": {64: _sm80_cfg(128, 64, 4, 3), 128: _sm80_cfg(128, 64, 8, 3)},
    "attention_bwd_dkdv": {64: _sm80_cfg(32, 128, 4, 3), 128: _sm80_cfg(64, 64, 8, 2)},
    "attention_bwd_dq": {64: _sm80_cfg(64, 64, 4, 3), 128: _sm80_cfg(64, 64, 8, 2)},
}


def _ampere(kernel: str, **problem):
    """sm80 to sm89: the ``SM80`` attention tiles, and experts' GEMM tiles that fit 164 KB with 4 stages."""
    cap = _capability(problem)
    if cap is None or not 80 <= cap < 90:
        return None
    if kernel in SM80:
        if problem.get("dtype") not in ("torch.bfloat16", "torch.float16"):
            return None
        cfg = SM80[kernel].get(max(64, 1 << (int(problem.get("head_dim", 0)) - 1).bit_length()))
        if cfg is not None and kernel != "attention_bwd_dkdv" and int(problem.get("seq_q", 1 << 30)) <= 64:
            cfg = dict(cfg, BLOCK_M=64)  # decode-sized queries: a 128-row tile would be mostly padding
        return cfg
    if problem.get("tokens_per_expert", 0) <= 16:
        return None  # decode-sized: the default 16-row tiles use 20 KB and 4 warps
    # 32-deep K steps in 4 stages on 8 warps: two programs per SM; 128-wide N tiles (64 for moe_up, whose
    # gate and up halves each keep an accumulator: 128 wide, it spills)
    if kernel in ("moe_up", "moe_rows"):
        return {"BLOCK_N": 64 if kernel == "moe_up" else 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4}
    if kernel == "moe_weight_grad":
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4}
    return None


def _hopper_moe(kernel: str, **problem):
    """sm90 experts' GEMMs above 32 rows per expert (H100 sweeps, ``bench/NOTES.md``): weight tiles through TMA
    descriptors, 256 columns of gate and up a program. With large experts (I >= 4096, 512 rows or more each:
    Mixtral) the weight gradients read sorted rows through descriptors, 128 x 256 tiles on two warpgroups;
    for smaller ones (Qwen3, DeepSeek-V3: 2-5 % slower end to end) gathering the rows first costs more than
    the descriptors save (the spec's own weight-gradient kernel, ``moe_sm90``, takes those)."""
    cap = _capability(problem)
    if cap is None or cap // 10 != 9 or problem.get("dtype") not in ("torch.bfloat16", "torch.float16"):
        return None
    per_expert = int(problem.get("tokens_per_expert", 0))
    if per_expert <= 32:
        return None
    if kernel == "moe_up":
        return {"BLOCK_N": 128, "TMA": True}
    if kernel == "moe_rows":
        return {"TMA": True}
    if kernel == "moe_weight_grad" and per_expert >= 512 and int(problem.get("I", 0)) >= 4096:
        return {"BLOCK_N": 256, "num_warps": 8, "TMA": True}
    return None


def _decode_step(kernel: str, **problem):
    """sm90, where it was measured: programmatic dependent launch, so each decode-step kernel starts while the
    kernel before it ends and prefetches its first weight (or K/V) tiles meanwhile (H100, 48-layer graph: Qwen3
    T=1 experts 33.1 -> 31.7 us; decode attention at batch 1, 512 keys: 6.2 -> 4.9 us). Decode attention's
    partials also take one program per SM with three K/V stages: fewer, longer splits with more loads in
    flight (H100, 28 shapes of ``bench_attention.py --decode``: every batch-1 shape at or above cuDNN)."""
    cap = _capability(problem)
    if cap is None or cap // 10 != 9:
        return None
    if kernel == "attention_decode":
        return {"PDL": True, "programs_per_unit": 1, "num_stages": 3}
    return {"PDL": True}


def _moe(kernel: str, **problem):
    return _hopper_moe(kernel, **problem) or _ampere(kernel, **problem)


def _attention(kernel: str, **problem):
    return _hopper_attention(kernel, **problem) or _ampere(kernel, **problem)


kernel_config = ConfigTable(
    {
        **dict.fromkeys(("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope"), _pre_ampere_rows),
        **dict.fromkeys(TABLES, _attention),
        **dict.fromkeys(("moe_up", "moe_rows", "moe_weight_grad"), _moe),
        **dict.fromkeys(("moe_decode", "attention_decode", "attention_decode_combine"), _decode_step),
    }
)
