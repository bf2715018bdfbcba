"""Which backend's spec applies, and the FlagTree-style ``spec`` / ``spec_func`` lookups.

Resolution order:
1. an explicit selection: ``with use_backend(name):`` in this thread or async task (innermost
   wins), else the process-wide default (``set_default_backend``; initially ``TRITONSPEC_DEFAULT_BACKEND``);
2. the backend of the compile target, while ``triton.compile`` runs for it (cross-compiling for
   ``hip`` in a CUDA process uses the amd spec);
3. the backend serving device type ``cpu`` for interpreted kernels (``TRITON_INTERPRET=1``);
4. the active driver's ``spec`` attribute (FlagTree-compatible), or its target's backend -- only
   when Triton already created the driver: resolving never creates one.

Which backend a compile target or a torch device type belongs to is read from the backends' own
declarations (``BackendInfo``), never spelled here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import warnings

from .. import devices, settings
from .hooks import Kind, SpecError, get_hook
from .providers import PROVIDERS, Provider

# use_backend's stack, per thread and per async task: a selection never leaks into another thread.
_selection: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("tritonspec_selection", default=())
_default: str | None = settings.DEFAULT_BACKEND.get()  # the process-wide default selection
_compile_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("tritonspec_compile_target", default=None)
_driver_providers: dict[int, Provider] = {}
_selection_listeners: list = []


class SpecHookError(RuntimeError):
    """A backend's spec function raised; names the backend and the hook."""


# -- selection ------------------------------------------------------------------------------------


def explicit_backend() -> str | None:
    """The backend selected in this thread / task, else the process-wide default, else None."""
    stack = _selection.get()
    return stack[-1] if stack else _default


def default_backend() -> str | None:
    return _default


def set_default_backend(name: str | None) -> None:
    """Select ``name``'s spec process-wide (None: no default), below any ``use_backend`` in scope."""
    global _default
    if name is not None:
        _check_selectable("set_default_backend", name)
    _default = name
    _selection_changed()


def selection_key() -> tuple:
    """What compiled kernels depend on besides their arguments: the explicit selection and the
    registrations. In-memory kernel caches are kept per key (one contextvar read: launches use it)."""
    stack = _selection.get()
    return (stack[-1] if stack else _default, PROVIDERS.generation)


def selection() -> tuple[str, ...]:
    """This thread's (or task's) ``use_backend`` stack, to carry into work done elsewhere."""
    return _selection.get()


@contextlib.contextmanager
def selected(stack: tuple[str, ...]):
    """Run with ``stack`` (from ``selection()``) as the selection: an op's backward runs on autograd's
    device thread for CUDA tensors, and must see the spec its forward saw."""
    if stack == _selection.get():
        yield
        return
    token = _selection.set(stack)
    try:
        yield
    finally:
        _selection.reset(token)


def on_selection_change(fn) -> None:
    """Call ``fn()`` whenever a thread changes its selection or the process default changes."""
    if fn not in _selection_listeners:
        _selection_listeners.append(fn)


def _selection_changed() -> None:
    for fn in list(_selection_listeners):
        fn()


def _check_selectable(caller: str, name) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{caller}: name must be a non-empty str, got {name!r}")
    if PROVIDERS.get(name) is None:
        installed = PROVIDERS.entry_points().get(name, [])
        if installed:
            raise SpecError(
                f"{caller}: backend {name!r} (entry point of {installed[0].label}) is not allowed by "
                f"{settings.ALLOWED_BACKENDS.shown()}"
            )
        selectable = [
            n
            for n in PROVIDERS.names()
            if PROVIDERS.conflict(n) or PROVIDERS.candidates(n) or n in PROVIDERS._registered
        ]
        raise SpecError(f"{caller}: no spec registered for backend {name!r}; known: {', '.join(selectable) or 'none'}")


@contextlib.contextmanager
def use_backend(name: str):
    """Select ``name``'s spec for the duration, in this thread or async task only."""
    _check_selectable("use_backend", name)
    token = _selection.set(_selection.get() + (name,))
    try:
        _selection_changed()
        yield PROVIDERS.get(name)
    finally:
        _selection.reset(token)
        _selection_changed()


