"""Iluvatar driver: the CUDA driver reporting ``iluvatar`` targets, active only when selected.

``is_active()`` is True only when iluvatar is selected (``TRITONSPEC_DEFAULT_BACKEND`` or
``TRITON_DEFAULT_BACKEND`` = ``iluvatar``, or an enclosing ``tritonspec.use_backend("iluvatar")``)
and a CUDA GPU is present; see the package docstring for how the CUDA driver stops counting.
"""

import os

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as _nvidia_driver

from .compiler import TARGET_BACKEND


def selected() -> bool:
    """Whether the user selected the iluvatar profile (never creates a driver): Triton's
    ``TRITON_DEFAULT_BACKEND``, or tritonspec's selection in this thread or its process default."""
    if os.environ.get("TRITON_DEFAULT_BACKEND") == TARGET_BACKEND:
        return True
    try:
        from tritonspec.specialization.resolve import explicit_backend
    except ImportError:
        return False
    return explicit_backend() == TARGET_BACKEND


class IluvatarDriver(_nvidia_driver.CudaDriver):
    @staticmethod
    def is_active():
        return selected() and _nvidia_driver.CudaDriver.is_active()

    def get_current_target(self):
        cuda = super().get_current_target()
        return GPUTarget(TARGET_BACKEND, cuda.arch, cuda.warp_size)


def activate():
    """Make an ``IluvatarDriver`` Triton's active driver; returns the driver it replaced (or None).

    Needed on triton 3.6, which cannot be told to skip the CUDA driver; harmless on later ones.
    """
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(IluvatarDriver())
    return previous
