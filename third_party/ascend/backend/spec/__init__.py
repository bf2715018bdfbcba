"""Ascend spec: FlagTree's ascend language extensions over stock Triton.

Compile-only (TTIR for an ``ascend`` target, handed to the CANN toolchain when installed) with
emulated semantics: every extension also has a portable meaning that runs in the interpreter.
- ``tl.gather`` (replaces mainline's: fp16/bf16/fp32 only), ``tl.insert_slice``,
  ``tl.extract_slice``, ``tl.get_element`` (new; ``core.py`` -> ``semantic.py``);
- ``tl.exp`` / ``tl.math.exp``, ``tl.log`` with the NPU dtype rule (fp16/bf16/fp32, no fp64);
  ``tl.math.isnan`` / ``tl.math.isinf`` bound to ``__hmf_isnan`` / ``__hmf_isinf``;
- ``tl.arange`` without the power-of-two rule;
- ``interpreter_libdevice``: interpreted kernels call the same NPU libdevice (numpy path).
"""

from tritonspec import BackendInfo, CheckTarget
from tritonspec_backends.ascend.language.ascend import libdevice as _libdevice

from .core import extract_slice, gather, get_element, insert_slice  # noqa: F401  (the spec's builtins)
from .semantic import ext_semantic_extract_slice, ext_semantic_get_element, ext_semantic_insert_slice  # noqa: F401

backend_info = BackendInfo(
    runs="compile-only",
    targets=("ascend",),
    devices=("npu",),
    # TTIR only: no binary here to read resources from, so no limits to compare with
    check_targets=(CheckTarget("910B3", ("ascend", "Ascend910B3", 0), part="Ascend 910B3 (TTIR)"),),
    note="TTIR offline; a binary only with the CANN toolchain; semantics emulated in the interpreter",
)

exp = _libdevice.exp
log = _libdevice.log
isnan = _libdevice.isnan
isinf = _libdevice.isinf
interpreter_libdevice = _libdevice

core_ext_base_func_list = ["gather"]
core_ext_spec_func_list = ["insert_slice", "extract_slice", "get_element"]
semantic_ext_spec_func_list = ["insert_slice", "extract_slice", "get_element"]
math_ext_base_func_list = ["exp", "log"]
math_ext_spec_func_list = ["isnan", "isinf"]


def arange_disable_check_power_of_two() -> bool:
    """The NPU vectorizes any length: ``tl.arange(0, 10)`` is legal."""
    return True


__all__ = [
    "backend_info",
    "arange_disable_check_power_of_two",
    "interpreter_libdevice",
    "core_ext_base_func_list",
    "core_ext_spec_func_list",
    "semantic_ext_spec_func_list",
    "math_ext_base_func_list",
    "math_ext_spec_func_list",
]
