"""Iluvatar language semantics: 64-bit atomic add built from 32-bit atomics.

Why: Iluvatar's CoreX GPUs have no 64-bit atomic add (FlagTree's iluvatar backend lowers
``tl.atomic_add`` on int64 the same way). The emulation runs through ``TritonSemantic``, so it
applies to compiled and interpreted kernels alike.

Algorithm, per element (memory is little endian: the low word is at the lower address)::

    old_lo = atomic_add(lo_word, val_lo)          # 32-bit, returns the previous low word
    carry  = (old_lo + val_lo) mod 2**32 < old_lo  # did this add wrap the low word?
    old_hi = atomic_add(hi_word, val_hi + carry)   # 32-bit

Final memory is exact under any concurrency: every add lands its low part in the low word and
exactly one carry (taken from the value *its own* atomic saw) in the high word, and addition
commutes, so the result is ``initial + sum(vals) mod 2**64``. What is NOT atomic is the 64-bit
value as a whole: between the two atomics another thread can read a torn value (new low word,
old high word), and the returned "old" value ``old_hi:old_lo`` pairs a high word and a low word
observed at two different moments, so it is only a snapshot when no other thread adds to the
same address concurrently. Code that needs the returned value (e.g. a ticket counter) must use
int32 atomics on this backend.
"""

from __future__ import annotations

import triton.language as tl
from triton._C.libtriton import ir


def _sem_enum(semantic, sem):
    return semantic._str_to_sem(sem) if sem is None or isinstance(sem, str) else sem


def _scope_enum(semantic, scope):
    return semantic._str_to_scope(scope) if scope is None or isinstance(scope, str) else scope


def _const_like(semantic, x, value, dtype):
    """A tensor of ``value`` with ``x``'s shape (a scalar when ``x`` is one)."""
    if x.type.is_block():
        return semantic.full(x.type.get_block_shapes(), value, dtype)
    return semantic.scalar_constant(value, dtype)


def _atomic_add_u32(semantic, ptr, val, mask, sem, scope):
    handle = semantic.builder.create_atomic_rmw(ir.ATOMIC_OP.ADD, ptr.handle, val.handle, mask.handle, sem, scope)
    return tl.tensor(handle, val.type)


def atomic_add_int64(semantic, ptr, val, mask, sem, scope):
    """``tl.atomic_add`` on int64 / uint64 as two 32-bit atomic adds with carry propagation.

    Returns the 64-bit value assembled from the two returned words (see the module docstring for
    when that is a consistent snapshot).
    """
    ptr, val, mask = semantic.atom_red_typechecking_impl(ptr, val, mask, "add")
    out_ty = val.type.scalar
    if out_ty not in (tl.int64, tl.uint64):
        raise TypeError(f"atomic_add_int64 (iluvatar): expected an int64 or uint64 value, got {out_ty}")
    sem = _sem_enum(semantic, sem)
    scope = _scope_enum(semantic, scope)

    # Split the operand into unsigned words.
    uval = semantic.bitcast(val, tl.uint64)
    val_lo = semantic.cast(uval, tl.uint32)  # truncation keeps the low 32 bits
    val_hi = semantic.cast(semantic.lshr(uval, _const_like(semantic, uval, 32, tl.uint64)), tl.uint32)

    # Two 32-bit views of the same address.
    lo_ptr = semantic.bitcast(ptr, tl.pointer_type(tl.uint32))
    hi_ptr = semantic.add(lo_ptr, _const_like(semantic, lo_ptr, 1, tl.int32), False)

    old_lo = _atomic_add_u32(semantic, lo_ptr, val_lo, mask, sem, scope)
    new_lo = semantic.add(old_lo, val_lo, False)  # wraps modulo 2**32
    carry = semantic.cast(semantic.less_than(new_lo, old_lo), tl.uint32)  # unsigned compare
    old_hi = _atomic_add_u32(semantic, hi_ptr, semantic.add(val_hi, carry, False), mask, sem, scope)

    shift = _const_like(semantic, old_hi, 32, tl.uint64)
    old = semantic.or_(semantic.shl(semantic.cast(old_hi, tl.uint64), shift), semantic.cast(old_lo, tl.uint64))
    return semantic.bitcast(old, out_ty)
