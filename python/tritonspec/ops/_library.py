"""How tritonspec ops become PyTorch custom operators, and when eager calls skip the dispatcher.

* ``torch.library.triton_op`` + ``wrap_triton`` keep the Triton kernels visible to Inductor, but
  they cannot trace interpreted kernels: with ``TRITON_INTERPRET=1`` (torch 2.13, triton 3.6 and
  3.9) fake-tensor tracing reaches the interpreter, which reads data pointers and fails. There the
  ops are opaque ``torch.library.custom_op``s with the same schema, fake and autograd.
* A torch.library call costs tens of microseconds of dispatch (quack measured ~60 us against a
  ~10 us kernel), so eager calls go straight to the launcher through a ``torch.autograd.Function``;
  only code that torch.compile traces uses the registered ops (``use_library_op``).
"""
from __future__ import annotations

import os

import torch

from ..launch import launch_config
from ..registry import REGISTRY
from ._device import interpreting
from ._launch_cache import CachedLauncher

NAMESPACE = "tritonspec"

# Chosen once, like ``@triton.jit`` chooses JIT vs interpreter when the kernels are defined.
USE_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not interpreting()

# Eager CUDA launches reuse the compiled kernel without Triton's per-call binding (_launch_cache).
USE_CACHED_LAUNCH = os.environ.get("TRITONSPEC_CACHED_LAUNCH", "1") == "1"
_cached_launchers: dict = {}

# Tests set this to run eager calls through the registered ops as torch.compile would.
FORCE_LIBRARY_OP = False


def library_op(name: str, *, mutates_args=()):
    """Decorator registering ``tritonspec::<name>`` as a triton_op (compiled Triton) or custom_op."""
    qualname = f"{NAMESPACE}::{name}"
    if USE_TRITON_OP:
        return torch.library.triton_op(qualname, mutates_args=mutates_args)
    return torch.library.custom_op(qualname, mutates_args=mutates_args)


def launcher(kernel, traced: bool):
    """The object to index with a grid: ``wrap_triton(kernel)`` inside a triton_op body, else the kernel.

    ``wrap_triton`` outside a triton_op would send eager launches through a higher-order op (~1 ms).
    """
    if traced and USE_TRITON_OP:
        return torch.library.wrap_triton(kernel)
    if interpreting() or not USE_CACHED_LAUNCH:
        return kernel
    cached = _cached_launchers.get(id(kernel))  # not hash(kernel): JITFunction hashes its source
    if cached is None:
        cached = _cached_launchers[id(kernel)] = CachedLauncher(kernel)
    return cached


class PlanCache(dict):
    """An op's eager LaunchPlans by the op's key. Dropped, like launch_config's memo, when the spec
    registry or the backend selection changes; bounded, since variable-length batches add one plan
    per shape (when full it starts over: a miss costs one ordinary launch)."""

    LIMIT = 512

    def __init__(self):
        super().__init__()
        REGISTRY.on_change(self.clear)

    def __setitem__(self, key, plan):
        if len(self) >= self.LIMIT and key not in self:
            self.clear()
        super().__setitem__(key, plan)


def launch(kernel, grid, args: tuple, kwargs: dict, *, traced: bool = False, plan: bool = False):
    """``launcher(kernel, traced)[grid](*args, **kwargs)``; with ``plan=True`` (eager calls) also
    returns the LaunchPlan that relaunches this compiled call, or None where there is none."""
    runner = launcher(kernel, traced)
    runner[grid](*args, **kwargs)
    if plan and isinstance(runner, CachedLauncher):
        return runner.plan(grid, args, kwargs)
    return None


def use_library_op() -> bool:
    """True while torch.compile traces (or a test forces it): call the ops, not the raw launchers."""
    return FORCE_LIBRARY_OP or torch.compiler.is_compiling()


def launch_options(cfg: dict) -> dict:
    """The launch keywords (num_warps, num_stages) a config carries; the rest are kernel constexprs."""
    return {k: cfg[k] for k in ("num_warps", "num_stages") if cfg.get(k) is not None}


# Host-side grid arithmetic. triton.cdiv / triton.next_power_of_2 are constexpr functions in
# triton 3.9 that unwrap their arguments on every host call (~5 us each on a slow host CPU), and
# eager launches of these memory-bound kernels are host-bound at Llama shapes.
def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def kernel_config(kernel: str, device, default_fn, **problem) -> tuple[dict, dict]:
    """``(config, launch keywords)`` for a kernel; ``default_fn()`` runs only on a cache miss."""
    cfg = launch_config(kernel, device, default_fn, **problem)
    return cfg, launch_options(cfg)
