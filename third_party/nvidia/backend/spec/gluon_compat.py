"""Gluon's Hopper API under the names the sm90 kernels (attention, the experts' GEMMs) call, on every Triton we
support (3.6 to 3.9).

Later Tritons renamed the TMA copies, cp.async's copy and the partition barrier, and Triton 3.6 has the TMA
reduce-add IR op but no Gluon wrapper for it: the kernels call the names below, which are whichever this Triton
has. ``GLUON`` is False on a Triton without Gluon's Hopper API; nothing else is defined then, and the hooks
always decline.
"""

from __future__ import annotations

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import tma

    GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # a Triton without Gluon
    GLUON = False

if GLUON:
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # a partition's own threads (named barrier)
    tma_reduce_add = getattr(tma, "async_atomic_add", None)
    if tma_reduce_add is None:  # Triton 3.6 has the IR op but no Gluon wrapper for it
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        @_builtin
        def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
            """Bulk reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor)."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(
                _ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
            )


__all__ = ["GLUON", "tma_load", "tma_store", "cp_async_load", "thread_barrier", "tma_reduce_add"]
