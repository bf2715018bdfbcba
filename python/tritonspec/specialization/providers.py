"""Spec providers: which module specializes which backend, and which distribution it comes from.

Providers come from ``register_spec`` calls and from the ``tritonspec.specs`` entry-point group.
Any installed package could otherwise change kernel semantics process-wide, so a provider is
identified by backend name *and* distribution:

* ``TRITONSPEC_ALLOWED_BACKENDS=name,name=distribution,...`` allows only the listed backends, and a
  ``name=distribution`` entry only that distribution's provider for the name;
* two installed providers for one name are an error naming both distributions, unless the
  allow-list picks one (which provider wins never depends on ``sys.path`` order);
* a provider that is not allowed is never imported.

A pin trusts more than a ``METADATA`` name, which any package can claim. Before a pinned provider
is imported, every file that importing it would run must belong to the pinned distribution: listed
in its ``RECORD``, or, for an editable install (PEP 660), inside the source directories its
``.pth`` or import finder maps; and the installed distributions of that name must all be one
project (a source tree's ``*.egg-info`` beside its editable install is; a second package merely
called ``tritonspec`` is not). A pinned name cannot be taken over at run time: ``register_spec``
refuses it. (A package that shadows the pinned distribution's own modules earlier on ``sys.path``
can replace any module, Triton's included; no pin can tell.)

The allow-list is read once, when a provider is first needed (set it before the process starts;
``PROVIDERS.refresh()`` reads it again).

``tritonspec check`` lists every provider with its distribution, and every conflict.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType

from .hooks import BACKEND_INFO, HOOKS, SpecError, injected, spec_module_exports, validate_spec_module
from .. import settings
from .backend_info import BackendInfo

ENTRY_POINT_GROUP = "tritonspec.specs"


def normalize(distribution: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


@dataclass
class Provider:
    backend: str
    module: ModuleType
    distribution: str | None  # the installed distribution it comes from; None: code outside any
    origin: str  # "entry point", "register_spec" or "driver <class>"
    info: BackendInfo = field(init=False)
    digest: "fingerprint.Digest" = field(init=False)

    def __post_init__(self):
        validate_spec_module(self.backend, self.module)
        info = getattr(self.module, BACKEND_INFO, None)
        if info is not None and not isinstance(info, BackendInfo):
            raise SpecError(
                f"backend {self.backend!r}: {self.module.__name__}.{BACKEND_INFO} must be a "
                f"tritonspec.BackendInfo, got {type(info).__name__}"
            )
        self.info = info or BackendInfo()
        self.exports = frozenset(spec_module_exports(self.module))
        exposed = {name: getattr(self.module, name) for name in self.exports}
        exposed.update(injected(self.module))
        from . import fingerprint  # providers are created on first use, not when triton is imported

        self.digest = fingerprint.digest(self.backend, self.module, exposed)

    @property
    def fingerprint(self) -> str:
        return self.digest.value

    def get(self, name: str):
        """The module's attribute for hook ``name``, or None when the backend does not specialize it."""
        return getattr(self.module, name, None) if name in self.exports else None

    @property
    def hooks(self) -> list[str]:
        return sorted(n for n in self.exports if n in HOOKS)

    @property
    def source(self) -> str:
        return f"{self.origin} of {self.distribution}" if self.distribution else self.origin


@dataclass(frozen=True)
class AllowList:
    """``TRITONSPEC_ALLOWED_BACKENDS`` parsed: None allows every backend; a name maps to the distributions
    it is pinned to (empty: any distribution)."""

    names: dict | None

    @classmethod
    def parse(cls, raw: str | None) -> AllowList:
        if raw is None:
            return cls(None)
        names: dict[str, set] = {}
        for item in (i.strip() for i in raw.split(",")):
            if not item:
                continue
            name, _, dist = (s.strip() for s in item.partition("="))
            if not name or ("=" in item and not dist):
                raise SpecError(
                    f"{settings.ALLOWED_BACKENDS.shown()}: entry {item!r} must be 'name' or 'name=distribution'"
                )
            pins = names.setdefault(name, set())
            if dist:
                pins.add(normalize(dist))
        return cls({k: frozenset(v) for k, v in names.items()})

    def allows(self, backend: str, distribution: str | None) -> bool:
        if self.names is None:
            return True
        if backend not in self.names:
            return False
        pins = self.names[backend]
        return not pins or (distribution is not None and normalize(distribution) in pins)

    def pinned(self, backend: str) -> bool:
        return bool(self.names and self.names.get(backend))


