"""FlagTree's injectors: put a backend's builtins into tl, tl.core, tl.math, tl.standard.

``spec_core_func(spec)`` and friends keep FlagTree's names and list names, with two changes:
a name in a ``*_ext_spec_func_list`` that already exists in mainline is an error (only a
``*_ext_base_func_list`` may replace a mainline name), and every injection is recorded so
``restore()`` puts back the exact original objects.

Injected names live in Triton's modules, which every thread shares, while spec selection is per
thread. So the code that reads them, a kernel's code generation and an interpreted run, holds
``applied(spec)``: the lock, with that spec's injections in place. Outside kernels, ``tl`` shows the
injections of the most recent selection change in any thread.
"""

from __future__ import annotations

import contextlib
import threading
import types

from .hooks import LIST_NAMES, SEMANTIC_PREFIX, SpecError
from .patches import PatchLog

_lock = threading.RLock()
_applied = PatchLog()
_applied_spec = None  # the spec module whose injections are in place


def _targets(group: str, replace: bool):
    import triton.language as tl
    from triton.language import core, math, semantic, standard

    if group == "core":
        return [tl, core]
    if group == "math":
        return [tl, math] if replace else [math]
    if group == "standard":
        return [tl, standard]
    if group == "semantic":
        return [semantic.TritonSemantic]
    raise ValueError(group)


def _inject(spec, group: str) -> None:
    for list_name, replace in ((f"{group}_ext_base_func_list", True), (f"{group}_ext_spec_func_list", False)):
        for name in getattr(spec, list_name, ()) or ():
            attr = SEMANTIC_PREFIX + name if group == "semantic" else name
            func = getattr(spec, attr, None)
            if func is None:
                raise SpecError(f"{spec.__name__}.{list_name} names {name!r} but the module defines no {attr!r}")
            targets = _targets(group, replace)
            primary = targets[-1]
            if replace and not hasattr(primary, name):
                raise SpecError(
                    f"{spec.__name__}.{list_name}: {name!r} does not exist in {_where(primary)}; "
                    f"new names go in {group}_ext_spec_func_list"
                )
            for ns in targets:
                if hasattr(ns, name) and not replace and not _applied.touched(ns, name):
                    raise SpecError(
                        f"{spec.__name__}.{list_name}: {name!r} already exists in {_where(ns)}; list it "
                        f"in {group}_ext_base_func_list to replace the mainline one"
                    )
                with _lock:
                    _applied.set(ns, name, func)


def _where(ns) -> str:
    return getattr(ns, "__name__", str(ns))


def spec_core_func(spec) -> None:
    """``core_ext_*_func_list`` -> ``triton.language`` and ``triton.language.core``."""
    _inject(spec, "core")


def spec_semantic_func(spec) -> None:
    """``semantic_ext_*_func_list`` -> methods of ``TritonSemantic`` (from ``ext_semantic_<name>``)."""
    _inject(spec, "semantic")


def spec_standard_func(spec) -> None:
    """``standard_ext_*_func_list`` -> ``triton.language`` and ``triton.language.standard``."""
    _inject(spec, "standard")


def spec_math_func(spec) -> None:
    """``math_ext_base_func_list`` -> ``tl`` and ``tl.math`` (replacing); ``math_ext_spec_func_list`` -> ``tl.math``."""
    _inject(spec, "math")


INJECTORS = (spec_core_func, spec_semantic_func, spec_standard_func, spec_math_func)


def has_injections(spec) -> bool:
    """Whether ``spec`` fills an injector list; asked on every interpreted launch, so a module that
    names none is answered from its namespace (a failed ``getattr`` on a module costs microseconds)."""
    if spec is None:
        return False
    if isinstance(spec, types.ModuleType) and "__getattr__" not in vars(spec) and LIST_NAMES.isdisjoint(vars(spec)):
        return False
    return any(getattr(spec, n, None) for n in LIST_NAMES)


def restore() -> None:
    """Undo every injection, newest first, restoring the original objects (or absence)."""
    global _applied_spec
    with _lock:
        _applied.undo()
        _applied_spec = None


def apply(spec) -> None:
    """Make ``spec``'s injections (or none, for None) the ones in place."""
    global _applied_spec
    with _lock:
        if spec is _applied_spec:
            return
        restore()
        if has_injections(spec):
            try:
                for injector in INJECTORS:
                    injector(spec)
            except Exception:
                restore()
                raise
            _applied_spec = spec


@contextlib.contextmanager
def applied(spec):
    """Hold the injection lock with ``spec``'s injections (None: none) in place; then put back what was."""
    with _lock:
        previous = _applied_spec
        apply(spec)
        try:
            yield
        finally:
            apply(previous)
