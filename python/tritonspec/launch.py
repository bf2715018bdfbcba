"""Launch parameters for tritonspec kernels, asked of the backend that will run them.

Ops never branch on the backend: they pass their own heuristic as ``default`` and the backend's
``kernel_config`` / ``attention_config`` hook may override any of its keys. An override is checked
against the default before use: a key the kernel does not have, a bool where an int belongs, a
block size that is not a power of two or a count below 1 is a ``LaunchConfigError`` naming the
backend, the hook, the kernel and the key (not a ZeroDivisionError or an interpreter error later).

Eager ops call this on every launch, so the result is memoized per (hook, kernel, backend, device,
problem) and the memo is dropped whenever the spec registry changes: a hit is one dict lookup. The
device is part of the key because one host may hold GPUs of two generations.
"""
from __future__ import annotations

from .hooks import SpecContractError, suggest
from .registry import REGISTRY
from .resolve import backend_for_device, lookup

LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")  # keys every config may set, besides the kernel's own

_cache: dict = {}
REGISTRY.on_change(_cache.clear)


class LaunchConfigError(SpecContractError):
    """A backend's launch config that the kernel cannot run; names backend, hook, kernel and key."""


def _with_index(device):
    """``device`` as a torch.device with its index ("cuda" is the current CUDA device, if any)."""
    import torch
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        try:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        except Exception:  # no such device here (configs asked for offline): keep it without an index
            pass
    return device


def launch_config(kernel: str, device, default, *, hook: str = "kernel_config", **problem) -> dict:
    """``default`` updated with what the backend for ``device`` specializes for ``kernel``.

    ``problem`` holds hashable facts the choice depends on (sizes, dtype names, ...); the hook also
    gets ``device`` (a torch.device with its index). ``default`` is a dict, or a zero-argument
    callable building it, called only on a miss (so it may depend on nothing but ``problem``). The
    result is shared between calls: treat it as read-only.
    """
    if type(device) is str or device.index is None:  # tensors' devices have their index: not the hot path
        device = _with_index(device)
    backend = backend_for_device(device)
    key = (hook, kernel, backend, device, *problem.items())
    if not callable(default):
        key += tuple(default.items())
    cfg = _cache.get(key)
    if cfg is None:
        base = default() if callable(default) else default
        fn = lookup(hook, backend=backend)
        override = fn(kernel, device=device, **problem) if fn is not None else None
        if override:
            check_override(backend, hook, kernel, base, override)
        cfg = _cache[key] = {**base, **(override or {})}
    return cfg


def check_override(backend: str, hook: str, kernel: str, default: dict, override: dict) -> None:
    """Raise LaunchConfigError unless every key of ``override`` is one ``kernel`` can take."""
    where = f"backend {backend!r} {hook}({kernel!r})"
    known = list(default) + [k for k in LAUNCH_OPTIONS if k not in default]
    for name, val in override.items():
        if name not in known:
            raise LaunchConfigError(f"{where} returned unknown key {name!r}{suggest(str(name), known)}; "
                                    f"{kernel!r} takes {', '.join(known)}")
        base = default.get(name)
        if isinstance(base, bool):
            if not isinstance(val, bool):
                raise LaunchConfigError(f"{where}: {name}={val!r} must be a bool, not {type(val).__name__}")
            continue
        if isinstance(val, bool) or not isinstance(val, int):
            raise LaunchConfigError(f"{where}: {name}={val!r} must be an int, not {type(val).__name__}")
        if val < 1:
            raise LaunchConfigError(f"{where}: {name}={val} must be >= 1")
        if (name.startswith("BLOCK") or name == "num_warps") and val & (val - 1):
            raise LaunchConfigError(f"{where}: {name}={val} must be a power of two")
