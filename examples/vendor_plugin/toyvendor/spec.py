"""toyvendor spec: one semantic hook, one ``tl`` builtin, one launch config.

Loaded by tritonspec's registry through the ``tritonspec.specs`` entry point, only when toyvendor is
allowed and first needed. Kept import-light: no torch here.
"""

from triton.language import core as _core

import tritonspec

backend_info = tritonspec.BackendInfo(
    runs="emulated",
    targets=("toyvendor",),
    devices=(),
    check_targets=(tritonspec.CheckTarget("toy90", ("toyvendor", 90, 32), shared_memory=232448, registers=255),),
    note="an example vendor: the stock CUDA pipeline on NVIDIA GPUs, or the Triton interpreter",
)


def atomic_disable_bf16() -> bool:
    """The toy vendor has no bf16 atomics: a bf16 atomic op is a compile error, not a silent fallback."""
    return True


def _rms_norm_fwd(kernel, **problem):
    """RMSNorm's forward on 2 warps (``problem`` includes ``device``); None would keep the default."""
    return {"num_warps": 2}


# Launch parameters as a table by kernel: the names are checked against tritonspec's kernel table.
kernel_config = tritonspec.ConfigTable({"rms_norm_fwd": _rms_norm_fwd})


core_ext_spec_func_list = ["toy_clamp01"]


@_core.builtin
def toy_clamp01(x, _semantic=None):
    """``tl.toy_clamp01(x)``: ``min(max(x, 0), 1)`` elementwise (NaN propagates to 0: maxnum semantics)."""
    x = _semantic.to_tensor(x)
    lo = _semantic.maximum(x, 0.0, _core.PropagateNan.NONE)
    return _semantic.minimum(lo, 1.0, _core.PropagateNan.NONE)


__all__ = ["backend_info", "atomic_disable_bf16", "kernel_config", "core_ext_spec_func_list", "toy_clamp01"]