@dataclass(frozen=True)
class Candidate:
    """One ``tritonspec.specs`` entry point, not imported, with the distribution that declares it."""

    name: str
    value: str  # the module path
    distribution: str | None
    version: str | None
    # The installed distributions declaring exactly this (a source tree's egg-info beside its install).
    dists: tuple = field(default=(), compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.distribution}=={self.version}" if self.distribution else "an unknown distribution"


class ProviderRegistry:
    def __init__(self):
        self._lock = threading.RLock()
        self._registered: dict[str, Provider] = {}  # register_spec: wins over entry points
        self._loaded: dict[tuple, Provider] = {}  # (name, distribution) -> entry point's, imported on first use
        self._entry_points = None  # name -> [Candidate], read lazily
        self._projects: dict = {}  # distribution name -> {its declared entry points: [where installed]}
        self._allow: AllowList | None = None  # TRITONSPEC_ALLOWED_BACKENDS, read on first use (refresh() re-reads)
        self._resolved: dict = {}  # name -> Provider or None: what get() found (ops look hooks up per call)
        self._listeners = []  # called after any change of registrations
        self.generation = 0  # bumped by every change of what a name resolves to; lazy loads change nothing

    # -- the allow-list ---------------------------------------------------------------------------
    def allow_list(self) -> AllowList:
        """``TRITONSPEC_ALLOWED_BACKENDS`` as it was when first needed (``refresh()`` reads it again)."""
        if self._allow is None:
            self._allow = AllowList.parse(settings.ALLOWED_BACKENDS.raw())
        return self._allow

    def refresh(self) -> None:
        """Read ``TRITONSPEC_ALLOWED_BACKENDS`` and the installed entry points again (after changing either)."""
        with self._lock:
            self._allow = None
            self._entry_points = None
            self._changed()

    def allowed(self, backend: str, distribution: str | None = None) -> bool:
        return self.allow_list().allows(backend, distribution)

    # -- registration -----------------------------------------------------------------------------
    def register(self, backend: str, module: ModuleType, origin: str = "register_spec") -> Provider:
        if not isinstance(backend, str) or not backend:
            raise TypeError(f"register_spec: backend must be a non-empty str, got {backend!r}")
        if not isinstance(module, ModuleType):
            raise TypeError(f"register_spec: module must be a module, got {type(module).__name__}")
        allow = self.allow_list()
        if allow.pinned(backend):
            raise SpecError(
                f"register_spec: backend {backend!r} is pinned to distribution "
                f"{' or '.join(sorted(allow.names[backend]))} by {settings.ALLOWED_BACKENDS.shown()}: "
                f"its spec comes from that distribution's {ENTRY_POINT_GROUP} entry point only, "
                f"not from module {module.__name__} registered at run time"
            )
        if not allow.allows(backend, None):
            raise SpecError(
                f"register_spec: backend {backend!r} (module {module.__name__}) is not allowed by "
                f"{settings.ALLOWED_BACKENDS.shown()}"
            )
        provider = Provider(backend, module, None, origin)
        with self._lock:
            self._registered[backend] = provider
            self._changed()
        return provider

    def unregister(self, backend: str) -> None:
        with self._lock:
            if self._registered.pop(backend, None) is not None:
                self._changed()

    def _changed(self):
        self._resolved = {}
        self.generation += 1
        for fn in list(self._listeners):
            fn()

    def on_change(self, fn) -> None:
        if fn not in self._listeners:
            self._listeners.append(fn)

    # -- entry points -------------------------------------------------------------------------------
    def entry_points(self) -> dict[str, list[Candidate]]:
        """``name -> [Candidate]`` of the ``tritonspec.specs`` group: every distribution's, none imported.

        Every installed distribution counts, also a second one of the same name (``importlib.metadata``'s
        ``entry_points()`` would keep only the first on ``sys.path``, so a package calling itself
        ``tritonspec`` could hide the real one's providers); identical declarations are one candidate."""
        if self._entry_points is None:
            from importlib.metadata import distributions

            found: dict[str, list] = {}
            index: dict[tuple, int] = {}  # (name, value, distribution) -> its place in found[name]
            projects: dict[str, dict] = {}  # distribution name -> {its declarations: [where installed]}
            for dist in distributions():
                eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
                if not eps:
                    continue
                name = dist.metadata["Name"]
                declared = frozenset((ep.name, ep.value) for ep in eps)
                projects.setdefault(normalize(name or ""), {}).setdefault(declared, []).append(_location(dist))
                for ep in eps:
                    listed, key = found.setdefault(ep.name, []), (ep.name, ep.value, normalize(name or ""))
                    if key in index:
                        same = listed[index[key]]
                        listed[index[key]] = dataclasses.replace(same, dists=same.dists + (dist,))
                    else:
                        index[key] = len(listed)
                        listed.append(Candidate(ep.name, ep.value, name, dist.version, (dist,)))
            self._entry_points, self._projects = found, projects
        return self._entry_points

    def candidates(self, backend: str) -> list[Candidate]:
        """The entry points for ``backend`` that the allow-list admits (none of them imported)."""
        allow = self.allow_list()
        return [c for c in self.entry_points().get(backend, []) if allow.allows(backend, c.distribution)]

    def conflict(self, backend: str) -> str | None:
        """Why ``backend`` cannot be resolved (two allowed providers), or None."""
        found = self.candidates(backend)
        if len(found) < 2:
            return None
        who = " and ".join(f"{c.label} ({c.value})" for c in found)
        names = [normalize(c.distribution or "") for c in found]
        if len(set(names)) < len(names):
            return (
                f"backend {backend!r} has {len(found)} spec providers: {who}; distributions of one name cannot "
                "be told apart by a pin: uninstall the one that is not meant"
            )
        return (
            f"backend {backend!r} has {len(found)} spec providers: {who}; pick one with "
            f"{settings.ALLOWED_BACKENDS.name}={backend}=<distribution>"
        )

    def pin_problem(self, backend: str, candidate: Candidate) -> str | None:
        """Why ``candidate``, pinned by the allow-list, may not be its distribution's own code; else None.

        Nothing is imported: the files importing it would run are found as the import would find them."""
        if not self.allow_list().pinned(backend):
            return None
        self.entry_points()
        projects = self._projects.get(normalize(candidate.distribution or ""), {})
        if len(projects) > 1:
            where = "; ".join(
                f"at {', '.join(places)}: {', '.join(sorted(f'{n} = {v}' for n, v in declared))}"
                for declared, places in projects.items()
            )
            return (
                f"{len(projects)} different installed distributions are named {candidate.distribution!r} "
                f"({where}); the pin cannot tell which one is meant"
            )
        files = _import_files(candidate.value)
        if files is None:
            return f"module {candidate.value} cannot be found"
        owned = [_owned(dist) for dist in candidate.dists]
        for path in files:
            if not any(_owns(found, path) for found in owned):
                return (
                    f"{path} (imported for {candidate.value}) is not a file of distribution {candidate.label}: "
                    "neither in its RECORD nor in its editable source"
                )
        return None

    def get(self, backend: str | None) -> Provider | None:
        """The provider for ``backend``, importing its entry point on first use; None if there is none."""
        if backend is None:
            return None
        hit = self._resolved.get(backend, self)
        if hit is not self:
            return hit
        provider = self._registered.get(backend)
        if provider is not None and self.allowed(backend, provider.distribution):
            self._resolved[backend] = provider
            return provider
        found = self.candidates(backend)
        if not found:
            self._resolved[backend] = None
            return None
        if len(found) > 1:
            raise SpecError(self.conflict(backend))
        key = (backend, found[0].distribution)
        provider = self._loaded.get(key)
        if provider is None:
            with self._lock:
                if key not in self._loaded:
                    problem = self.pin_problem(backend, found[0])
                    if problem is not None:
                        raise SpecError(
                            f"backend {backend!r}: refusing the provider {found[0].value} of "
                            f"{found[0].label} pinned by {settings.ALLOWED_BACKENDS.name}: {problem}"
                        )
                    module = importlib.import_module(found[0].value)
                    self._loaded[key] = Provider(backend, module, key[1], "entry point")
                provider = self._loaded[key]
        self._resolved[backend] = provider
        return provider

    def names(self) -> list[str]:
        return sorted(set(self._registered) | set(self.entry_points()))

    def providers(self) -> dict[str, Provider]:
        """Every allowed provider that can be resolved, imported now (conflicts are left out)."""
        return {name: p for name in self.names() if self.conflict(name) is None and (p := self.get(name)) is not None}