@contextlib.contextmanager
def compiling_for(target_backend: str):
    """Mark that a compile for ``target_backend`` is in progress (set by the compile hook)."""
    token = _compile_target.set(target_backend)
    try:
        yield
    finally:
        _compile_target.reset(token)


# -- backend identity: read from the providers' BackendInfo ----------------------------------------

_claims: dict = {}  # generation -> (target -> backends, device type -> backends)


def _claimed():
    key = PROVIDERS.generation
    found = _claims.get(key)
    if found is None:
        targets: dict[str, list[str]] = {}
        devices: dict[str, list[str]] = {}
        for name, provider in _loadable_providers().items():
            for t in provider.info.targets:
                targets.setdefault(t, []).append(name)
            for d in provider.info.devices:
                devices.setdefault(d, []).append(name)
        _claims.clear()
        found = _claims[key] = (targets, devices)
    return found


def _loadable_providers() -> dict[str, Provider]:
    """Every allowed provider that loads; one that fails to is left out with a warning (it fails again,
    with its error, where it is used by name, and in ``tritonspec check``)."""
    found = {}
    for name in PROVIDERS.names():
        try:
            provider = None if PROVIDERS.conflict(name) else PROVIDERS.get(name)
        except Exception as e:  # a broken provider must not take every other backend down with it
            warnings.warn(
                f"tritonspec: spec provider {name!r} failed to load ({type(e).__name__}: {e}); "
                "its compile targets and device types are ignored",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        if provider is not None:
            found[name] = provider
    return found


def backend_for_target(target_backend: str) -> str:
    """The backend whose spec declares Triton target ``target_backend`` (its own name if none does)."""
    claimants = _claimed()[0].get(target_backend)
    if not claimants:
        return target_backend
    if len(claimants) > 1:
        raise SpecError(
            f"Triton target {target_backend!r} is claimed by backends {', '.join(claimants)}; "
            f"keep one with {settings.ALLOWED_BACKENDS.name}"
        )
    return claimants[0]


def _torch_target(device_type: str) -> str | None:
    """The Triton target torch's build gives a device type: ``cuda`` tensors are ``hip`` on ROCm."""
    if device_type != "cuda":
        return None
    import torch

    return "hip" if getattr(torch.version, "hip", None) else "cuda"


_device_backends: dict = {}  # (generation, device type) -> backend; one dict hit on the ops' path


def _backend_of_device_type(device_type: str) -> str:
    key = (PROVIDERS.generation, device_type)
    hit = _device_backends.get(key)
    if hit is None:
        claimants = _claimed()[1].get(device_type, [])
        if len(claimants) > 1:
            target = _torch_target(device_type)
            by_target = [b for b in claimants if target in PROVIDERS.get(b).info.targets]
            if len(by_target) != 1:
                raise SpecError(
                    f"device type {device_type!r} is claimed by backends {', '.join(claimants)}; "
                    f"keep one with {settings.ALLOWED_BACKENDS.name}"
                )
            claimants = by_target
        hit = claimants[0] if claimants else device_type
        if len(_device_backends) > 64:
            _device_backends.clear()
        _device_backends[key] = hit
    return hit


def backend_for_device(device) -> str:
    """The backend for tensors on ``device`` (a torch.device or str): explicit selection first."""
    chosen = explicit_backend()
    if chosen is not None:
        return chosen
    dev_type = getattr(device, "type", None) or str(device).split(":")[0]
    return _backend_of_device_type(dev_type)


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
    if devices.interpreting():
        return _backend_of_device_type("cpu")
    drv = _existing_driver()
    if drv is not None:
        try:
            target = drv.get_current_target().backend
        except Exception:  # a driver without a usable device: nothing to specialize for
            return None
        return backend_for_target(target)
    return None


def active_provider(target_backend: str | None = None) -> Provider | None:
    backend = current_backend(target_backend)
    provider = PROVIDERS.get(backend)
    if provider is not None:
        return provider
    drv = _existing_driver() if explicit_backend() is None else None
    module = getattr(drv, "spec", None) if drv is not None else None
    if module is not None:  # FlagTree-style driver.spec
        key = id(module)
        if key not in _driver_providers:
            _driver_providers[key] = Provider(
                backend or type(drv).__name__, module, None, f"driver {type(drv).__name__}"
            )
        return _driver_providers[key]
    return None


# -- lookups ----------------------------------------------------------------------------------------

# Wrapped spec functions, built once per (backend, hook, function): ops look hooks up on every call,
# and functools.wraps alone costs more than the rest of a lookup. The entry keeps the function alive,
# so its id cannot be reused while cached; dropped on any registry change.
_wrapped: dict = {}
PROVIDERS.on_change(_wrapped.clear)


def _wrap(backend: str, name: str, fn):
    if not callable(fn) or get_hook(name).kind is not Kind.FUNCTION:
        return fn
    key = (backend, name, id(fn))
    hit = _wrapped.get(key)
    if hit is None:
        hit = _wrapped[key] = (fn, _checked_call(backend, name, fn))
    return hit[1]


def _checked_call(backend: str, name: str, fn):
    """``fn`` whose exceptions name the backend and the hook, and whose results keep the hook's contract
    (Triton's own compile errors pass through)."""
    hook = get_hook(name)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except (SpecHookError, SpecError):
            raise
        except Exception as e:
            # Triton's own compile errors pass through unchanged so their source locations survive.
            if type(e).__module__.startswith("triton") and not isinstance(e, (TypeError, ValueError)):
                raise
            raise SpecHookError(f"backend {backend!r} spec hook {name!r} raised {type(e).__name__}: {e}") from e
        error = hook.value_error(backend, result)
        if error is not None:
            raise error
        return result

    return call


def _provider_for(backend: str | None, target_backend: str | None) -> Provider | None:
    return PROVIDERS.get(backend) if backend is not None else active_provider(target_backend)


def lookup(name: str, backend: str | None = None, target_backend: str | None = None):
    """The specialized object for hook ``name`` (function or value), or None when not specialized.

    Functions come back wrapped: errors name backend and hook, results are checked against the
    hook's contract. Unlike ``spec``, this separates "not specialized" (None) from a falsy result.
    """
    get_hook(name)
    provider = _provider_for(backend, target_backend)
    if provider is None:
        return None
    obj = provider.get(name)
    return None if obj is None else _wrap(provider.backend, name, obj)


def value(name: str, backend: str | None = None, target_backend: str | None = None):
    """A VALUE or PREDICATE hook's value (a zero-argument spec function is called), checked against
    its contract; None when not specialized."""
    hook = get_hook(name)
    if hook.kind is Kind.FUNCTION:
        raise SpecError(f"hook {name!r} is a function hook: use lookup() or spec_func()")
    provider = _provider_for(backend, target_backend)
    obj = provider.get(name) if provider is not None else None
    if obj is None:
        return None
    if callable(obj):
        try:
            obj = obj()
        except Exception as e:
            raise SpecHookError(
                f"backend {provider.backend!r} spec hook {name!r} raised {type(e).__name__}: {e}"
            ) from e
    error = hook.value_error(provider.backend, obj)
    if error is not None:
        raise error
    return obj


def spec_func(name: str):
    """The active backend's function for hook ``name``, or None (FlagTree's ``spec_func``)."""
    if get_hook(name).kind is not Kind.FUNCTION:
        if lookup(name) is None:
            return None
        return lambda *args, **kwargs: value(name)
    return lookup(name)


def spec(name: str, *args, **kwargs):
    """Call the active backend's specialization of ``name``; None when it does not specialize it.

    A specialized result may itself be falsy (0, False, []): call sites that must tell the two
    apart use ``spec_func(name)`` (None means not specialized) or ``lookup``.
    """
    hook = get_hook(name)
    if hook.kind is not Kind.FUNCTION:
        return value(name)
    fn = lookup(name)
    return None if fn is None else fn(*args, **kwargs)
