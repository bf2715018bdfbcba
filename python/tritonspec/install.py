"""Hook points: where the declared hooks are installed into the stock ``triton`` package.

Each ``InstallPoint`` names the Triton module it patches, the Triton versions it applies to, and an
install function that records every original it replaces, so ``deactivate()`` restores stock
Triton exactly. Points are installed when their module finishes importing (a post-import hook),
which makes activation safe from inside ``import triton`` (our backends' entry points run during
Triton's backend discovery). Upgrading Triton means re-validating this table: ``tritonspec check``
reports every point that could not apply instead of failing the import.

All hooks act at compile (trace) time or on compile-cache misses. Per launch there is one thing:
a JIT function's in-memory cache is looked up under the current spec selection (one contextvar read).
"""
from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import importlib.abc
import itertools
import operator
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from . import inject
from .hooks import HOOKS, SpecError
from .patches import PatchLog
from .registry import REGISTRY
from .resolve import (active_provider, compiling_for, current_backend, lookup, on_selection_change,
                      selection_key, value)

_lock = threading.RLock()
_patches = PatchLog()
_patch = _patches.set
_active = False


def _version() -> tuple[int, int]:
    import triton
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


# --------------------------------------------------------------------------------------------
# language semantics: TritonSemantic methods (the interpreter uses the same class)
# --------------------------------------------------------------------------------------------

def _install_atomic_add(semantic):
    cls = semantic.TritonSemantic
    orig = cls.atomic_add

    @functools.wraps(orig)
    def atomic_add(self, ptr, val, mask, sem, scope):
        fn = lookup("atomic_add_int64")
        if fn is not None:
            elt = getattr(getattr(ptr, "type", None), "scalar", None)
            elt = getattr(elt, "element_ty", None)
            if elt is not None and elt.is_int() and elt.primitive_bitwidth == 64:
                return fn(self, ptr, val, mask, sem, scope)
        return orig(self, ptr, val, mask, sem, scope)

    _patch(cls, "atomic_add", atomic_add)


def _install_atomic_bf16(semantic):
    cls = semantic.TritonSemantic
    orig = cls.atom_red_typechecking_impl

    @functools.wraps(orig)
    def atom_red_typechecking_impl(self, ptr, val, mask, op):
        ptr, val, mask = orig(self, ptr, val, mask, op)
        if ptr.type.scalar.element_ty.is_bf16() and value("atomic_disable_bf16"):
            raise ValueError(f"atomic_{op} on bfloat16 is not supported by backend {current_backend()!r}; "
                             "accumulate in float32 instead")
        return ptr, val, mask

    _patch(cls, "atom_red_typechecking_impl", atom_red_typechecking_impl)


def _install_arange(language):
    """The power-of-two rule lives in TritonSemantic.arange and in block-shape validation (core)."""
    from triton.language import core, semantic
    cls = semantic.TritonSemantic
    orig_arange, orig_validate = cls.arange, core.validate_block_shape
    tl = semantic.tl

    def lifted() -> bool:
        return bool(value("arange_disable_check_power_of_two"))

    @functools.wraps(orig_arange)
    def arange(self, start, end, *, ret_ty=None):
        n = end - start if isinstance(start, int) and isinstance(end, int) else 0
        if n > 0 and n & (n - 1) and lifted():
            if type(self.builder).__name__ != "InterpreterBuilder":
                hook = HOOKS["arange_disable_check_power_of_two"]
                raise SpecError(f"tl.arange({start}, {end}): backend {current_backend()!r} specializes "
                                f"{hook.name!r}, which applies to interpreted kernels only: {hook.interpreter_only}")
            if (start >> 32) or (end >> 32):  # the stock checks other than the power of two still hold
                raise ValueError("arange must fit in int32")
            ret_ty = ret_ty or tl.block_type(tl.int32, [n])
            make = getattr(self, "make_tensor", None) or self.tensor  # make_tensor arrived after 3.6
            return make(self.builder.create_make_range(ret_ty.to_ir(self.builder), start, end), ret_ty)
        return orig_arange(self, start, end, ret_ty=ret_ty)

    @functools.wraps(orig_validate)
    def validate_block_shape(shape):
        try:  # every block type built goes through here: a shape stock Triton accepts costs one call
            return orig_validate(shape)
        except ValueError:
            if not (any(isinstance(d, int) and d > 0 and d & (d - 1) for d in shape) and lifted()):
                raise
        from triton._utils import TRITON_MAX_TENSOR_NUMEL
        numel = 1
        for d in shape:
            numel *= d
        if numel > TRITON_MAX_TENSOR_NUMEL:
            raise ValueError(f"numel ({numel}) exceeds triton maximum tensor numel ({TRITON_MAX_TENSOR_NUMEL})")
        return numel

    _patch(cls, "arange", arange)
    _patch(core, "validate_block_shape", validate_block_shape)


