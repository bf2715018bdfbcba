"""Eager launches that skip Triton's per-call binding once a kernel is compiled.

``JITFunction.run`` binds every argument, computes its specialization and builds a cache key on
each launch; for a memory-bound Llama-size op that host time is what the GPU waits on. Here the
key is built from the same facts Triton specializes on, in one pass over the positional
arguments: a tensor's dtype (and, for all tensors together, 16-byte alignment), an int's residue
mod 16, whether it is 1, whether it needs 64 bits; plus the keyword arguments (constexprs and
launch options), the device and the spec selection. A hit calls the compiled kernel's launcher
directly with the remembered trailing arguments (through ``CompiledKernel[grid]`` when a launch
hook such as a profiler's is set); a miss, or any misaligned tensor, takes Triton's path.

Call sites pass runtime arguments positionally and constexprs/options by keyword, always in the
same order (the keyword order is part of the key); a constexpr passed positionally, or a callable
grid, takes Triton's path.
"""
from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime import driver

from .. import install

_Tensor = torch.Tensor
_INT32_MAX = 2 ** 31 - 1


def _hooked(hook) -> bool:
    """Whether a launch hook would run: Triton >= 3.6 keeps an always-present, possibly empty
    ``HookChain`` (``.calls``); a plain callable counts as set."""
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLauncher:
    """``CachedLauncher(kernel)[grid](*args, **kwargs)``, a drop-in for ``kernel[grid](...)`` in eager code."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = [p.name for p in kernel.params]
        # Positional ints are keyed by what Triton specializes on, which is right for runtime
        # arguments only: a call passing a constexpr positionally takes Triton's path.
        self.n_runtime = next((i for i, p in enumerate(kernel.params) if p.is_constexpr), len(self.names))
        self.defaults = [p.default for p in inspect.signature(kernel.fn).parameters.values()]
        # key -> (CompiledKernel, the arguments after the positional ones in parameter order,
        #         its launcher, function handle, packed metadata, the driver's stream getter)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if callable(grid) or len(args) > self.n_runtime:
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = [device, install._jit_key, *kwargs.items()]
        addresses = 0
        for a in args:
            if isinstance(a, _Tensor):
                key.append(a.dtype)
                addresses |= a.data_ptr()
            elif type(a) is int:
                # Triton specializes on ==1 and %16==0 and widens past int32; this key is finer.
                key.append(a if -16 < a < 16 else (a & 15, a > _INT32_MAX or a < -_INT32_MAX))
            else:
                key.append(a if a is None or type(a) is bool else type(a))
        if addresses & 15:  # some tensor not 16-byte aligned: Triton's own path (and its cache)
            return self.kernel[grid](*args, **kwargs)
        key = tuple(key)
        hit = self.compiled.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            tail = tuple(kwargs[n] if n in kwargs else self.defaults[i]
                         for i, n in enumerate(self.names) if i >= len(args))
            self.compiled[key] = (compiled, tail, compiled.run, compiled.function, compiled.packed_metadata,
                                  driver.active.get_current_stream)
            return
        compiled, tail, run, function, metadata, stream_of = hit
        grid = grid if len(grid) == 3 else (*grid, *(1,) * (3 - len(grid)))
        if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
            compiled[grid](*args, *tail)
        else:
            run(grid[0], grid[1], grid[2], stream_of(device), function, metadata, None, None, None, *args, *tail)