def _location(dist) -> str:
    """Where an installed distribution's metadata is (its ``*.dist-info`` or ``*.egg-info``)."""
    return str(getattr(dist, "_path", None) or dist.locate_file(""))


def _import_files(name: str) -> list[str] | None:
    """The files importing module ``name`` runs (each package's ``__init__`` on the way, then the module),
    found without importing anything; None if it cannot be found."""
    files, search, parts = [], None, name.split(".")
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        module = sys.modules.get(full)
        if module is not None:
            origin, search = getattr(module, "__file__", None), getattr(module, "__path__", None)
        else:
            try:
                spec = (
                    importlib.util.find_spec(full)
                    if i == 0 or ".".join(parts[:i]) in sys.modules
                    else importlib.machinery.PathFinder.find_spec(full, list(search or []))
                )
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                return None
            origin = spec.origin if spec.has_location else None
            search = spec.submodule_search_locations
        if origin:
            files.append(os.path.realpath(origin))
    return files


def _owns(owned: tuple, path: str) -> bool:
    """Whether ``path`` (a real path) is one of a distribution's files (``owned``: what ``_owned`` found):
    in its RECORD, or under a source directory its editable install maps."""
    files, roots = owned
    return path in files or any(path == root or path.startswith(root + os.sep) for root in roots)


