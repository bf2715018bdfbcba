"""Launch parameters for tritonspec kernels on AMD CDNA GPUs (gfx90a: MI200, gfx94x: MI300), as a table by kernel.

The ops' defaults were written for NVIDIA parts; two facts of CDNA change them:
- 64 KB of LDS per workgroup (an H100 block may use 227 KB): the experts' GEMM tiles and stages are cut so
  every buffer fits (the H100 defaults need 96 KB for the down projection);
- 64-wide wavefronts: Triton's ``num_warps`` counts wavefronts, so the row kernels take half the warps an
  NVIDIA part would, for the same threads per row.
Triton's AMD pipeliner keeps K loops at 2 stages, as its own matmul configs do.

Chosen for those limits and checked by ``tritonspec check --kernels`` (compiled for gfx942 and gfx90a, LDS
and registers read from the binaries); there is no AMD GPU here to tune or run them on. The arch is the
problem's ``arch`` (``tritonspec.launch.for_arch``) or the device's ``gcnArchName``.
"""

from __future__ import annotations

import functools

from tritonspec.launch import ConfigTable


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str | None:
    import torch

    if not torch.cuda.is_available() or not getattr(torch.version, "hip", None):
        return None
    return torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]


def _cdna(problem) -> bool:
    arch = problem.get("arch")
    if arch is None:
        device = problem.get("device")
        if device is None or device.type != "cuda":
            return False
        try:
            arch = _device_arch(device.index or 0)
        except Exception:  # no driver: nothing arch-specific to say
            return False
    return isinstance(arch, str) and arch.startswith("gfx9")


def _rows(kernel: str, **problem):
    """One row per program: 4 wavefronts (256 lanes) up to 4096 columns, 8 beyond."""
    if not _cdna(problem):
        return None
    n = int(problem.get("N") or problem.get("V") or problem.get("head_dim") or 4096)
    return {"num_warps": 4 if n <= 4096 else 8}


def _moe(kernel: str, **problem):
    """Experts' GEMMs in 64 KB: 2 stages; 128-wide N tiles where the defaults take 256."""
    if not _cdna(problem):
        return None
    if kernel == "moe_combine":
        return {"num_warps": 4}
    if kernel == "moe_decode":
        return {"BLOCK_K": 64, "num_stages": 2}  # gate and up tiles of 64 columns: 36 KB
    if problem.get("tokens_per_expert", 0) <= 16:
        return {"num_stages": 2}  # decode-sized 16-row tiles: 20 KB
    if kernel == "moe_rows":
        return {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}
    if kernel == "moe_up":
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2}  # moe_weight_grad


def _attention(kernel: str, **problem):
    """Flash attention as Triton's ROCm kernels run it: one stage, 128 x 64 forward tiles up to head dim 128."""
    if not _cdna(problem):
        return None
    dp = max(16, 1 << (int(problem.get("head_dim", 64)) - 1).bit_length())
    if kernel == "attention_fwd" and dp <= 128 and problem.get("dtype") in ("torch.bfloat16", "torch.float16"):
        block_m = 64 if int(problem.get("seq_q", 1 << 30)) <= 64 else 128
        return {"BLOCK_M": block_m, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    return {"num_stages": 1}


kernel_config = ConfigTable(
    {
        **dict.fromkeys(
            ("rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd", "swiglu_bwd", "rope", "linear_cross_entropy"), _rows
        ),
        **dict.fromkeys(("moe_up", "moe_rows", "moe_weight_grad", "moe_combine", "moe_decode"), _moe),
        **dict.fromkeys(
            ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq", "attention_bwd_preprocess"), _attention
        ),
    }
)
