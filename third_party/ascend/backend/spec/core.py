"""Ascend language extensions (``tl.gather``, ``tl.insert_slice``, ``tl.extract_slice``, ``tl.get_element``).

These are the builtins FlagTree's ascend spec injects into ``tl``. Here they validate their
arguments (clear errors naming the argument) and hand off to the ``TritonSemantic`` methods of
``semantic.py``, which express each one with portable tl operations, so the same kernel compiles
to TTIR for an ascend target and runs in the interpreter.
"""

from __future__ import annotations

from triton.language import core


def _seq(name, arg, values):
    """A list from a tuple / list / tl.tuple argument, constexprs unwrapped."""
    values = core._unwrap_if_constexpr(values)
    values = getattr(values, "values", values)  # tl.tuple
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: {arg} must be a tuple or list, got {type(values).__name__}")
    return [core._unwrap_if_constexpr(v) for v in values]


def _ints(name, arg, values, rank, minimum):
    values = _seq(name, arg, values)
    if len(values) != rank:
        raise ValueError(f"{name}: {arg} has {len(values)} entries but the tensor has rank {rank}")
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ValueError(f"{name}: {arg} must be compile-time ints >= {minimum}, got {values}")
    return values


def _offsets(name, values, rank):
    values = _seq(name, "offsets", values)
    if len(values) != rank:
        raise ValueError(f"{name}: offsets has {len(values)} entries but the tensor has rank {rank}")
    for v in values:
        if isinstance(v, core.tensor):
            if v.type.is_block() or not v.dtype.is_int():
                raise TypeError(f"{name}: offsets must be ints or integer scalars, got {v.type}")
        elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: offsets must be ints >= 0 or integer scalars, got {values}")
    return values


def _block(name, arg, x):
    if not isinstance(x, core.tensor) or not x.type.is_block():
        raise TypeError(f"{name}: {arg} must be a tensor (block), got {getattr(x, 'type', type(x).__name__)}")


@core.builtin
def gather(src, index, axis, _semantic=None):
    """``tl.gather`` with the NPU's dtype rule: ``src`` must be fp16, bf16 or fp32."""
    axis = core._unwrap_if_constexpr(axis)
    if src.dtype.name not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"gather (ascend): src dtype must be fp16, bf16 or fp32, got {src.dtype}")
    if not index.dtype.is_int():
        raise TypeError(f"gather (ascend): index must be an integer tensor, got {index.dtype}")
    return _semantic.gather(src, index, axis)


@core.builtin
def extract_slice(ful, offsets, sizes, strides, _semantic=None):
    """The sub-tensor of shape ``sizes`` starting at ``offsets`` (ints or scalars) stepping by ``strides``."""
    _block("extract_slice", "ful", ful)
    rank = len(ful.shape)
    offsets = _offsets("extract_slice", offsets, rank)
    sizes = _ints("extract_slice", "sizes", sizes, rank, 1)
    strides = _ints("extract_slice", "strides", strides, rank, 1)
    for d, (off, size, stride, dim) in enumerate(zip(offsets, sizes, strides, ful.shape)):
        if isinstance(off, int) and off + (size - 1) * stride >= dim:
            raise ValueError(
                f"extract_slice: along dim {d} the slice {off}:{off + (size - 1) * stride + 1}:{stride} "
                f"leaves the tensor (size {dim})"
            )
    return _semantic.extract_slice(ful, offsets, sizes, strides)


@core.builtin
def insert_slice(ful, sub, offsets, sizes, strides, _semantic=None):
    """``ful`` with ``sub`` (shape ``sizes``) written at ``offsets`` stepping by ``strides``."""
    _block("insert_slice", "ful", ful)
    _block("insert_slice", "sub", sub)
    rank = len(ful.shape)
    offsets = _offsets("insert_slice", offsets, rank)
    sizes = _ints("insert_slice", "sizes", sizes, rank, 1)
    strides = _ints("insert_slice", "strides", strides, rank, 1)
    if [int(s) for s in sub.shape] != sizes:
        raise ValueError(f"insert_slice: sub has shape {[int(s) for s in sub.shape]} but sizes is {sizes}")
    if sub.dtype != ful.dtype:
        raise TypeError(f"insert_slice: sub dtype {sub.dtype} differs from ful dtype {ful.dtype}")
    return _semantic.insert_slice(ful, sub, offsets, sizes, strides)


@core.builtin
def get_element(src, indice, _semantic=None):
    """The scalar ``src[indice]`` (``indice``: one int or integer scalar per dimension)."""
    _block("get_element", "src", src)
    indice = _offsets("get_element", indice, len(src.shape))
    for d, (i, dim) in enumerate(zip(indice, src.shape)):
        if isinstance(i, int) and i >= dim:
            raise ValueError(f"get_element: indice[{d}] = {i} is out of range for a dimension of size {dim}")
    return _semantic.get_element(src, indice)
