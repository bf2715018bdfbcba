"""The identity of a spec provider for compile-cache keys: a digest of everything it can change.

Two providers whose kernels may compile differently must never share a cache entry, in this
process or in another one sharing the cache dir. The digest therefore covers every object the
spec exposes (hooks, and the functions its injector lists name, which need not be exported), every
file of the spec's own package (data files too: a spec may read them), and, followed through code
objects, closures, defaults, the module globals they name and the attributes they read from those
(``helpers.combine``), the helpers they call, wherever those live. Modules a function imports by a
constant name (an ``import`` in its body, ``importlib.import_module("x")``, ``sys.modules["x"]``) count
by their files; classes and modules that have no file count by what they hold. Triton, torch, numpy
and the standard library count by name and version: Triton's own cache key already covers Triton,
and the others do not change what a spec emits.

What cannot be followed makes the digest a per-process nonce: that provider's binaries can then
never match another process's cache entries (``Digest.cacheable`` is False, and ``tritonspec check``
says why). That is an object whose state cannot be read back (an arbitrary instance, a lock), code
that looks a module up by a name computed at run time or loads one from a path, code outside the
spec's package that reads files, and a package too large to hash.
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import enum
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import io
import os
import pathlib
import sys
import types
from dataclasses import dataclass

# Modules counted by name and version, not by their files.
_LIBRARIES = (
    frozenset({"triton", "torch", "numpy"}) | frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names)
)
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
_NONCE = os.urandom(16).hex()
# A package's files are hashed whole; a larger file counts by its size and mtime (editing it changes
# both), and a package of more files than this is not fingerprinted at all (the spec is not cacheable).
_FILE_BYTES = 8 << 20
_PACKAGE_FILES = 2000


@dataclass(frozen=True)
class Digest:
    value: str  # hex, short enough for a cache key
    cacheable: bool  # False: the value contains this process's nonce
    reason: str = ""  # why not cacheable: what could not be followed


class _Unreadable(Exception):
    """Something the digest cannot follow; the message names it and says why."""


class _Hasher:
    def __init__(self, package: str | None = None):
        self.h = hashlib.sha256()
        self.seen: set[int] = set()
        self.files: set[str] = set()
        self.package = package  # the spec's package directory: its files are hashed, so code there may read them
        self.watched = _Watched()

    def update(self, *parts) -> None:
        for p in parts:
            self.h.update(p if isinstance(p, bytes) else str(p).encode())
            self.h.update(b"\0")

    def file(self, path: str | None, label: str | None = None) -> None:
        if not path or path in self.files or not os.path.isfile(path):
            return
        self.files.add(path)
        st = os.stat(path)
        self.update("file", label or os.path.basename(path), _file_digest(path, st.st_mtime_ns, st.st_size))

    def package_files(self, module: types.ModuleType) -> None:
        """Every file of ``module``'s package directory (data files too), or its one file."""
        if self.package is None:
            self.file(getattr(module, "__file__", None))
            return
        count = 0
        for dirpath, dirnames, filenames in os.walk(self.package):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith((".pyc", ".pyo")):
                    continue
                count += 1
                if count > _PACKAGE_FILES:
                    raise _Unreadable(f"package {self.package} holds more than {_PACKAGE_FILES} files to hash")
                path = os.path.join(dirpath, name)
                self.file(path, os.path.relpath(path, self.package))

    def obj(self, x, where: str) -> None:
        if isinstance(x, _PRIMITIVES):
            self.update(type(x).__name__, repr(x))
            return
        if id(x) in self.seen:
            self.update("seen", type(x).__name__)
            return
        self.seen.add(id(x))
        if isinstance(x, enum.Enum) or (
            type(x).__module__.split(".")[0] == "triton" and not callable(x) and _plain_repr(x)
        ):
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
        elif isinstance(x, property):
            self.update("property")
            for accessor in (x.fget, x.fset, x.fdel):
                self.obj(accessor, where)
        elif isinstance(x, types.MethodType):
            self.obj(x.__func__, where)
            self.obj(x.__self__, where)
        elif isinstance(x, types.FunctionType) or hasattr(x, "__wrapped__"):
            self.function(x, where)
        elif isinstance(getattr(x, "fn", None), types.FunctionType) and type(x).__module__.startswith("triton."):
            self.update("jit", type(x).__qualname__)  # a @triton.jit function (or its interpreted form)
            self.function(x.fn, where)
        elif isinstance(x, type):
            self.named(x, where) or self.cls(x, where)
        elif isinstance(x, types.CodeType):
            self.code(x, {}, where)
        elif callable(x) and getattr(x, "__module__", None) and getattr(x, "__qualname__", None):
            self.named(x, where) or self.module_of(x, where)  # builtins and other C callables
        else:
            raise _Unreadable(f"{where} ({type(x).__module__}.{type(x).__qualname__}) cannot be read back")

    def named(self, x, where: str) -> bool:
        """Library objects count by their module, name and version; True if ``x`` is one."""
        module = getattr(x, "__module__", None) or ""
        top = module.split(".")[0]
        if top not in _LIBRARIES:
            return False
        version = getattr(sys.modules.get(top), "__version__", "")
        self.update("lib", module, getattr(x, "__qualname__", None) or repr(x), version)
        return True

    def module_of(self, x, where: str) -> None:
        self.update("def", getattr(x, "__qualname__", ""))
        mod = sys.modules.get(getattr(x, "__module__", None) or "")
        self.file(getattr(mod, "__file__", None))

    def cls(self, c: type, where: str) -> None:
        """A class counts by its module's file; one built at run time (its module has no file, or its
        methods' code comes from elsewhere: ``exec``, ``dataclass``) by what it holds."""
        path = getattr(sys.modules.get(c.__module__), "__file__", None)
        if path and all(_code_file(v) in (None, path) for v in vars(c).values()):
            self.module_of(c, where)
            return
        self.update("class", c.__module__, c.__qualname__)
        for base in c.__bases__:
            self.obj(base, f"{where} base")
        if dataclasses.is_dataclass(c):
            for f in dataclasses.fields(c):
                self.update("field", f.name, f.type)
                self.obj(None if f.default is dataclasses.MISSING else f.default, f"{where}.{f.name}")
                self.obj(None if f.default_factory is dataclasses.MISSING else f.default_factory, f"{where}.{f.name}")
        for name, value in sorted(vars(c).items()):
            if name in _CLASS_BOOKKEEPING or name.startswith("__dataclass"):
                continue
            self.update(name)
            if isinstance(value, (types.MemberDescriptorType, types.GetSetDescriptorType)):
                continue  # a __slots__ entry: its name is all there is
            self.obj(value, f"{where}.{name}")

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

    def module_named(self, name: str, where: str, submodule: bool = False) -> None:
        """The module ``name`` as importing it would find it, imported or not (nothing is imported here).

        ``submodule``: ``name`` may also be an attribute of its package (``from pkg import name``)."""
        if name.split(".")[0] in _LIBRARIES:
            self.update("lib", name)
            return
        module = sys.modules.get(name)
        if module is not None:
            self.obj(module, where)
            return
        spec = _find_unimported(name)
        if spec is not None and spec.origin and os.path.isfile(spec.origin):
            self.update("module", name)
            self.file(spec.origin)
        elif not submodule:
            self.update("missing module", name)  # installing it later changes the digest

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
        cells = {}
        for i, cell in enumerate(fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                value = None
            cells[fn.__code__.co_freevars[i]] = value
        self.code(fn.__code__, fn.__globals__, where, cells)
        self.obj(fn.__defaults__, f"{where} defaults")
        self.obj(fn.__kwdefaults__, f"{where} defaults")
        for name, value in cells.items():
            self.obj(value, f"{where} closure {name!r}")

    def code(self, co: types.CodeType, globals_: dict, where: str, cells: dict | None = None) -> None:
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
        self.reached(co, globals_, cells or {}, where)

    def reached(self, co: types.CodeType, globals_: dict, cells: dict, where: str) -> None:
        """What ``co`` reaches beyond the names of its globals: attributes of them, imports, files."""

        def resolve(name):
            if name in cells:
                return cells[name]
            return globals_.get(name, vars(builtins).get(name, _MISSING))

        if not self.watched.worth_reading(co, resolve):
            return
        for kind, what, detail in _reached(co, resolve, self.watched):
            label = f"{where} -> {what}"
            if kind == "attribute":
                if isinstance(detail, _FOLLOWED):
                    self.obj(detail, label)
            elif kind == "import":
                self.imported(what, *detail, globals_, label)
            elif kind == "module":
                self.module_named(detail, label)
            elif kind == "dynamic":
                raise _Unreadable(f"{where} {what}")
            elif kind == "reads" and not self.reads_own_files(co):
                raise _Unreadable(f"{where} reads files ({what}) outside the spec's package")

    def imported(self, name: str, level: int, fromlist: tuple, globals_: dict, where: str) -> None:
        """An ``import`` statement in followed code: the module, and each name taken from it."""
        if level:
            package = globals_.get("__package__")
            if not package:
                return  # fails when run: nothing to digest
            name = importlib.util.resolve_name("." * level + name, package)
        self.module_named(name, where)
        module = sys.modules.get(name)
        for attr in fromlist:
            if attr == "*":
                continue
            value = vars(module).get(attr, _MISSING) if module is not None else _MISSING
            if isinstance(value, _FOLLOWED):
                self.obj(value, f"{where}.{attr}")
            elif value is _MISSING:
                self.module_named(f"{name}.{attr}", f"{where}.{attr}", submodule=True)

    def reads_own_files(self, co: types.CodeType) -> bool:
        """True when ``co`` is code of the spec's package that names no path outside it."""
        if self.package is None or not _inside(co.co_filename, self.package):
            return False
        return not any(isinstance(c, str) and _outside_path(c) for c in co.co_consts)


# What a class body holds besides its own definitions.
_CLASS_BOOKKEEPING = frozenset(
    {
        "__dict__",
        "__weakref__",
        "__module__",
        "__qualname__",
        "__doc__",
        "__orig_bases__",
        "__parameters__",
        "__annotations__",
    }
)
_MISSING = object()
# Attribute targets worth following into: code and the things that hold it.
_FOLLOWED = (types.FunctionType, types.MethodType, type, types.ModuleType, staticmethod, classmethod, functools.partial)


def _plain_repr(x) -> bool:
    return " at 0x" not in repr(x)


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    if size > _FILE_BYTES:
        return f"{size} bytes, mtime {mtime_ns}"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _code_file(x) -> str | None:
    """The file the code of ``x`` (a function, or a static / class method) was compiled from, if any."""
    code = getattr(getattr(x, "__func__", x), "__code__", None)
    return code.co_filename if isinstance(code, types.CodeType) else None


def _inside(path: str, directory: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep)


def _outside_path(s: str) -> bool:
    """A string naming a path that leaves the directory it is joined to (absolute, ``~``, ``..``)."""
    return os.path.isabs(s) or s.startswith("~") or ".." in s.replace("\\", "/").split("/")


def _find_unimported(name: str):
    """The ModuleSpec importing ``name`` would use, found without importing anything; None if none."""
    parent = name.rpartition(".")[0]
    try:
        if not parent or parent in sys.modules:
            return importlib.util.find_spec(name)
        spec = _find_unimported(parent)
        if spec is None or not spec.submodule_search_locations:
            return None
        return importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None


# -- what code reaches by name, read from its bytecode ------------------------------------------------

_NOISE = frozenset({"CACHE", "PUSH_NULL", "PRECALL", "EXTENDED_ARG", "NOP", "RESUME", "COPY_FREE_VARS"})
_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_GLOBALS"})
_ATTRS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_CONSTS = frozenset({"LOAD_CONST", "LOAD_SMALL_INT"})
_CALLS = frozenset({"CALL", "CALL_FUNCTION", "CALL_METHOD"})


class _Watched:
    """The callables whose use the digest must see: module lookups and file reads (built per digest:
    numpy's and torch's readers count once they are imported)."""

    def __init__(self):
        import importlib.resources as resources
        import pathlib
        import pkgutil
        import runpy

        by_name = (importlib.import_module, builtins.__import__, importlib.__import__)  # followed if constant
        by_path = (
            importlib.reload,
            importlib.util.spec_from_file_location,
            importlib.util.spec_from_loader,
            importlib.util.module_from_spec,
            runpy.run_path,
            runpy.run_module,
        )
        readers = [
            builtins.open,
            io.open,
            io.open_code,
            os.open,
            os.fdopen,
            pkgutil.get_data,
            pathlib.Path.open,
            pathlib.Path.read_text,
            pathlib.Path.read_bytes,
        ]
        readers += [
            getattr(resources, n)
            for n in ("files", "read_text", "read_binary", "open_text", "open_binary", "path", "as_file")
            if hasattr(resources, n)
        ]
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        if numpy is not None:
            readers += [numpy.load, numpy.fromfile, numpy.loadtxt, numpy.genfromtxt, numpy.memmap]
        if torch is not None:
            readers.append(torch.load)
        self.importers = {id(f): (f, f in by_name) for f in (*by_name, *by_path)}
        self.readers = {id(f): f for f in readers}
        # Names whose presence in code makes reading its bytecode worth it.
        self.names = frozenset(f.__name__ for f in (*by_name, *by_path, *readers)) | {"modules"} | _READ_METHODS

    def importer(self, x):
        """None, or whether ``x`` (a module-importing callable) takes a module name."""
        found = self.importers.get(id(x))
        return found[1] if found is not None and found[0] is x else None

    def reader(self, x) -> bool:
        return self.readers.get(id(x)) is x

    def worth_reading(self, co: types.CodeType, resolve) -> bool:
        """Whether ``co`` may reach anything ``_reached`` reports (reading bytecode is the digest's main cost)."""
        if _IMPORT_NAME in co.co_code[::2]:
            return True
        for name in (*co.co_names, *co.co_freevars):
            if name in self.names:
                return True
            x = resolve(name)
            if x is sys.modules or self.importer(x) is not None or self.reader(x):
                return True
            if isinstance(x, (types.ModuleType, type)):
                module = x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", None)
                if str(module).split(".")[0] not in _LIBRARIES:
                    return True  # its attributes are followed
        return False


_IMPORT_NAME = dis.opmap["IMPORT_NAME"]
# Methods that read a file, called on an object the bytecode cannot name (``Path(p).read_text()``).
_READ_METHODS = frozenset({"open", "read_text", "read_bytes", "fromfile", "loadtxt", "get_data"})


def _static_attr(obj, name: str):
    """``obj.name`` for modules and classes, without running a property or ``__getattr__``."""
    if isinstance(obj, types.ModuleType):
        found = vars(obj).get(name, _MISSING)
        return sys.modules.get(f"{obj.__name__}.{name}", _MISSING) if found is _MISSING else found
    if isinstance(obj, type):
        found = inspect.getattr_static(obj, name, _MISSING)
        return found.__func__ if isinstance(found, (staticmethod, classmethod)) else found
    return _MISSING


def _name_in(instruction, resolve) -> str | None:
    """The absolute module name ``instruction`` loads when it is a constant or a global string, else None."""
    if instruction.opname in _CONSTS:
        value = instruction.argval
    elif instruction.opname in _LOADS:
        value = resolve(instruction.argval)
    else:
        return None
    return value if isinstance(value, str) and value and not value.startswith(".") else None


def _reached(co: types.CodeType, resolve, watched: _Watched):
    """``(kind, what, detail)`` for everything ``co`` (not its nested code) reaches by name:

    * ``attribute``: ``global.attr...`` resolved (detail: the object);
    * ``import``: an import statement (what: the module name, detail: (level, from-list));
    * ``module``: a module looked up by a constant name (detail: the name);
    * ``dynamic``: a module looked up by a name computed at run time, or loaded from a path;
    * ``reads``: a call that reads a file.
    """
    ins = [i for i in dis.get_instructions(co) if i.opname not in _NOISE]
    called = lambda k: k < len(ins) and ins[k].opname in _CALLS  # noqa: E731
    for k, i in enumerate(ins):
        if i.opname == "IMPORT_NAME":
            level = ins[k - 2].argval if k >= 2 and ins[k - 2].opname in _CONSTS else 0
            fromlist = ins[k - 1].argval if k >= 1 and ins[k - 1].opname in _CONSTS else None
            yield "import", i.argval, (level or 0, tuple(fromlist or ()))
        elif i.opname in _ATTRS and i.argval in _READ_METHODS:
            yield "reads", f".{i.argval}()", None
        if i.opname not in _LOADS:
            continue
        target, path, j = resolve(i.argval), [i.argval], k + 1
        while target is not _MISSING and target is not sys.modules and j < len(ins) and ins[j].opname in _ATTRS:
            target = _static_attr(target, ins[j].argval)
            path.append(ins[j].argval)
            j += 1
        if target is _MISSING:
            continue
        what = ".".join(path)
        if len(path) > 1:
            yield "attribute", what, target
        takes_name = watched.importer(target)
        if takes_name is False:
            yield "dynamic", f"calls {what}(), which loads a module from a path", None
        elif takes_name:
            name = _name_in(ins[j], resolve) if called(j + 1) else None
            if name is None:
                yield "dynamic", f"calls {what}() with a module name computed at run time", None
            else:
                yield "module", f"{what}({name!r})", name
        elif target is sys.modules:
            name = None
            if j + 1 < len(ins) and ins[j].opname in _ATTRS and ins[j].argval == "get" and called(j + 2):
                name = _name_in(ins[j + 1], resolve)  # sys.modules.get("x")
            elif j + 1 < len(ins) and (ins[j + 1].opname == "BINARY_SUBSCR" or ins[j + 1].argrepr == "[]"):
                name = _name_in(ins[j], resolve)  # sys.modules["x"]
            if name is None:
                yield "dynamic", f"looks a module up in {what} by a name computed at run time", None
            else:
                yield "module", f"{what}[{name!r}]", name
        elif watched.reader(target):
            yield "reads", f"{what}()", None


@functools.lru_cache(maxsize=None)
def source_digest(directory: str) -> str:
    """Every ``.py`` file under ``directory``, by path and content: the part of a compile-cache key that
    makes editing a backend's (or this layer's) code recompile. Read once per process."""
    root = os.path.realpath(directory)
    h = hashlib.sha256()
    for path in sorted(pathlib.Path(root).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def package_dir(module: types.ModuleType) -> str | None:
    """The directory of ``module``'s own package (it or its parent), or None for a top-level file or
    a module without one: every file there is the spec's, data included."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    spec = getattr(module, "__spec__", None)
    if hasattr(module, "__path__") or (spec is not None and spec.parent):
        return os.path.dirname(path)
    return None


def digest(backend: str, module: types.ModuleType, exposed: dict[str, object]) -> Digest:
    """The digest of a spec provider: ``module``'s package files and every ``exposed`` object."""
    h = _Hasher(package_dir(module))
    h.update("tritonspec provider", backend)
    try:
        h.package_files(module)
        for name in sorted(exposed):
            h.update("expose", name)
            h.obj(exposed[name], f"{module.__name__}.{name}")
    except _Unreadable as e:
        return Digest(f"nonce-{_NONCE[:12]}-{h.h.hexdigest()[:8]}", False, str(e))
    return Digest(h.h.hexdigest()[:20], True)
