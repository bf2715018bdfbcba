"""Launch parameters for tritonspec kernels, asked of the backend that will run them.

Ops never branch on the backend: they pass their own heuristic as ``default`` and the backend's
``kernel_config`` / ``attention_config`` hook may override any of its keys. Eager ops call this on
every launch, so the result is memoized per (hook, kernel, backend, problem) and the memo is
dropped whenever the spec registry or the backend selection changes: a hit is one dict lookup.
"""
from __future__ import annotations

from .registry import REGISTRY
from .resolve import backend_for_device, lookup

_cache: dict = {}
REGISTRY.on_change(_cache.clear)  # also fired by use_backend()


def launch_config(kernel: str, device, default, *, hook: str = "kernel_config", **problem) -> dict:
    """``default`` updated with what the backend for ``device`` specializes for ``kernel``.

    ``problem`` holds hashable facts the choice depends on (sizes, dtype names, ...). ``default`` is
    a dict, or a zero-argument callable building it, called only on a miss (so it may depend on
    nothing but ``problem``). The result is shared between calls: treat it as read-only.
    """
    backend = backend_for_device(device)
    key = (hook, kernel, backend, *problem.items())
    if not callable(default):
        key += tuple(default.items())
    cfg = _cache.get(key)
    if cfg is None:
        base = default() if callable(default) else default
        fn = lookup(hook, backend=backend)
        override = fn(kernel, **problem) if fn is not None else None
        if override is not None and not isinstance(override, dict):
            raise TypeError(f"backend {backend!r} {hook}({kernel!r}) returned {type(override).__name__}, "
                            "expected dict or None")
        cfg = _cache[key] = {**base, **(override or {})}
    return cfg
