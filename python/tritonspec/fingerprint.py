"""The identity of a spec provider for compile-cache keys: a digest of everything it can change.

Two providers whose kernels may compile differently must never share a cache entry, in this
process or in another one sharing the cache dir. The digest therefore covers every object the
spec exposes (hooks, and the functions its injector lists name, which need not be exported), the
source files they come from, the files of the spec's own package, and, followed through code
objects, closures, defaults and the module globals they name, the helpers they call, wherever
those live. Triton, torch, numpy and the standard library count by name and version: Triton's
own cache key already covers Triton, and the others do not change what a spec emits.

An object whose state cannot be read back from source or value (an arbitrary instance, a lock)
makes the digest a per-process nonce: that provider's binaries can then never match another
process's cache entries (``Digest.cacheable`` is False and ``tritonspec check`` says so).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import sys
import types
from dataclasses import dataclass

# Modules counted by name and version, not by their files.
_LIBRARIES = frozenset({"triton", "torch", "numpy"}) | frozenset(sys.stdlib_module_names) | frozenset(
    sys.builtin_module_names)
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
_NONCE = os.urandom(16).hex()


@dataclass(frozen=True)
class Digest:
    value: str  # hex, short enough for a cache key
    cacheable: bool  # False: the value contains this process's nonce
    reason: str = ""  # why not cacheable: the object that could not be read back


class _Unreadable(Exception):
    """An object whose state cannot be digested; the message names it."""


class _Hasher:

    def __init__(self):
        self.h = hashlib.sha256()
        self.seen: set[int] = set()
        self.files: set[str] = set()

    def update(self, *parts) -> None:
        for p in parts:
            self.h.update(p if isinstance(p, bytes) else str(p).encode())
            self.h.update(b"\0")

    def file(self, path: str | None) -> None:
        if not path or path in self.files or not os.path.isfile(path):
            return
        self.files.add(path)
        self.update("file", os.path.basename(path), _file_digest(path, os.stat(path).st_mtime_ns))

    def package_files(self, module: types.ModuleType) -> None:
        """Every .py file of ``module``'s package directory (a spec is usually a package)."""
        path = getattr(module, "__file__", None)
        if not path or os.path.basename(path) != "__init__.py":
            self.file(path)
            return
        root = os.path.dirname(path)
        for dirpath, dirnames, filenames in sorted(os.walk(root)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    self.file(os.path.join(dirpath, name))

    def obj(self, x, where: str) -> None:
        if isinstance(x, _PRIMITIVES):
            self.update(type(x).__name__, repr(x))
            return
        if id(x) in self.seen:
            self.update("seen", type(x).__name__)
            return
        self.seen.add(id(x))
        if isinstance(x, enum.Enum) or (type(x).__module__.split(".")[0] == "triton" and not callable(x)
                                        and _plain_repr(x)):
            self.update(type(x).__qualname__, repr(x))  # enums, tl.dtype, ir.CACHE_MODIFIER values
        elif isinstance(x, (tuple, list, frozenset, set)):
            items = sorted(x, key=repr) if isinstance(x, (set, frozenset)) else x
            self.update(type(x).__name__, len(items))
            for i, item in enumerate(items):
                self.obj(item, f"{where}[{i}]")
        elif isinstance(x, dict):
            self.update("dict", len(x))
            for k in sorted(x, key=repr):
                self.obj(k, where)
                self.obj(x[k], f"{where}[{k!r}]")
        elif isinstance(x, types.ModuleType):
            self.module(x, where)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            self.update("dataclass", type(x).__module__, type(x).__qualname__)
            for f in dataclasses.fields(x):
                self.obj(getattr(x, f.name), f"{where}.{f.name}")
        elif isinstance(x, functools.partial):
            self.update("partial")
            self.obj(x.func, where)
            self.obj(x.args, where)
            self.obj(x.keywords, where)
        elif isinstance(x, (staticmethod, classmethod)):
            self.obj(x.__func__, where)
        elif isinstance(x, types.MethodType):
            self.obj(x.__func__, where)
            self.obj(x.__self__, where)
        elif isinstance(x, types.FunctionType) or hasattr(x, "__wrapped__"):
            self.function(x, where)
        elif isinstance(getattr(x, "fn", None), types.FunctionType) and type(x).__module__.startswith("triton."):
            self.update("jit", type(x).__qualname__)  # a @triton.jit function (or its interpreted form)
            self.function(x.fn, where)
        elif isinstance(x, type):
            self.named(x, where) or self.module_of(x, where)
        elif isinstance(x, types.CodeType):
            self.code(x, {}, where)
        elif callable(x) and getattr(x, "__module__", None) and getattr(x, "__qualname__", None):
            self.named(x, where) or self.module_of(x, where)  # builtins and other C callables
        else:
            raise _Unreadable(f"{where} ({type(x).__module__}.{type(x).__qualname__})")

    def named(self, x, where: str) -> bool:
        """Library objects count by their module, name and version; True if ``x`` is one."""
        module = getattr(x, "__module__", None) or ""
        top = module.split(".")[0]
        if top not in _LIBRARIES:
            return False
        version = getattr(sys.modules.get(top), "__version__", "")
        self.update("lib", module, getattr(x, "__qualname__", repr(x)), version)
        return True

    def module_of(self, x, where: str) -> None:
        self.update("def", getattr(x, "__qualname__", ""))
        mod = sys.modules.get(getattr(x, "__module__", None) or "")
        self.file(getattr(mod, "__file__", None))

    def module(self, m: types.ModuleType, where: str) -> None:
        top = m.__name__.split(".")[0]
        if top in _LIBRARIES:
            self.update("lib", m.__name__, getattr(sys.modules.get(top), "__version__", ""))
            return
        path = getattr(m, "__file__", None)
        if path:
            self.update("module", m.__name__)
            self.file(path)
            return
        # A module built at run time: what it holds is what it is.
        self.update("runtime module", m.__name__)
        for name in sorted(vars(m)):
            if not name.startswith("__"):
                self.update(name)
                self.obj(getattr(m, name), f"{where}.{name}")

    def function(self, fn, where: str) -> None:
        if self.named(fn, where):
            return
        inner = getattr(fn, "__wrapped__", None)
        if inner is not None:  # a decorator's wrapper (tl's @builtin, functools.wraps): what it wraps
            self.obj(inner, where)
            code = getattr(fn, "__code__", None)
            self.update("wrapper", code.co_code if code is not None else type(fn).__qualname__)
            return
        if not isinstance(fn, types.FunctionType):
            self.module_of(fn, where)
            return
        self.update("function", fn.__module__, fn.__qualname__)
        self.file(fn.__code__.co_filename)
        self.code(fn.__code__, fn.__globals__, where)
        self.obj(fn.__defaults__, f"{where} defaults")
        self.obj(fn.__kwdefaults__, f"{where} defaults")
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                value = None
            self.obj(value, f"{where} closure {fn.__code__.co_freevars[i]!r}")

    def code(self, co: types.CodeType, globals_: dict, where: str) -> None:
        self.update("code", co.co_code, co.co_names, co.co_varnames)
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c, globals_, where)
            else:
                self.obj(c, where)
        # Module globals the code names: the helpers it calls, wherever they are defined. A name
        # that is an attribute elsewhere (``x.mul``) and also a global here is digested too: harmless.
        for name in co.co_names:
            if name in globals_:
                self.obj(globals_[name], f"{where} -> {name}")


def _plain_repr(x) -> bool:
    return " at 0x" not in repr(x)


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def digest(backend: str, module: types.ModuleType, exposed: dict[str, object]) -> Digest:
    """The digest of a spec provider: ``module``'s package files and every ``exposed`` object."""
    h = _Hasher()
    h.update("tritonspec provider", backend)
    h.package_files(module)
    try:
        for name in sorted(exposed):
            h.update("expose", name)
            h.obj(exposed[name], f"{module.__name__}.{name}")
    except _Unreadable as e:
        return Digest(f"nonce-{_NONCE[:12]}-{h.h.hexdigest()[:8]}", False, f"cannot read back {e}")
    return Digest(h.h.hexdigest()[:20], True)
