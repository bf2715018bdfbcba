"""libdevice for interpreted kernels (``TRITON_INTERPRET=1``), computed with numpy.

Stock Triton's interpreter raises ``NotImplementedError`` on every extern call, so a kernel that
uses ``libdevice`` cannot be tested on a CPU. Each function here has the name of a libdevice
function and is installed by tritonspec (hook ``interpreter_libdevice``) in place of the stub
``triton.language.extra.libdevice`` and the ``extra.cuda`` / ``extra.hip`` functions while a
kernel is interpreted.

Why the CUDA tables: dtype rules (which argument dtypes are accepted, the result dtype, scalar
broadcasting, ``isnan`` returning int1 after an int32 extern) are taken from the body of the real
``triton.language.extra.cuda.libdevice`` function, run with a ``core`` whose
``extern_elementwise`` computes with numpy instead of emitting a call. An fp16 argument therefore
fails in the interpreter as it fails when compiling for CUDA (with a clearer message).
"""

from __future__ import annotations

import importlib.util
import inspect
import math as _math
import types

import numpy as np
from triton.language import core
from triton.language.extra.cuda import libdevice as _cuda

_SQRT1_2 = 1.0 / _math.sqrt(2.0)


def _vec(fn):
    """A float64 numpy version of a scalar ``math`` function (for erf, lgamma, ...)."""
    v = np.vectorize(fn, otypes=[np.float64])
    return lambda x: v(np.asarray(x, dtype=np.float64))


def _round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _ldexp(x, n):
    return np.ldexp(x, np.asarray(n, dtype=np.int32))


_erf = _vec(_math.erf)
_erfc = _vec(_math.erfc)

# libdevice name -> numpy implementation (inputs are the argument arrays after CUDA's dtype dispatch).
NUMPY_IMPLS = {
    # rounding and basic arithmetic
    "abs": np.abs,
    "floor": np.floor,
    "ceil": np.ceil,
    "trunc": np.trunc,
    "rint": np.rint,
    "nearbyint": np.rint,
    "round": _round_half_away,
    "saturatef": lambda x: np.clip(x, 0, 1),
    "copysign": np.copysign,
    "fdim": lambda x, y: np.maximum(x - y, 0),
    "fmod": np.fmod,
    "remainder": lambda x, y: x - y * np.rint(x / y),
    "nextafter": np.nextafter,
    "ldexp": _ldexp,
    "add_rn": np.add,
    "sub_rn": np.subtract,
    "mul_rn": np.multiply,
    "div_rn": np.divide,
    "fast_dividef": np.divide,
    "rcp_rn": lambda x: 1 / x,
    "fma": lambda a, b, c: a * b + c,
    "fma_rn": lambda a, b, c: a * b + c,
    # roots and powers
    "sqrt": np.sqrt,
    "sqrt_rn": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "rsqrt_rn": lambda x: 1 / np.sqrt(x),
    "cbrt": np.cbrt,
    "rcbrt": lambda x: 1 / np.cbrt(x),
    "hypot": np.hypot,
    "pow": np.power,
    "fast_powf": np.power,
    # exponentials and logarithms
    "exp": np.exp,
    "exp2": np.exp2,
    "exp10": lambda x: np.power(x.dtype.type(10), x),
    "expm1": np.expm1,
    "log": np.log,
    "log2": np.log2,
    "log10": np.log10,
    "log1p": np.log1p,
    "fast_expf": np.exp,
    "fast_exp10f": lambda x: np.power(x.dtype.type(10), x),
    "fast_logf": np.log,
    "fast_log2f": np.log2,
    "fast_log10f": np.log10,
    # trigonometric and hyperbolic
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "atan2": np.arctan2,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "fast_sinf": np.sin,
    "fast_cosf": np.cos,
    "fast_tanf": np.tan,
    # special functions
    "erf": _erf,
    "erfc": _erfc,
    "normcdf": lambda x: 0.5 * _erfc(-np.asarray(x, np.float64) * _SQRT1_2),
    "lgamma": _vec(_math.lgamma),
    "tgamma": _vec(_math.gamma),
    # classification (CUDA returns int32; the CUDA wrappers convert to int1 where libdevice does)
    "isnan": np.isnan,
    "isinf": np.isinf,
    "isfinited": np.isfinite,
    "finitef": np.isfinite,
    "signbit": np.signbit,
}


