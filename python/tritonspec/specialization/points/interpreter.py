"""Interpreter points (``TRITON_INTERPRET=1``): libdevice served by the backend's numpy functions, and
stock ``tl`` patches that an interpreted grid leaves behind taken back."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import sys
import threading

from .. import inject
from ..resolve import value
from . import InstallPoint, injecting_spec, patch


_LIBDEVICE_MODULES = (
    "triton.language.extra.libdevice",
    "triton.language.extra.cuda.libdevice",
    "triton.language.extra.hip.libdevice",
)


class _GridPatches:
    """The ``tl`` patches of one interpreted grid: its scope, which restores them, and what it holds."""

    def __init__(self):
        self.scope = None  # the grid's own _LangPatchScope, from its first _patch_lang
        self.patched = None  # (id(obj), name) of every attribute the scope restores, once a helper is called


_grids = threading.local()  # .stack: this thread's _GridPatches, innermost last


def _grid_stack() -> list:
    stack = getattr(_grids, "stack", None)
    if stack is None:
        stack = _grids.stack = []
    return stack


class _Capture:
    """A stand-in patch scope that keeps what the interpreter would set."""

    def set_attr(self, obj, name, value):
        self.value = value


_served: dict = {}  # backend libdevice module -> (its namespace when read, the interpreter's builtins)


def _interpreter_builtins(interpreter, lib) -> dict:
    """``lib``'s builtins wrapped as the interpreter wraps tl's, built again only when ``lib`` changes."""
    namespace = vars(lib)
    cached = _served.get(lib)
    try:
        if cached is not None and cached[0] == namespace:  # identical objects compare equal without __eq__
            return cached[1]
    except Exception:  # a changed value whose == does not answer a bool: changed
        pass
    builtins = {}
    for name, member in namespace.items():
        if not name.startswith("_") and interpreter.tl.core.is_builtin(member):
            capture = _Capture()
            interpreter._patch_attr(lib, name, member, interpreter.interpreter_builder, capture)
            builtins[name] = capture.value
    _served[lib] = (dict(namespace), builtins)
    return builtins


_plans: dict = {}  # libdevice module name -> (its namespace, the builtins served, the originals they replace, added)
_MISSING = object()


def _libdevice_plan(mod_name: str, namespace: dict, builtins: dict):
    """What serving ``builtins`` in a libdevice module replaces and adds, kept while the module holds it.

    Checking a kept plan costs a grid about a third less than building one (a few dicts and sets)."""
    plan = _plans.get(mod_name)
    if plan is not None and plan[0] is namespace and plan[1] is builtins:
        originals, added = plan[2], plan[3]
        if all(
            map(operator.is_, map(namespace.get, originals, itertools.repeat(_MISSING)), originals.values())
        ) and namespace.keys().isdisjoint(added):
            return originals, added
    present = namespace.keys() & builtins.keys()
    originals = {name: namespace[name] for name in present}
    added = tuple(builtins.keys() - present)
    _plans[mod_name] = (namespace, builtins, originals, added)
    return originals, added


@contextlib.contextmanager
def _libdevice_served(interpreter):
    """Point the libdevice modules at the backend's numpy builtins (``interpreter_libdevice``), for one grid."""
    lib = value("interpreter_libdevice")
    if lib is None:
        yield
        return
    builtins = _interpreter_builtins(interpreter, lib)
    served = []  # (namespace, the originals to put back, the names to remove)
    try:
        for mod_name in _LIBDEVICE_MODULES:
            mod = sys.modules.get(mod_name)
            if mod is not None and not any(vars(mod) is namespace for namespace, _, _ in served):
                namespace = vars(mod)
                served.append((namespace, *_libdevice_plan(mod_name, namespace, builtins)))
                namespace.update(builtins)
        yield
    finally:
        for namespace, originals, added in served:
            namespace.update(originals)
            for name in added:
                del namespace[name]


def _install_interpreter(interpreter):
    """Serve libdevice calls from the backend's numpy module, and close a stock patch leak.

    Stock Triton re-patches ``tl`` whenever an interpreted kernel calls a ``@jit`` helper (tl.sum,
    tl.zeros, ...) and never restores those patches, so later compiles in the same process see
    interpreter builtins. Here the grid's scope takes each attribute a helper patches that it does not
    hold yet (once: a grid calls helpers thousands of times) and restores it with its own. libdevice is
    served once per grid, for the whole grid.
    """
    orig = interpreter._patch_lang

    @functools.wraps(orig)
    def _patch_lang(fn):
        scope = orig(fn)
        stack = _grid_stack()
        if not stack:  # a helper called outside any grid: stock behaviour
            return scope
        grid = stack[-1]
        if grid.scope is None:  # the grid's own patching
            grid.scope = scope
            return scope
        if grid.patched is None:
            grid.patched = {(id(obj), name) for obj, name, _ in grid.scope._changes}
        for change in scope._changes:
            key = (id(change[0]), change[1])
            if key not in grid.patched:  # its original is the value before the grid
                grid.patched.add(key)
                grid.scope._changes.append(change)
        scope._changes = []
        return scope

    patch(interpreter, "_patch_lang", _patch_lang)

    executor = interpreter.GridExecutor
    orig_call = executor.__call__

    @functools.wraps(orig_call)
    def __call__(self, *args, **kwargs):
        # Interpreted kernels read tl at run time: run each with its thread's injections in place
        # (stock Triton's own patching of tl makes concurrent interpreted runs unsafe anyway).
        with inject.applied(injecting_spec()), _libdevice_served(interpreter):
            stack = _grid_stack()
            grid = _GridPatches()
            stack.append(grid)
            try:
                return orig_call(self, *args, **kwargs)
            finally:
                stack.pop()
                if grid.scope is not None:
                    grid.scope.restore()  # a no-op unless the grid failed before restoring it

    patch(executor, "__call__", __call__)


POINTS = (
    InstallPoint(
        "interpreter.libdevice",
        "triton.runtime.interpreter",
        _install_interpreter,
        doc="interpreter: libdevice calls served by the backend's numpy functions",
    ),
)
