"""Iluvatar compiler: the CUDA pipeline for targets ``GPUTarget("iluvatar", <sm>, 32)``.

Why a target backend of its own (and not a cuda target compiled under ``use_backend``): the
target name is what tritonspec resolves a compile's spec from, so every compile for an iluvatar
target gets the iluvatar spec (64-bit atomics from 32-bit ones, num_stages <= 2, no bf16 atomics)
without any selection in scope, cross-compiling from a CUDA process included, and the target is
part of Triton's cache key so iluvatar and cuda binaries never mix. The arch is an NVIDIA
compute capability because the emulation runs on NVIDIA GPUs; the real CoreX toolchain is not
used (see the spec's ``backend_info``).
"""

import os

from triton.backends.nvidia import compiler as _nvidia_compiler

TARGET_BACKEND = "iluvatar"


class IluvatarBackend(_nvidia_compiler.CUDABackend):
    @staticmethod
    def supports_target(target):
        return target.backend == TARGET_BACKEND

    def get_target_name(self, options) -> str:
        return f"{TARGET_BACKEND}:{self._parse_arch(options.arch)}"

    def hash(self):
        """Part of Triton's cache key: our sources as well as the CUDA toolchain's."""
        return f"{TARGET_BACKEND}-{_source_digest()}-{super().hash()}"


def _source_digest() -> str:
    """Every .py file of the iluvatar package (backend, spec, libdevice), so editing any recompiles."""
    from tritonspec.specialization.fingerprint import source_digest

    return source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
