"""Ascend compiler: Triton source -> TTIR -> the CANN toolchain (``bishengir-compile``) when installed.

Targets are ``GPUTarget("ascend", "<SoC, e.g. Ascend910B3>", 0)``. The TTIR stage uses stock
Triton passes only, so it works anywhere. The last stage hands the TTIR to ``bishengir-compile``
when it is on PATH; when it is not, compiling still succeeds (TTIR is the artifact the IR tests
need) and the kernel records the missing tool, so *launching* it fails with an error naming it.
We have no CANN toolchain, so the toolchain invocation below (``bishengir-compile <ttir> -o <out>``
plus ``$TRITONSPEC_ASCEND_COMPILE_FLAGS``) is untested.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, fields
from typing import Optional

from triton._C.libtriton import ir, passes
from triton.backends.compiler import BaseBackend, GPUTarget, Language

TARGET_BACKEND = "ascend"
TOOLCHAIN = "bishengir-compile"
DEFAULT_ARCH = "Ascend910B3"


@dataclass(frozen=True)
class AscendOptions:
    num_warps: int = 4  # launch-API compatibility; the NPU maps programs to AI cores, not warps
    num_ctas: int = 1
    num_stages: int = 1
    cluster_dims: tuple = (1, 1, 1)
    debug: bool = False
    sanitize_overflow: bool = True
    arch: Optional[str] = None
    backend_name: str = TARGET_BACKEND
    enable_fp_fusion: bool = True
    launch_cooperative_grid: bool = False
    launch_pdl: bool = False
    supported_fp8_dtypes: tuple = ()
    deprecated_fp8_dot_operand_dtypes: tuple = ()
    default_dot_input_precision: str = "ieee"
    allowed_dot_input_precisions: tuple = ("ieee", "tf32")
    max_num_imprecise_acc_default: int = 0
    extern_libs: Optional[tuple] = None
    instrumentation_mode: str = ""
    ir_override: Optional[str] = None

    def hash(self):
        key = "_".join(f"{f.name}-{getattr(self, f.name)}" for f in fields(self))
        return hashlib.sha256(key.encode()).hexdigest()


def _min_dot_size(lhs_type, rhs_type):
    return (1, 1, 1)  # the cube unit pads any tile; no lower bound at the TTIR level


class AscendToolchainError(RuntimeError):
    """The kernel was compiled without the CANN toolchain, so there is no NPU binary to launch."""


class AscendBackend(BaseBackend):
    binary_ext = "npubin"

    @staticmethod
    def supports_target(target: GPUTarget):
        return target.backend == TARGET_BACKEND

    def __init__(self, target: GPUTarget) -> None:
        super().__init__(target)
        self.binary_ext = "npubin"

    def hash(self) -> str:
        """Part of Triton's cache key: our own sources and the toolchain, not only Triton's."""
        tool = shutil.which(TOOLCHAIN)
        return f"{TARGET_BACKEND}-{self.target.arch}-{_source_digest()}-{tool or 'no-toolchain'}"

    def parse_options(self, opts) -> AscendOptions:
        args = {f.name: opts[f.name] for f in fields(AscendOptions) if opts.get(f.name) is not None}
        args.setdefault("arch", str(self.target.arch))
        num_warps = args.get("num_warps", AscendOptions.num_warps)
        if num_warps <= 0 or num_warps & (num_warps - 1):
            raise ValueError(f"ascend: num_warps must be a power of two, got {num_warps}")
        return AscendOptions(**args)

    def pack_metadata(self, metadata):
        return (metadata.num_warps, metadata.num_ctas, metadata.shared)

    def get_codegen_implementation(self, options):
        return {"min_dot_size": _min_dot_size}

    def get_module_map(self):
        from tritonspec_backends.ascend.language.ascend import libdevice

        return {"triton.language.extra.libdevice": libdevice}

    def load_dialects(self, ctx):
        pass  # TTIR only: the core dialects Triton always loads

    @staticmethod
    def make_ttir(mod, metadata, options):
        pm = ir.pass_manager(mod.context)
        pm.enable_debug()
        passes.common.add_inliner(pm)
        if hasattr(passes.ttir, "add_rewrite_tensor_pointer"):  # block pointers (removed in 3.9)
            passes.ttir.add_rewrite_tensor_pointer(pm)
        passes.ttir.add_rewrite_tensor_descriptor_to_pointer(pm)  # no TMA on the NPU
        passes.common.add_canonicalizer(pm)
        passes.ttir.add_combine(pm)
        passes.ttir.add_reorder_broadcast(pm)
        passes.common.add_cse(pm)
        passes.common.add_symbol_dce(pm)
        passes.ttir.add_loop_unroll(pm)
        pm.run(mod, "make_ttir")
        return mod

    def make_npubin(self, src, metadata, options):
        """TTIR -> NPU binary through the CANN toolchain, or an empty binary that cannot launch."""
        metadata["name"] = _kernel_name(str(src))
        metadata["shared"] = 0
        tool = shutil.which(TOOLCHAIN)
        metadata["npu_toolchain"] = tool
        if tool is None:
            metadata["not_built"] = f"{TOOLCHAIN} not on PATH"  # what `tritonspec check` reports
            return b""
        from .settings import COMPILE_FLAGS

        with tempfile.TemporaryDirectory() as tmp:
            ttir, out = os.path.join(tmp, "kernel.ttir"), os.path.join(tmp, "kernel.o")
            with open(ttir, "w") as f:
                f.write(str(src))
            cmd = [tool, ttir, "-o", out] + shlex.split(COMPILE_FLAGS.get() or "")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"ascend: `{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stderr}")
            with open(out, "rb") as f:
                return f.read()

    def add_stages(self, stages, options, language=Language.TRITON):
        if language != Language.TRITON:
            raise NotImplementedError(f"ascend: only Triton kernels compile for the NPU, not {language}")
        stages["ttir"] = lambda src, metadata: self.make_ttir(src, metadata, options)
        stages["npubin"] = lambda src, metadata: self.make_npubin(src, metadata, options)
        from triton import knobs

        hook = getattr(knobs.runtime, "add_stages_inspection_hook", None)
        if hook is not None:
            hook(self, stages, options, language, None)


def _kernel_name(ttir: str) -> str:
    match = re.search(r"tt\.func (?:public )?@([\w$.]+)", ttir)
    if match is None:
        raise RuntimeError("ascend: no tt.func in the TTIR")
    return match.group(1)


def _source_digest() -> str:
    """Every .py file of the ascend package (backend, spec, libdevice), so editing any recompiles."""
    from tritonspec.specialization.fingerprint import source_digest

    return source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
