"""Eager launches that skip Triton's per-call binding once a kernel is compiled.

``JITFunction.run`` re-derives the specialization of every argument, builds a cache key and checks
globals on each launch: tens of microseconds on the benchmark host, which is what makes a Llama-size
RMSNorm forward+backward host-bound (three launches). Here the key is built from the same facts
Triton specializes on (tensor dtype and 16-byte alignment; an int's width, ==1 and %16; constexpr
values; launch options) plus the device and the spec selection; a hit launches the cached
``CompiledKernel`` directly, a miss takes Triton's normal path and remembers what it returned.
"""
from __future__ import annotations

import inspect

import torch

from .. import install

_INT32 = range(-2 ** 31, 2 ** 31)


def _arg_key(value, constexpr: bool):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if constexpr or isinstance(value, (bool, type(None), str)):
        return value
    if isinstance(value, int):
        return int, value == 1, value % 16 == 0, value in _INT32
    return type(value)


class CachedLauncher:
    """``CachedLauncher(kernel)[grid](*args, **kwargs)``, a drop-in for ``kernel[grid](...)`` in eager code."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = [p.name for p in kernel.params]
        self.constexpr = [p.is_constexpr for p in kernel.params]
        self.defaults = [p.default for p in inspect.signature(kernel.fn).parameters.values()]
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if callable(grid):
            return self.kernel[grid](*args, **kwargs)
        bound = list(args)
        for i in range(len(args), len(self.names)):
            name = self.names[i]
            bound.append(kwargs[name] if name in kwargs else self.defaults[i])
        options = tuple((k, v) for k, v in kwargs.items() if k not in self.names)
        # install._jit_key is the spec selection: kernels compiled under another one stay apart.
        key = (torch.cuda.current_device(), install._jit_key, options,
               tuple(_arg_key(v, c) for v, c in zip(bound, self.constexpr)))
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](*args, **kwargs)
            return
        compiled[grid if len(grid) == 3 else tuple(grid) + (1,) * (3 - len(grid))](*bound)
