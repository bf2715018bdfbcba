"""Iluvatar spec: what FlagTree's iluvatar backend specialized, as declared tritonspec hooks.

Emulated: it compiles through the CUDA pipeline and runs on NVIDIA GPUs (our conformance target),
never on CoreX hardware. Hooks: 64-bit atomic add from 32-bit atomics (``semantic``), no bf16
atomics, at most 2 pipeline stages (cap + autotuner pruning), its own tile configs (``configs``),
the host compiler choice (``get_cc``), and for interpreted kernels the numpy libdevice with
CUDA's dtype rules (its libdevice is CUDA's).
"""

import os

from tritonspec import BackendInfo, CheckTarget

from .configs import get_pruned_configs, kernel_config
from .semantic import atomic_add_int64

backend_info = BackendInfo(
    runs="emulated",
    targets=("iluvatar",),
    # the limits of the NVIDIA GPU the emulation runs on (CoreX parts state their own)
    check_targets=(
        CheckTarget(
            "iluvatar90", ("iluvatar", 90, 32), shared_memory=232448, registers=255, units=132, part="H100 (emulation)"
        ),
    ),
    note="CUDA pipeline on NVIDIA GPUs; no CoreX hardware or toolchain involved",
)

num_stages_cap = 2  # CoreX software pipelining supports at most 2 stages


def atomic_disable_bf16() -> bool:
    """CoreX has no bf16 atomics: a bf16 atomic op is a compile error, not a silent fallback."""
    return True


def get_cc():
    """The CoreX SDK's clang for launcher stubs (``$ILUVATAR_CC`` or ``$COREX_HOME/bin/clang``), else None."""
    cc = os.environ.get("ILUVATAR_CC")
    if cc:
        return cc
    clang = os.path.join(os.environ.get("COREX_HOME", "/usr/local/corex"), "bin", "clang")
    return clang if os.access(clang, os.X_OK) else None


def interpreter_libdevice():
    """CoreX's libdevice is CUDA's: interpreted kernels use the numpy one with CUDA's dtype rules."""
    from tritonspec_backends.cpu.language.cpu import libdevice

    return libdevice


__all__ = [
    "backend_info",
    "atomic_add_int64",
    "atomic_disable_bf16",
    "num_stages_cap",
    "get_pruned_configs",
    "kernel_config",
    "get_cc",
    "interpreter_libdevice",
]
