"""``TritonSemantic`` methods for the ascend extensions, from portable tl operations.

triton-ascend lowers these to its own ops (``create_insert_slice``, ...), which stock Triton's
builder does not have. Here each one is built from ``arange`` / arithmetic / ``gather`` /
``where``, so it is correct wherever stock Triton runs, the interpreter included; on an NPU the
vendor toolchain would see gathers instead of slice ops (functionally the same, not as fast).
Installed as ``TritonSemantic.<name>`` by tritonspec's semantic injector.
"""

from __future__ import annotations

import triton.language as tl


def _i32(sem, value):
    """An int32 scalar tensor from a Python int or an integer scalar tensor."""
    if isinstance(value, tl.tensor):
        return sem.cast(value, tl.int32)
    return sem.scalar_constant(value, tl.int32)


def _vec(sem, value, n):
    """A length-``n`` int32 vector of ``value`` (Python int or scalar tensor)."""
    return sem.splat(_i32(sem, value), [n])


def _lay(sem, v, rank, axis, shape):
    """The 1-D ``v`` laid along ``axis`` and broadcast to ``shape``."""
    for d in range(rank):
        if d != axis:
            v = sem.expand_dims(v, d)
    return sem.broadcast_impl_shape(v, shape)


def ext_semantic_extract_slice(self, ful, offsets, sizes, strides):
    """Gather along each axis in turn: out[i, ...] = ful[offsets + i * strides]."""
    rank = len(ful.shape)
    out = ful
    for d in range(rank):
        n = sizes[d]
        index = self.add(
            self.mul(self.arange(0, n), _vec(self, strides[d], n), False), _vec(self, offsets[d], n), False
        )
        shape = [sizes[k] if k <= d else int(out.shape[k]) for k in range(rank)]
        out = self.gather(out, _lay(self, index, rank, d, shape), d)
    return out


def ext_semantic_insert_slice(self, ful, sub, offsets, sizes, strides):
    """Gather ``sub`` onto ``ful``'s grid, then keep it where the grid point lies on the slice."""
    rank = len(ful.shape)
    full_shape = [int(s) for s in ful.shape]
    value, inside = sub, None
    for d in range(rank):
        n = full_shape[d]
        rel = self.sub(self.arange(0, n), _vec(self, offsets[d], n), False)  # position relative to the slice
        zero, stride = _vec(self, 0, n), _vec(self, strides[d], n)
        ahead = self.greater_equal(rel, zero)
        q = self.floordiv(self.where(ahead, rel, zero), stride)  # index into sub along d
        on = self.and_(
            self.and_(ahead, self.equal(self.mod(rel, stride), zero)), self.less_than(q, _vec(self, sizes[d], n))
        )
        shape = [full_shape[k] if k <= d else sizes[k] for k in range(rank)]
        value = self.gather(value, _lay(self, self.where(on, q, zero), rank, d, shape), d)
        on = _lay(self, on, rank, d, full_shape)
        inside = on if inside is None else self.and_(inside, on)
    return self.where(inside, value, ful)


def ext_semantic_get_element(self, src, indice):
    """``src[indice]`` as a scalar: a one-element gather per axis, then unsplat."""
    rank = len(src.shape)
    out = src
    for d in range(rank):
        shape = [1 if k <= d else int(src.shape[k]) for k in range(rank)]
        out = self.gather(out, _lay(self, _vec(self, indice[d], 1), rank, d, shape), d)
    return self.unsplat(self.reshape(out, [1], False))
