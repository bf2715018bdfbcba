"""Launch parameters for tritonspec kernels, asked of the backend that will run them.

Ops never branch on the backend: they pass their own heuristic as ``default`` and the backend's
``kernel_config`` / ``attention_config`` hook may override any of its keys. Results are memoized per
(hook, kernel, backend, problem) and dropped whenever the spec registry or selection changes, so the
per-call cost is one dict lookup.
"""
from __future__ import annotations

from .registry import REGISTRY
from .resolve import backend_for_device, lookup

_cache: dict = {}
REGISTRY.on_change(_cache.clear)


def launch_config(kernel: str, device, default: dict, *, hook: str = "kernel_config", **problem) -> dict:
    """``default`` updated with what the backend for ``device`` specializes for ``kernel``.

    ``problem`` holds hashable facts the choice depends on (sizes, dtype names, ...).
    """
    backend = backend_for_device(device)
    key = (hook, kernel, backend, tuple(sorted(problem.items())), tuple(sorted(default.items())))
    cfg = _cache.get(key)
    if cfg is None:
        fn = lookup(hook, backend=backend)
        override = fn(kernel, **problem) if fn is not None else None
        if override is not None and not isinstance(override, dict):
            raise TypeError(f"backend {backend!r} {hook}({kernel!r}) returned {type(override).__name__}, "
                            "expected dict or None")
        cfg = {**default, **(override or {})}
        _cache[key] = cfg
    return dict(cfg)