def _owned(dist) -> tuple[frozenset, tuple]:
    """(files, directories) of ``dist``, as real paths: what its RECORD lists, and what its editable
    install maps (PEP 660: setuptools' import finder ``MAPPING``, or the directories of a ``.pth``)."""
    files, roots = set(), []
    for entry in dist.files or ():
        path = os.path.realpath(dist.locate_file(entry))
        files.add(path)
        if not os.path.isfile(path):
            continue
        if entry.name.endswith(".pth"):
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f]
            roots += [line for line in lines if line and not line.startswith(("#", "import ", "import\t"))]
        elif entry.name.startswith("__editable__") and entry.name.endswith("finder.py"):
            roots += _finder_mapping(path)
    return frozenset(files), tuple(os.path.realpath(r) for r in roots if os.path.exists(r))


def _finder_mapping(path: str) -> list[str]:
    """The source paths of setuptools' editable import finder (``MAPPING = {name: path}``), read, not run."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        )
        if isinstance(target, ast.Name) and target.id == "MAPPING" and node.value is not None:
            try:
                mapping = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [str(p) for p in mapping.values()] if isinstance(mapping, dict) else []
    return []


PROVIDERS = ProviderRegistry()


def register_spec(backend: str, module: ModuleType) -> Provider:
    """Register ``module`` as the spec module of ``backend`` (replacing any earlier one).

    A name the allow-list pins (``TRITONSPEC_ALLOWED_BACKENDS=name=distribution``) is refused: its spec comes
    from that distribution's entry point only.
    """
    return PROVIDERS.register(backend, module)
