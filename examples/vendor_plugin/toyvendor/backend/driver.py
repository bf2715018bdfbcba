"""toyvendor driver: the CUDA driver reporting toyvendor targets, active only when selected.

Unselected, it never counts as a second active driver next to CUDA's. Selected in a CUDA process,
set ``TRITON_DEFAULT_BACKEND=toyvendor`` (triton >= 3.7) so Triton creates only this driver.
"""

import os

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as _nvidia

from .compiler import TARGET_BACKEND


def selected() -> bool:
    """Whether tritonspec selects toyvendor here (never imports tritonspec when it is disabled)."""
    if os.environ.get("TRITONSPEC_DISABLE", "").lower() in ("1", "true", "yes", "on", "y"):
        return False
    try:
        from tritonspec.specialization.resolve import explicit_backend
    except ImportError:
        return False
    return explicit_backend() == TARGET_BACKEND


class ToyVendorDriver(_nvidia.CudaDriver):
    @staticmethod
    def is_active():
        return selected() and _nvidia.CudaDriver.is_active()

    def get_current_target(self):
        cuda = super().get_current_target()
        return GPUTarget(TARGET_BACKEND, cuda.arch, cuda.warp_size)
