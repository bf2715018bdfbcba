"""Per-SM launch parameters for tritonspec kernels on NVIDIA GPUs.

The ops' defaults were written for sm80/sm90; what changes per SM generation here:
- before sm80 (Volta/Turing) there is no cp.async, so software pipelining beyond 2 stages only
  costs shared memory: cap num_stages at 2 and keep row kernels at <= 8 warps;
- on sm90 attention takes the H100 tile table of ``tritonspec.ops.attention_configs`` when that
  module is present (imported lazily: it is optional and written elsewhere);
- a generic ``matmul`` tile per generation, for kernels that ask under that name.

The SM is the one of the tensors' device (``launch_config`` passes ``device``), so a host with GPUs
of two generations gets each its own tiles. A problem may carry ``capability`` (e.g. 90) instead;
this is how the choices are tested without a GPU.
"""
from __future__ import annotations

import functools
import importlib


@functools.lru_cache(maxsize=None)
def _device_capability(index: int):
    import torch
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def _capability(problem):
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


def kernel_config(kernel: str, **problem):
    """Overrides for ``kernel`` on the current SM, or None to keep the op's default."""
    cap = _capability(problem)
    if cap is None:
        return None
    if kernel == "matmul":
        if cap >= 90:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
        if cap >= 80:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    if kernel in ("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope") and cap < 80:
        return {"num_warps": 4 if int(problem.get("N", 1024)) <= 2048 else 8}
    return None


def attention_config(kernel: str, **problem):
    """sm90: the H100 table from ``tritonspec.ops.attention_configs`` when installed, else None."""
    cap = _capability(problem)
    if cap is None:
        return None
    if cap // 10 == 9:
        try:
            table = importlib.import_module("tritonspec.ops.attention_configs")
        except ModuleNotFoundError as e:
            if e.name != "tritonspec.ops.attention_configs":
                raise
            return None
        problem = {k: v for k, v in problem.items() if k not in ("capability", "device")}
        return table.h100_attention_config(kernel, **problem)
    return None