def _numpy_extern(name, impl, args, arg_type_symbol_dict, _semantic):
    """``core.extern_elementwise`` computed with numpy: same dtype dispatch and broadcasting."""
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    args = [_semantic.to_tensor(a) for a in args]
    arg_types = tuple(a.dtype for a in args)
    if arg_types not in arg_type_symbol_dict:
        raise ValueError(
            f"libdevice.{name} has no variant for argument dtypes ({', '.join(map(str, arg_types))}); "
            f"as with CUDA's libdevice, use one of {sorted(tuple(map(str, k)) for k in arg_type_symbol_dict)}"
        )
    ret_dtype = arg_type_symbol_dict[arg_types][1]
    shaped = args[0]
    for a in args:
        _, shaped = _semantic.binary_op_type_checking_impl(a, shaped, arithmetic_check=False)
    args = [_semantic.binary_op_type_checking_impl(a, shaped, arithmetic_check=False)[0] for a in args]
    ret_type = shaped.type.with_element_ty(ret_dtype) if shaped.type.is_block() else ret_dtype
    with np.errstate(all="ignore"):
        data = np.asarray(impl(*[a.handle.data for a in args])).astype(_get_np_dtype(ret_dtype))
    return core.tensor(TensorHandle(data, ret_dtype), ret_type)


class _CoreWithNumpyExtern:
    """What a CUDA libdevice function sees as ``core``: the real module, except extern calls."""

    def __init__(self, name, impl):
        self._name, self._impl = name, impl

    def __getattr__(self, attr):
        return getattr(core, attr)

    def extern_elementwise(self, lib_name, lib_path, args, arg_type_symbol_dict, is_pure, _semantic=None):
        return _numpy_extern(self._name, self._impl, args, arg_type_symbol_dict, _semantic)


def _pristine_cuda_libdevice():
    """A private copy of ``triton.language.extra.cuda.libdevice``: the interpreter (and tritonspec)
    may have patched the functions of the shared one while kernels run."""
    spec = importlib.util.spec_from_file_location("_tritonspec_cpu_cuda_libdevice", _cuda.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CUDA = _pristine_cuda_libdevice()


def _check_interpreting(name, _semantic):
    if _semantic is None:
        raise ValueError(f"libdevice.{name} (tritonspec cpu) must be called inside a kernel")
    if type(_semantic.builder).__name__ != "InterpreterBuilder":
        raise RuntimeError(
            f"libdevice.{name} from the tritonspec cpu spec computes with numpy and only runs in "
            "interpreted kernels (TRITON_INTERPRET=1); compiled kernels use the target's libdevice"
        )


def _make(name, impl):
    """A builtin running CUDA's ``libdevice.<name>`` body with its extern call computed by ``impl``."""
    cuda_fn = getattr(_CUDA, name)
    body = inspect.unwrap(cuda_fn)
    glb = dict(vars(_CUDA), core=_CoreWithNumpyExtern(name, impl))
    cuda_body = types.FunctionType(body.__code__, glb, name, body.__defaults__, body.__closure__)

    def fn(*args, _semantic=None):
        _check_interpreting(name, _semantic)
        return cuda_body(*args, _semantic=_semantic)

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = f"libdevice.{name} computed with numpy (dtype rules of the CUDA libdevice)."
    fn.__signature__ = inspect.signature(cuda_fn)
    return core.extern(fn)


for _name, _impl in NUMPY_IMPLS.items():
    if hasattr(_CUDA, _name):  # a libdevice name this Triton release knows
        globals()[_name] = _make(_name, _impl)


def _float_unary(name, x, _semantic, impl, dtypes):
    _check_interpreting(name, _semantic)
    x = _semantic.to_tensor(x)
    if x.dtype not in dtypes:
        raise ValueError(f"libdevice.{name}: expected {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    from triton.runtime.interpreter import TensorHandle

    with np.errstate(all="ignore"):
        data = np.asarray(impl(x.handle.data)).astype(x.handle.data.dtype)
    return core.tensor(TensorHandle(data, x.dtype), x.type)


@core.extern
def fast_tanhf(arg0, _semantic=None):
    """hip's fast tanh (the stub libdevice names it; CUDA's has no entry): fp32 only."""
    return _float_unary("fast_tanhf", arg0, _semantic, np.tanh, (core.float32,))


@core.extern
def sigmoid(arg0, _semantic=None):
    """1 / (1 + exp(-x)) for fp32 / fp64 (a vendor libdevice name; not in CUDA's libdevice)."""
    return _float_unary("sigmoid", arg0, _semantic, _sigmoid, (core.float32, core.float64))


NAMES = tuple(
    sorted(n for n, v in globals().items() if core.is_builtin(v) and getattr(v, "__module__", "") == __name__)
)