def _install_cache_modifier(language):
    """Extra load cache modifiers, mapped by the spec onto an ``ir.CACHE_MODIFIER``.

    Triton <= 3.8 converts the string in TritonSemantic._str_to_load_cache_modifier; 3.9 validates it
    in core._CachePolicy and hands the builder a name, so the spec's result is translated to that name.
    """
    from triton.language import core, semantic
    policy = getattr(core, "_CachePolicy", None)
    if policy is None:
        cls = semantic.TritonSemantic
        orig = cls._str_to_load_cache_modifier

        @functools.wraps(orig)
        def _str_to_load_cache_modifier(self, cache_modifier):
            fn = lookup("ext_str_to_load_cache_modifier") if cache_modifier else None
            result = fn(cache_modifier) if fn is not None else None
            return orig(self, cache_modifier) if result is None else result

        _patch(cls, "_str_to_load_cache_modifier", _str_to_load_cache_modifier)
        return
    orig_post_init = policy.__post_init__

    @functools.wraps(orig_post_init)
    def __post_init__(self):
        cm = core._unwrap_if_constexpr(self.cache_modifier)
        if isinstance(cm, str) and cm.removeprefix(".") not in _STOCK_MODIFIERS:
            fn = lookup("ext_str_to_load_cache_modifier")
            result = fn("." + cm.removeprefix(".")) if fn is not None else None
            if result is not None:
                object.__setattr__(self, "cache_modifier", result.name.lower())
        orig_post_init(self)

    _patch(policy, "__post_init__", __post_init__)


_STOCK_MODIFIERS = {"", "none", "ca", "cg", "wb", "cs", "wt", "cv"}


# --------------------------------------------------------------------------------------------
# compiler: compile() entry, stage pipeline, options
# --------------------------------------------------------------------------------------------

def _install_compile(compiler_pkg):
    """Wrap ``triton.compile``: resolve the target's spec and key the cache by it; code generation
    (``ASTSource.make_ir``) runs with that spec's tl injections in place."""
    from triton.compiler import compiler as compiler_mod
    orig = compiler_mod.compile

    @functools.wraps(orig)
    def compile(src, target=None, options=None, _env_vars=None):
        if target is None:
            from triton.runtime.driver import driver
            target = driver.active.get_current_target()
        with compiling_for(target.backend):
            provider = active_provider()
            if provider is not None:
                if _env_vars is None:
                    _env_vars = compiler_mod.get_cache_invalidating_env_vars()
                _env_vars = {**_env_vars, "TRITONSPEC_SPEC": f"{provider.backend}:{provider.fingerprint}:{_self_key()}"}
            return orig(src, target=target, options=options, _env_vars=_env_vars)

    ast_source = compiler_mod.ASTSource
    orig_make_ir = ast_source.make_ir

    @functools.wraps(orig_make_ir)
    def make_ir(self, *args, **kwargs):
        with inject.applied(_injecting_spec()):
            return orig_make_ir(self, *args, **kwargs)

    _patch(compiler_mod, "compile", compile)
    _patch(compiler_pkg, "compile", compile)
    _patch(ast_source, "make_ir", make_ir)
    top = sys.modules.get("triton")
    if top is not None:  # mid-import, triton/__init__ copies triton.compiler.compile a moment later
        _patch(top, "compile", compile, original=orig)


