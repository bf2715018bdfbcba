"""Ascend driver: present for Triton's backend discovery; active only on a machine with an NPU.

Launching needs a kernel compiled with the CANN toolchain *and* an NPU runtime launcher. This
compile-only backend ships neither runtime piece: a kernel compiled without the toolchain fails
at launch with ``AscendToolchainError`` naming ``bishengir-compile``; one compiled with it fails
with NotImplementedError (no launcher), never silently.
"""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from .compiler import TARGET_BACKEND, TOOLCHAIN, AscendToolchainError

_CPP_TYPES = {
    "i1": "int8_t",
    "i8": "int8_t",
    "i16": "int16_t",
    "i32": "int32_t",
    "i64": "int64_t",
    "u1": "uint8_t",
    "u8": "uint8_t",
    "u16": "uint16_t",
    "u32": "uint32_t",
    "u64": "uint64_t",
    "fp16": "double",
    "bf16": "double",
    "fp32": "double",
    "fp64": "double",
}


def _launch_error(metadata):
    name = getattr(metadata, "name", "kernel")
    if not getattr(metadata, "npu_toolchain", None):
        return AscendToolchainError(
            f"cannot launch {name!r} on an Ascend NPU: the CANN toolchain `{TOOLCHAIN}` was not on PATH when it was "
            "compiled, so only its TTIR exists (install CANN / bishengir and recompile)"
        )
    return NotImplementedError(
        f"cannot launch {name!r}: tritonspec's ascend backend is compile-only and has no NPU runtime launcher"
    )


class AscendLauncher:
    def __init__(self, src, metadata):
        raise _launch_error(metadata)


class AscendUtils:
    @staticmethod
    def load_binary(name, kernel, shared, device):
        raise AscendToolchainError(f"cannot load {name!r}: tritonspec's ascend backend is compile-only")

    @staticmethod
    def get_device_properties(device):
        return {"max_shared_mem": 0, "multiprocessor_count": 1}


class AscendDriver(DriverBase):
    def __init__(self):
        super().__init__()
        self.utils = AscendUtils()
        self.launcher_cls = AscendLauncher

    @staticmethod
    def is_active():
        try:
            import torch
            import torch_npu  # noqa: F401

            return torch.npu.is_available()
        except Exception:  # no torch_npu / no NPU runtime
            return False

    def get_current_device(self):
        import torch

        return torch.npu.current_device() if hasattr(torch, "npu") else 0

    def set_current_device(self, device):
        import torch

        if hasattr(torch, "npu"):
            torch.npu.set_device(device)

    def get_current_stream(self, device=None):
        import torch

        return torch.npu.current_stream(device).npu_stream if hasattr(torch, "npu") else 0

    def get_current_target(self):
        from .settings import ARCH  # on use: discovery imports this module with the layer disabled too

        return GPUTarget(TARGET_BACKEND, ARCH.get(), 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("npu", self.get_current_device())

    def map_python_to_cpp_type(self, ty: str) -> str:
        return "void*" if ty.startswith("*") else _CPP_TYPES[ty]

    def get_benchmarker(self):
        from triton.testing import do_bench

        return do_bench
