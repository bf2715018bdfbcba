"""Ascend NPU libdevice: math bound to the NPU's ``__hmf_*`` device library, plus ``exp`` / ``log``
with the NPU's dtype rules.

Compiled for an ``ascend`` target, ``isnan`` / ``isinf`` / ``tanh`` are ``tt.extern_elementwise``
calls to the NPU symbols (names as in triton-ascend's libdevice; we have no toolchain to link
them). In interpreted kernels the same functions compute with numpy, so their meaning is tested
on a CPU. The ascend backend maps ``triton.language.extra.libdevice`` to this module; a libdevice
function not bound here is a clear error naming it.
"""

from __future__ import annotations

from triton.language import core

_NPU_FLOATS = ("fp16", "bf16", "fp32")


def _interpreting(_semantic) -> bool:
    return type(_semantic.builder).__name__ == "InterpreterBuilder"


def _check_float(name, x):
    if x.dtype.name not in _NPU_FLOATS:
        raise ValueError(f"{name} (ascend): argument dtype must be one of {', '.join(_NPU_FLOATS)}, got {x.dtype}")


def _numpy(fn_name, x, ret_dtype, _semantic):
    """Interpreter path: apply ``numpy.<fn_name>`` to the argument's data (numpy loads only here)."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    with np.errstate(all="ignore"):
        data = np.asarray(getattr(np, fn_name)(x.handle.data)).astype(_get_np_dtype(ret_dtype))
    ret_ty = x.type.with_element_ty(ret_dtype) if x.type.is_block() else ret_dtype
    return core.tensor(TensorHandle(data, ret_dtype), ret_ty)


@core.extern
def exp(x, _semantic=None):
    """e**x for fp16 / bf16 / fp32 (the NPU's vector unit has no fp64; mainline's accepts fp32 / fp64)."""
    x = _semantic.to_tensor(x)
    _check_float("exp", x)
    return core.tensor(_semantic.builder.create_exp(x.handle), x.type)


@core.extern
def log(x, _semantic=None):
    """Natural log for fp16 / bf16 / fp32 (same dtype rule as ``exp``)."""
    x = _semantic.to_tensor(x)
    _check_float("log", x)
    return core.tensor(_semantic.builder.create_log(x.handle), x.type)


def _extern_predicate(name, symbol, numpy_fn, x, _semantic):
    x = _semantic.to_tensor(x)
    _check_float(name, x)
    if _interpreting(_semantic):
        return _numpy(numpy_fn, x, core.int1, _semantic)
    table = {(core.dtype(d),): (symbol, core.dtype("int1")) for d in _NPU_FLOATS}
    return core.extern_elementwise("", "", [x], table, is_pure=True, _semantic=_semantic)


@core.extern
def isnan(x, _semantic=None):
    """True where x is NaN: the NPU library's ``__hmf_isnan`` (int1 result)."""
    return _extern_predicate("isnan", "__hmf_isnan", "isnan", x, _semantic)


@core.extern
def isinf(x, _semantic=None):
    """True where x is +-inf: the NPU library's ``__hmf_isinf`` (int1 result)."""
    return _extern_predicate("isinf", "__hmf_isinf", "isinf", x, _semantic)


@core.extern
def tanh(x, _semantic=None):
    """tanh for fp32 (``__hmf_tanhf``) and fp16 (``__hmf_tanhDh``)."""
    x = _semantic.to_tensor(x)
    if x.dtype not in (core.float32, core.float16):
        raise ValueError(f"tanh (ascend): argument dtype must be fp32 or fp16, got {x.dtype}")
    if _interpreting(_semantic):
        return _numpy("tanh", x, x.dtype, _semantic)
    return core.extern_elementwise(
        "",
        "",
        [x],
        {
            (core.float32,): ("__hmf_tanhf", core.float32),
            (core.float16,): ("__hmf_tanhDh", core.float16),
        },
        is_pure=True,
        _semantic=_semantic,
    )


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"libdevice.{name} has no Ascend binding in tritonspec's ascend backend (bound: exp, log, isnan, isinf, tanh)"
    )
