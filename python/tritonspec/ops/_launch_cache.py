"""Eager launches that skip Triton's per-call binding once a kernel is compiled.

``JITFunction.run`` binds every argument, computes its specialization and builds a cache key on each
launch; for a memory-bound Llama-size op that host time is what the GPU waits on. Here the key is built
from the same facts Triton specializes on, in one pass over the positional arguments: a tensor's dtype
(and, for all tensors together, 16-byte alignment), an int's residue mod 16, whether it is 1, whether it
needs int64 or uint64, a float's type, a host TMA descriptor's dtype, block shape and layout; plus the
keyword arguments (constexprs and launch options), the device and the spec selection. Any other argument
takes Triton's path. A hit calls the compiled kernel's launcher directly with the remembered trailing
arguments (through ``CompiledKernel[grid]`` when a launch hook such as a profiler's is set); a miss, or
any misaligned tensor, takes Triton's path.

Call sites pass runtime arguments positionally or by name (named ones are put in parameter order first)
and constexprs/options by keyword, always in the same order (the keyword order is part of the key); a
constexpr passed positionally, a runtime argument left to its default while others are passed by name,
or a callable grid, takes Triton's path. Triton settings changed after the first launch
(``knobs.runtime.debug``, instrumentation) are not seen by cached launches: set them first, or
``TRITONSPEC_CACHED_LAUNCH=0``. ``tests/test_launch_cache.py`` checks against each supported Triton
release's own binder that a hit launches the binary Triton would have chosen. ``LaunchPlan`` goes one
step further for an op's hot path: it fixes every argument but the tensors and host TMA descriptors, so
a repeated call builds no key at all.
"""

from __future__ import annotations

import inspect

import torch
from triton import knobs
from triton.runtime import driver

from ..specialization.resolve import selection_key

_Tensor = torch.Tensor
_INT32_MAX, _INT32_MIN = 2**31 - 1, -(2**31)
_INT64_MAX = 2**63 - 1


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
        self.runtime_names = tuple(self.names[: self.n_runtime])
        # a runtime parameter after a constexpr one cannot be keyed positionally: Triton's path
        self.cacheable = all(p.is_constexpr for p in kernel.params[self.n_runtime :])
        self.defaults = [p.default for p in inspect.signature(kernel.fn).parameters.values()]
        # key -> (CompiledKernel, the arguments after the positional ones in parameter order,
        #         its launcher, function handle, packed metadata, the driver's stream getter)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _positional(self, args, kwargs):
        """``(args, kwargs)`` with the runtime arguments passed by name moved into ``args``, in parameter
        order; ``(None, None)`` when that cannot be done (one left to its default, or not cacheable)."""
        n = len(args)
        if not self.cacheable:
            return None, None
        if n >= self.n_runtime:
            return args, kwargs
        named = self.runtime_names[n:]
        if not all(name in kwargs for name in named):
            return None, None
        kwargs = dict(kwargs)
        return (*args, *map(kwargs.pop, named)), kwargs

    def _key(self, args, kwargs, device):
        """The cache key for a call, or None when it must take Triton's path."""
        if len(args) > self.n_runtime:
            return None
        key = [device, selection_key(), *kwargs.items()]
        addresses = 0
        for a in args:
            if isinstance(a, _Tensor):
                key.append(a.dtype)
                addresses |= a.data_ptr()
            elif type(a) is int:
                # Triton specializes on ==1 and %16==0 and widens past int32 (to u64 past int64); this key is finer.
                key.append(a if -16 < a < 16 else (a & 15, a > _INT32_MAX or a < _INT32_MIN, a > _INT64_MAX))
            elif a is None or type(a) is bool:
                key.append((a,))  # not a itself: True == 1 and False == 0, but Triton types a bool u1
            elif type(a) is float:
                key.append(float)
            else:
                block = getattr(a, "block_shape", None)
                if block is None:  # anything else: Triton's path
                    return None
                # a host TMA descriptor (tl's or Gluon's): Triton specializes on its dtype, block
                # shape and shared layout; shape, strides and base go to the launcher on each call
                key.append((type(a), a.base.dtype, tuple(block), getattr(a, "layout", None)))
        if addresses & 15:  # some tensor not 16-byte aligned: Triton's own path (and its cache)
            return None
        return tuple(key)

    def _launch(self, grid, call_args, call_kwargs):
        if callable(grid):
            return self.kernel[grid](*call_args, **call_kwargs)
        args, kwargs = call_args, call_kwargs
        device = torch.cuda.current_device()
        args, kwargs = self._positional(args, kwargs) if kwargs else (args, kwargs)
        if args is None:
            return self.kernel[grid](*call_args, **call_kwargs)
        key = self._key(args, kwargs, device)
        hit = None if key is None else self.compiled.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None:
                tail = tuple(
                    kwargs[n] if n in kwargs else self.defaults[i] for i, n in enumerate(self.names) if i >= len(args)
                )
                self.compiled[key] = (
                    compiled,
                    tail,
                    compiled.run,
                    compiled.function,
                    compiled.packed_metadata,
                    driver.active.get_current_stream,
                )
            return
        compiled, tail, run, function, metadata, stream_of = hit
        grid = _grid3(grid)
        if _hooks_set():
            compiled[grid](*args, *tail)
        else:
            run(grid[0], grid[1], grid[2], stream_of(device), function, metadata, None, None, None, *args, *tail)

    def plan(self, grid, args, kwargs) -> LaunchPlan | None:
        """The compiled launch ``self[grid](*args, **kwargs)`` made (after it ran) as a LaunchPlan,
        or None when that call did not go through this cache."""
        if callable(grid):
            return None
        device = torch.cuda.current_device()
        args, kwargs = self._positional(args, kwargs) if kwargs else (args, kwargs)
        if args is None:
            return None
        key = self._key(args, kwargs, device)
        hit = None if key is None else self.compiled.get(key)
        if hit is None:
            return None
        _, tail, run, function, metadata, stream_of = hit
        slots = [i for i, a in enumerate(args) if isinstance(a, _Tensor) or hasattr(a, "block_shape")]
        fixed = list(args)
        for i in slots:
            fixed[i] = None  # hold no tensor alive (a descriptor holds its tensor)
        return LaunchPlan(run, _grid3(grid), device, stream_of, function, metadata, [*fixed, *tail], slots)


