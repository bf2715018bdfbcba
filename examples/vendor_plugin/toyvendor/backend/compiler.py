"""toyvendor compiler: stock CUDA compilation, under a target name of its own.

The target name is what tritonspec resolves a compile's spec from, so every compile for
``GPUTarget("toyvendor", ...)`` uses the toyvendor spec, and the name is part of Triton's cache key.
Only the module is imported from the nvidia backend: Triton's discovery wants exactly one
concrete BaseBackend subclass in this module's namespace.
"""

import functools
import hashlib
import pathlib

from triton.backends.nvidia import compiler as _nvidia

TARGET_BACKEND = "toyvendor"


class ToyVendorBackend(_nvidia.CUDABackend):
    @staticmethod
    def supports_target(target):
        return target.backend == TARGET_BACKEND

    def get_target_name(self, options) -> str:
        return f"{TARGET_BACKEND}:{self._parse_arch(options.arch)}"

    def hash(self):
        """Part of Triton's cache key: this package's sources as well as the CUDA toolchain's."""
        return f"{TARGET_BACKEND}-{_source_digest()}-{super().hash()}"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]  # the toyvendor package: backend and spec
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()[:16]