def _injecting_spec():
    """The spec module whose tl injections code running now must see (None: stock tl)."""
    provider = active_provider()
    return provider.module if provider is not None and inject.has_injections(provider.module) else None


@functools.lru_cache(maxsize=None)
def _self_key() -> str:
    """Digest of the layer's own code: a changed hook installation must not reuse old binaries."""
    import hashlib
    import pathlib
    h = hashlib.sha256()
    for name in ("hooks.py", "registry.py", "resolve.py", "inject.py", "install.py", "fingerprint.py", "patches.py"):
        h.update((pathlib.Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:12]


def _stages_hook(previous):

    def hook(*args):
        if not args:
            # Triton >= 3.7 asks for a cache-key contribution, on every launch. The spec is already
            # in the compile key (TRITONSPEC_SPEC) and in-memory caches are kept per selection
            # (SelectionCaches), so this adds nothing per launch but a constant.
            key, digest = previous() if previous is not None else ("", "")
            return key + "-tritonspec", digest
        backend, stages, options, language, capability = args
        if previous is not None:
            previous(*args)
        fn = lookup("pipeline_stages", target_backend=backend.target.backend)
        if fn is not None:
            fn(backend, stages, options, language, capability)

    hook.__tritonspec__ = True
    return hook


def _install_stages(knobs):
    _patch(knobs.runtime, "add_stages_inspection_hook", _stages_hook(knobs.runtime.add_stages_inspection_hook))


def _install_parse_options(backends_mod):
    """Clamp ``num_stages`` to the spec's ``num_stages_cap`` where options are parsed (per compile)."""
    for backend in backends_mod.backends.values():
        cls = backend.compiler
        orig = cls.parse_options

        def parse_options(self, opts, _orig=orig):
            options = _orig(self, opts)
            cap = value("num_stages_cap", target_backend=self.target.backend)
            if cap is not None and getattr(options, "num_stages", 0) > cap:
                options = dataclasses.replace(options, num_stages=int(cap))
            return options

        _patch(cls, "parse_options", functools.wraps(orig)(parse_options))


# --------------------------------------------------------------------------------------------
# runtime: autotuner pruning, do_bench, host compiler, JIT cache separation, driver spec API
# --------------------------------------------------------------------------------------------

def _install_autotuner(autotuner):
    cls = autotuner.Autotuner
    orig = cls.prune_configs

    @functools.wraps(orig)
    def prune_configs(self, kwargs, *args, **kw):
        configs = orig(self, kwargs, *args, **kw)
        fn = lookup("get_pruned_configs")
        if fn is not None:
            configs = fn(list(configs), {**self.nargs, **kwargs})
            if not configs:
                raise SpecError(f"backend {current_backend()!r} get_pruned_configs returned no configs")
        return configs

    _patch(cls, "prune_configs", prune_configs)


def _install_do_bench(testing):
    orig = testing.do_bench

    @functools.wraps(orig)
    def do_bench(*args, **kwargs):
        fn = lookup("do_bench")
        return (fn or orig)(*args, **kwargs)

    _patch(testing, "do_bench", do_bench)


def _install_get_cc(build):
    if hasattr(build, "_find_compiler"):  # triton >= 3.7
        orig = build._find_compiler

        @functools.wraps(orig)
        def _find_compiler(language, *args, **kwargs):
            fn = lookup("get_cc") if language == "c" and "CC" not in os.environ else None
            return (fn() if fn is not None else None) or orig(language, *args, **kwargs)

        _patch(build, "_find_compiler", _find_compiler)
        return
    orig = build._build  # triton 3.6 picks $CC inside _build

    @functools.wraps(orig)
    def _build(*args, **kwargs):
        fn = lookup("get_cc") if "CC" not in os.environ else None
        cc = fn() if fn is not None else None
        if cc is None:
            return orig(*args, **kwargs)
        with _lock:
            os.environ["CC"] = cc
            try:
                return orig(*args, **kwargs)
            finally:
                del os.environ["CC"]

    _patch(build, "_build", _build)


class SelectionCaches(collections.abc.Mapping):
    """A JITFunction's ``device_caches``, kept per spec selection (``resolve.selection_key``).

    A kernel compiled while one thread selects a backend must never be launched for another thread
    with another selection; stock Triton keys its in-memory cache by device only. Reads (Triton's
    ``device_caches[device]``, torch's ``.keys()`` / ``.values()``) see the current selection's caches.
    """

    def __init__(self, factory):
        self._factory = factory
        self._by_selection: dict = {}

    def _current(self) -> dict:
        key = selection_key()
        caches = self._by_selection.get(key)
        if caches is None:
            # caches of an older registry generation can never be selected again: let them go
            self._by_selection = {k: v for k, v in self._by_selection.items() if k[1] == key[1]}
            caches = self._by_selection[key] = collections.defaultdict(self._factory)
        return caches

    def __getitem__(self, device):
        return self._current()[device]

    def __iter__(self):
        return iter(self._current())

    def __len__(self):
        return len(self._current())


def _install_jit(jit):
    cls = jit.JITFunction
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.device_caches = SelectionCaches(self.create_binder)

    _patch(cls, "__init__", __init__)


def _install_driver_api(driver_mod):
    from .resolve import spec, spec_func
    _patch(driver_mod, "spec", spec)
    _patch(driver_mod, "spec_func", spec_func)


def _install_injectors(language):
    """FlagTree's injector names on the stock modules, plus the ambient backend's injections."""
    from triton.language import core, math, semantic, standard
    _patch(core, "spec_core_func", inject.spec_core_func)
    _patch(semantic, "spec_semantic_func", inject.spec_semantic_func)
    _patch(standard, "spec_standard_func", inject.spec_standard_func)
    _patch(math, "spec_math_func", inject.spec_math_func)
    _apply_ambient_injections()


def _apply_ambient_injections():
    if "triton.language" not in sys.modules or not _active:
        return
    inject.apply(_injecting_spec())  # waits for any kernel being generated with other injections


# --------------------------------------------------------------------------------------------
# interpreter: libdevice / extern math under TRITON_INTERPRET=1
# --------------------------------------------------------------------------------------------

_LIBDEVICE_MODULES = ("triton.language.extra.libdevice", "triton.language.extra.cuda.libdevice",
                      "triton.language.extra.hip.libdevice")


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
        if all(map(operator.is_, map(namespace.get, originals, itertools.repeat(_MISSING)), originals.values())) \
                and namespace.keys().isdisjoint(added):
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

    _patch(interpreter, "_patch_lang", _patch_lang)

    executor = interpreter.GridExecutor
    orig_call = executor.__call__

    @functools.wraps(orig_call)
    def __call__(self, *args, **kwargs):
        # Interpreted kernels read tl at run time: run each with its thread's injections in place
        # (stock Triton's own patching of tl makes concurrent interpreted runs unsafe anyway).
        with inject.applied(_injecting_spec()), _libdevice_served(interpreter):
            stack = _grid_stack()
            grid = _GridPatches()
            stack.append(grid)
            try:
                return orig_call(self, *args, **kwargs)
            finally:
                stack.pop()
                if grid.scope is not None:
                    grid.scope.restore()  # a no-op unless the grid failed before restoring it

    _patch(executor, "__call__", __call__)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InstallPoint:
    name: str  # matches Hook.point in hooks.py
    module: str  # the stock Triton module it patches
    install: Callable
    min_version: tuple[int, int] = (3, 4)  # TritonSemantic / entry-point backends arrived in 3.4
    doc: str = ""


INSTALL_POINTS: tuple[InstallPoint, ...] = (
    InstallPoint("semantic.atomic_add", "triton.language.semantic", _install_atomic_add,
                 doc="TritonSemantic.atomic_add: int64 atomic add lowering"),
    InstallPoint("semantic.atom_red_typechecking_impl", "triton.language.semantic", _install_atomic_bf16,
                 doc="TritonSemantic.atom_red_typechecking_impl: bf16 atomics policy"),
    InstallPoint("semantic.arange", "triton.language", _install_arange,
                 doc="TritonSemantic.arange + core.validate_block_shape: power-of-two rule"),
    InstallPoint("semantic.load_cache_modifier", "triton.language", _install_cache_modifier,
                 doc="load cache modifiers: TritonSemantic (<= 3.8) or core._CachePolicy (3.9)"),
    InstallPoint("language.injectors", "triton.language", _install_injectors,
                 doc="spec_core/semantic/standard/math_func and the backend's tl builtins"),
    InstallPoint("compiler.compile", "triton.compiler", _install_compile,
                 doc="triton.compile: target spec, tl injections, spec fingerprint in the cache key"),
    InstallPoint("compiler.add_stages", "triton.knobs", _install_stages, min_version=(3, 6),
                 doc="knobs.runtime.add_stages_inspection_hook: add or replace stages"),
    InstallPoint("compiler.parse_options", "triton.runtime.driver", _install_parse_options,
                 doc="<Backend>.parse_options: num_stages cap"),
    InstallPoint("autotuner.prune_configs", "triton.runtime.autotuner", _install_autotuner,
                 doc="Autotuner.prune_configs: backend config pruning"),
    InstallPoint("testing.do_bench", "triton.testing", _install_do_bench, doc="triton.testing.do_bench"),
    InstallPoint("runtime.build", "triton.runtime.build", _install_get_cc, doc="host C compiler choice"),
    InstallPoint("runtime.jit", "triton.runtime.jit", _install_jit,
                 doc="JITFunction: in-memory caches separated per spec selection"),
    InstallPoint("runtime.driver", "triton.runtime.driver", _install_driver_api,
                 doc="from triton.runtime.driver import spec, spec_func"),
    InstallPoint("interpreter.libdevice", "triton.runtime.interpreter", _install_interpreter,
                 doc="interpreter: libdevice calls served by the backend's numpy functions"),
)

# outcome per point: "installed", "pending" (module not imported yet), "n/a: ..." or "failed: ..."
STATUS: dict[str, str] = {}


def _run(point: InstallPoint, module) -> None:
    with _lock:
        if not _active or STATUS.get(point.name) == "installed":
            return
        try:
            if _version() < point.min_version:
                STATUS[point.name] = f"n/a: needs triton >= {'.'.join(map(str, point.min_version))}"
                return
            point.install(module)
            STATUS[point.name] = "installed"
        except Exception as e:  # never break `import triton`: report through `tritonspec check`
            STATUS[point.name] = f"failed: {type(e).__name__}: {e}"


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs install functions right after their Triton module finishes executing."""

    def find_spec(self, fullname, path, target=None):
        _install_ready()  # modules that were mid-import when we activated may be complete by now
        pending = [p for p in INSTALL_POINTS if p.module == fullname and STATUS.get(p.name) == "pending"]
        if not pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            found = finder.find_spec(fullname, path, target)
            if found is not None:
                break
        else:
            return None
        loader = found.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            for p in pending:
                _run(p, module)

        loader.exec_module = exec_then_install
        return found


_finder = _PostImportFinder()


def _install_ready() -> None:
    for point in INSTALL_POINTS:
        if STATUS.get(point.name) == "pending":
            module = _imported(point.module)
            if module is not None:
                _run(point, module)


def _imported(name: str):
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def activate() -> None:
    global _active
    with _lock:
        if _active:
            return
        _active = True
        for point in INSTALL_POINTS:
            STATUS[point.name] = "pending"
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _install_ready()
        REGISTRY.on_change(_apply_ambient_injections)
        on_selection_change(_apply_ambient_injections)


def deactivate() -> None:
    global _active
    with _lock:
        if not _active:
            return
        inject.restore()
        _patches.undo()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        STATUS.clear()
        _active = False


def is_active() -> bool:
    return _active
