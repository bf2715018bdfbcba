"""Language points: TritonSemantic methods (the interpreter uses the same class) and FlagTree's injectors."""

from __future__ import annotations

import functools
import sys

from .. import inject
from ..hooks import HOOKS, SpecError
from ..resolve import current_backend, lookup, value
from . import InstallPoint, injecting_spec, patch


def _install_atomic_add(semantic):
    cls = semantic.TritonSemantic
    orig = cls.atomic_add

    @functools.wraps(orig)
    def atomic_add(self, ptr, val, mask, sem, scope):
        fn = lookup("atomic_add_int64")
        if fn is not None:
            elt = getattr(getattr(ptr, "type", None), "scalar", None)
            elt = getattr(elt, "element_ty", None)
            if elt is not None and elt.is_int() and elt.primitive_bitwidth == 64:
                return fn(self, ptr, val, mask, sem, scope)
        return orig(self, ptr, val, mask, sem, scope)

    patch(cls, "atomic_add", atomic_add)


def _install_atomic_bf16(semantic):
    cls = semantic.TritonSemantic
    orig = cls.atom_red_typechecking_impl

    @functools.wraps(orig)
    def atom_red_typechecking_impl(self, ptr, val, mask, op):
        ptr, val, mask = orig(self, ptr, val, mask, op)
        if ptr.type.scalar.element_ty.is_bf16() and value("atomic_disable_bf16"):
            raise ValueError(
                f"atomic_{op} on bfloat16 is not supported by backend {current_backend()!r}; "
                "accumulate in float32 instead"
            )
        return ptr, val, mask

    patch(cls, "atom_red_typechecking_impl", atom_red_typechecking_impl)


def _install_arange(language):
    """The power-of-two rule lives in TritonSemantic.arange and in block-shape validation (core)."""
    from triton.language import core, semantic

    cls = semantic.TritonSemantic
    orig_arange, orig_validate = cls.arange, core.validate_block_shape
    tl = semantic.tl

    def lifted() -> bool:
        return bool(value("arange_disable_check_power_of_two"))

    @functools.wraps(orig_arange)
    def arange(self, start, end, *, ret_ty=None):
        n = end - start if isinstance(start, int) and isinstance(end, int) else 0
        if n > 0 and n & (n - 1) and lifted():
            if type(self.builder).__name__ != "InterpreterBuilder":
                hook = HOOKS["arange_disable_check_power_of_two"]
                raise SpecError(
                    f"tl.arange({start}, {end}): backend {current_backend()!r} specializes "
                    f"{hook.name!r}, which applies to interpreted kernels only: {hook.interpreter_only}"
                )
            if (start >> 32) or (end >> 32):  # the stock checks other than the power of two still hold
                raise ValueError("arange must fit in int32")
            ret_ty = ret_ty or tl.block_type(tl.int32, [n])
            make = getattr(self, "make_tensor", None) or self.tensor  # make_tensor arrived after 3.6
            return make(self.builder.create_make_range(ret_ty.to_ir(self.builder), start, end), ret_ty)
        return orig_arange(self, start, end, ret_ty=ret_ty)

    @functools.wraps(orig_validate)
    def validate_block_shape(shape):
        try:  # every block type built goes through here: a shape stock Triton accepts costs one call
            return orig_validate(shape)
        except ValueError:
            if not (any(isinstance(d, int) and d > 0 and d & (d - 1) for d in shape) and lifted()):
                raise
        from triton._utils import TRITON_MAX_TENSOR_NUMEL

        numel = 1
        for d in shape:
            numel *= d
        if numel > TRITON_MAX_TENSOR_NUMEL:
            raise ValueError(f"numel ({numel}) exceeds triton maximum tensor numel ({TRITON_MAX_TENSOR_NUMEL})")
        return numel

    patch(cls, "arange", arange)
    patch(core, "validate_block_shape", validate_block_shape)


def _install_cache_modifier(language):
    """Extra load cache modifiers, mapped by the spec onto an ``ir.CACHE_MODIFIER``.

    Triton <= 3.8 converts the string in TritonSemantic._str_to_load_cache_modifier; 3.9 validates it
    in core._CachePolicy and hands the builder a name, so the spec's result is translated to that name.
    """
    from triton.language import core, semantic

    policy = getattr(core, "_CachePolicy", None)
    if policy is None:
        cls = semantic.TritonSemantic
        orig = cls._str_to_load_cache_modifier

        @functools.wraps(orig)
        def _str_to_load_cache_modifier(self, cache_modifier):
            fn = lookup("ext_str_to_load_cache_modifier") if cache_modifier else None
            result = fn(cache_modifier) if fn is not None else None
            return orig(self, cache_modifier) if result is None else result

        patch(cls, "_str_to_load_cache_modifier", _str_to_load_cache_modifier)
        return
    orig_post_init = policy.__post_init__

    @functools.wraps(orig_post_init)
    def __post_init__(self):
        cm = core._unwrap_if_constexpr(self.cache_modifier)
        if isinstance(cm, str) and cm.removeprefix(".") not in _STOCK_MODIFIERS:
            fn = lookup("ext_str_to_load_cache_modifier")
            result = fn("." + cm.removeprefix(".")) if fn is not None else None
            if result is not None:
                object.__setattr__(self, "cache_modifier", result.name.lower())
        orig_post_init(self)

    patch(policy, "__post_init__", __post_init__)


_STOCK_MODIFIERS = {"", "none", "ca", "cg", "wb", "cs", "wt", "cv"}


def _install_injectors(language):
    """FlagTree's injector names on the stock modules, plus the ambient backend's injections."""
    from triton.language import core, math, semantic, standard

    patch(core, "spec_core_func", inject.spec_core_func)
    patch(semantic, "spec_semantic_func", inject.spec_semantic_func)
    patch(standard, "spec_standard_func", inject.spec_standard_func)
    patch(math, "spec_math_func", inject.spec_math_func)
    apply_ambient_injections()


def apply_ambient_injections():
    if "triton.language" not in sys.modules:
        return
    inject.apply(injecting_spec())  # waits for any kernel being generated with other injections


POINTS = (
    InstallPoint(
        "semantic.atomic_add",
        "triton.language.semantic",
        _install_atomic_add,
        doc="TritonSemantic.atomic_add: int64 atomic add lowering",
    ),
    InstallPoint(
        "semantic.atom_red_typechecking_impl",
        "triton.language.semantic",
        _install_atomic_bf16,
        doc="TritonSemantic.atom_red_typechecking_impl: bf16 atomics policy",
    ),
    InstallPoint(
        "semantic.arange",
        "triton.language",
        _install_arange,
        doc="TritonSemantic.arange + core.validate_block_shape: power-of-two rule",
    ),
    InstallPoint(
        "semantic.load_cache_modifier",
        "triton.language",
        _install_cache_modifier,
        doc="load cache modifiers: TritonSemantic (<= 3.8) or core._CachePolicy (3.9)",
    ),
    InstallPoint(
        "language.injectors",
        "triton.language",
        _install_injectors,
        doc="spec_core/semantic/standard/math_func and the backend's tl builtins",
    ),
)
