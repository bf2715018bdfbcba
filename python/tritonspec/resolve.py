"""Which backend's spec applies, and the FlagTree-style ``spec`` / ``spec_func`` lookups.

Resolution order:
1. an explicit selection: ``with use_backend(name):`` (innermost wins), else ``TRITONSPEC_BACKEND``;
2. the backend of the compile target, while ``triton.compile`` runs for it (cross-compiling for
   ``hip`` in a CUDA process uses the amd spec);
3. ``cpu`` for interpreted kernels (``TRITON_INTERPRET=1``);
4. the active driver's ``spec`` attribute (FlagTree-compatible), or its target's backend -- only
   when Triton already created the driver: resolving never creates one.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys

from .hooks import Kind, SpecError, get_hook
from .registry import REGISTRY, Provider

# Triton target names (GPUTarget.backend) whose spec backend has another name.
TARGET_TO_BACKEND = {"cuda": "nvidia", "hip": "amd"}

_selected: list[str] = []  # use_backend stack; process-global like the tl injections it drives
_compile_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("tritonspec_compile_target",
                                                                              default=None)
_driver_providers: dict[int, Provider] = {}


class SpecHookError(RuntimeError):
    """A backend's spec function raised; names the backend and the hook."""


def backend_for_target(target_backend: str) -> str:
    return TARGET_TO_BACKEND.get(target_backend, target_backend)


def explicit_backend() -> str | None:
    if _selected:
        return _selected[-1]
    return os.environ.get("TRITONSPEC_BACKEND") or None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _existing_driver():
    """The active Triton driver if one was already created, else None (never creates one)."""
    mod = sys.modules.get("triton.runtime.driver")
    cfg = getattr(mod, "driver", None) if mod else None
    return getattr(cfg, "_active", None) if cfg is not None else None


def current_backend(target_backend: str | None = None) -> str | None:
    """The backend whose spec applies now; ``target_backend`` is a Triton target name ('cuda', 'hip')."""
    chosen = explicit_backend()
    if chosen is not None:
        return chosen
    target_backend = target_backend or _compile_target.get()
    if target_backend is not None:
        return backend_for_target(target_backend)
    if _interpreting():
        return "cpu"
    drv = _existing_driver()
    if drv is not None:
        try:
            return backend_for_target(drv.get_current_target().backend)
        except Exception:  # a driver without a usable device: nothing to specialize for
            return None
    return None


def active_provider(target_backend: str | None = None) -> Provider | None:
    backend = current_backend(target_backend)
    provider = REGISTRY.get(backend)
    if provider is not None:
        return provider
    drv = _existing_driver() if explicit_backend() is None else None
    module = getattr(drv, "spec", None) if drv is not None else None
    if module is not None:  # FlagTree-style driver.spec
        key = id(module)
        if key not in _driver_providers:
            _driver_providers[key] = Provider(backend or type(drv).__name__, module, f"driver {type(drv).__name__}")
        return _driver_providers[key]
    return None


def backend_for_device(device) -> str | None:
    """The backend for tensors on ``device`` (a torch.device or str): explicit selection first."""
    chosen = explicit_backend()
    if chosen is not None:
        return chosen
    dev_type = getattr(device, "type", None) or str(device).split(":")[0]
    if dev_type == "cuda":
        return _cuda_backend()
    return dev_type  # "cpu" (interpreter), "npu", "xpu", ...


@functools.lru_cache(maxsize=None)
def _cuda_backend() -> str:
    import torch
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


# Wrapped spec functions, built once per (backend, hook, function): ops look hooks up on every call,
# and functools.wraps alone costs more than the rest of a lookup. The entry keeps the function alive,
# so its id cannot be reused while cached; dropped on any registry change.
_wrapped: dict = {}
REGISTRY.on_change(_wrapped.clear)


def _wrap(backend: str, name: str, fn):
    if not callable(fn):
        return fn
    key = (backend, name, id(fn))
    hit = _wrapped.get(key)
    if hit is None:
        hit = _wrapped[key] = (fn, _error_naming(backend, name, fn))
    return hit[1]


def _error_naming(backend: str, name: str, fn):
    """``fn`` whose exceptions name the backend and the hook (Triton's compile errors pass through)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecHookError:
            raise
        except Exception as e:
            # Triton's own compile errors pass through unchanged so their source locations survive.
            if type(e).__module__.startswith("triton") and not isinstance(e, (TypeError, ValueError)):
                raise
            raise SpecHookError(f"backend {backend!r} spec hook {name!r} raised {type(e).__name__}: {e}") from e

    return call


def lookup(name: str, backend: str | None = None, target_backend: str | None = None):
    """The specialized object for hook ``name`` (function or value), or None when not specialized.

    Unlike ``spec``, this separates "not specialized" (None) from a specialized falsy result.
    """
    get_hook(name)
    provider = REGISTRY.get(backend) if backend is not None else active_provider(target_backend)
    if provider is None:
        return None
    obj = provider.get(name)
    return None if obj is None else _wrap(provider.backend, name, obj)


def spec_func(name: str):
    """The active backend's function for hook ``name``, or None (FlagTree's ``spec_func``)."""
    obj = lookup(name)
    if obj is not None and not callable(obj):
        return lambda *args, **kwargs: obj
    return obj


def spec(name: str, *args, **kwargs):
    """Call the active backend's specialization of ``name``; None when it does not specialize it.

    A specialized result may itself be falsy (0, False, []): call sites that must tell the two
    apart use ``spec_func(name)`` (None means not specialized) or ``lookup``.
    """
    hook = get_hook(name)
    obj = lookup(name)
    if obj is None:
        return None
    if not callable(obj):
        if hook.kind is Kind.FUNCTION:
            raise SpecError(f"spec hook {name!r} must be a function, got {type(obj).__name__}")
        return obj
    return obj(*args, **kwargs)


@contextlib.contextmanager
def use_backend(name: str):
    """Select ``name``'s spec explicitly for the duration (over compile target and driver)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"use_backend: name must be a non-empty str, got {name!r}")
    if REGISTRY.get(name) is None:
        raise SpecError(f"use_backend: no spec registered for backend {name!r}; "
                        f"known: {', '.join(REGISTRY.names()) or 'none'}")
    _selected.append(name)
    try:
        REGISTRY._changed()
        yield REGISTRY.get(name)
    finally:
        _selected.pop()
        REGISTRY._changed()


@contextlib.contextmanager
def compiling_for(target_backend: str):
    """Mark that a compile for ``target_backend`` is in progress (set by the compile hook)."""
    token = _compile_target.set(target_backend)
    try:
        yield
    finally:
        _compile_target.reset(token)