def _grid3(grid):
    return grid if len(grid) == 3 else (*grid, *(1,) * (3 - len(grid)))


def _hooks_set() -> bool:
    return _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)


class LaunchPlan:
    """One compiled launch with every argument fixed but its tensors: ``plan(*tensors)`` relaunches it.

    For an op's eager hot path, keyed by the op on whatever fixes the other arguments (shapes,
    dtypes, eps, ...), so a repeated call skips the launch config and the per-argument cache key.
    The tensors come in the order they appear in the arguments; so do host TMA descriptors, each
    of the dtype, block shape and layout of the one recorded (the op's key fixes them). A call
    returns False and launches
    nothing when the compiled kernel may not be reused as is (a tensor not 16-byte aligned, another
    current device or spec selection, a launch hook set): the op then takes its ordinary path.
    """

    __slots__ = ("run", "grid", "device", "stream_of", "function", "metadata", "args", "slots", "jit_key")

    def __init__(self, run, grid, device, stream_of, function, metadata, args, slots):
        self.run, self.grid, self.device, self.stream_of = run, grid, device, stream_of
        self.function, self.metadata, self.args, self.slots = function, metadata, args, slots
        self.jit_key = selection_key()

    def __call__(self, *tensors) -> bool:
        addresses = 0
        for t in tensors:
            addresses |= t.data_ptr() if isinstance(t, _Tensor) else t.base.data_ptr()
        if (
            addresses & 15
            or self.jit_key != selection_key()
            or torch.cuda.current_device() != self.device
            or _hooks_set()
        ):
            return False
        args = self.args.copy()
        for i, t in zip(self.slots, tensors):
            args[i] = t
        g = self.grid
        self.run(g[0], g[1], g[2], self.stream_of(self.device), self.function, self.metadata, None, None, None, *args)
        return True
