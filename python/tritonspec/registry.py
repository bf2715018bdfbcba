"""Spec providers: which module specializes which backend, and which distribution it comes from.

Providers come from ``register_spec`` calls and from the ``tritonspec.specs`` entry-point group.
Any installed package could otherwise change kernel semantics process-wide, so a provider is
identified by backend name *and* distribution:

* ``TRITONSPEC_BACKENDS=name,name=distribution,...`` allows only the listed backends, and a
  ``name=distribution`` entry only that distribution's provider for the name;
* two installed providers for one name are an error naming both distributions, unless the
  allow-list picks one (which provider wins never depends on ``sys.path`` order);
* a provider that is not allowed is never imported.

The allow-list is read once, when a provider is first needed (set it before the process starts;
``REGISTRY.refresh()`` reads it again).

``tritonspec check`` lists every provider with its distribution, and every conflict.
"""
from __future__ import annotations

import importlib
import os
import re
import threading
from dataclasses import dataclass, field
from types import ModuleType

from .hooks import BACKEND_INFO, HOOKS, SpecError, injected, spec_module_exports, validate_spec_module
from .identity import BackendInfo

ENTRY_POINT_GROUP = "tritonspec.specs"
ALLOW_ENV = "TRITONSPEC_BACKENDS"


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
            raise SpecError(f"backend {self.backend!r}: {self.module.__name__}.{BACKEND_INFO} must be a "
                            f"tritonspec.BackendInfo, got {type(info).__name__}")
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
    """``TRITONSPEC_BACKENDS`` parsed: None allows every backend; a name maps to the distributions
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
                raise SpecError(f"{ALLOW_ENV}={raw!r}: entry {item!r} must be 'name' or 'name=distribution'")
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

    @property
    def label(self) -> str:
        return f"{self.distribution}=={self.version}" if self.distribution else "an unknown distribution"


class Registry:
    def __init__(self):
        self._lock = threading.RLock()
        self._registered: dict[str, Provider] = {}  # register_spec: wins over entry points
        self._loaded: dict[tuple, Provider] = {}  # (name, distribution) -> entry point's, imported on first use
        self._entry_points = None  # name -> [Candidate], read lazily
        self._allow: AllowList | None = None  # TRITONSPEC_BACKENDS, read on first use (refresh() re-reads)
        self._resolved: dict = {}  # name -> Provider or None: what get() found (ops look hooks up per call)
        self._listeners = []  # called after any change of registrations
        self.generation = 0  # bumped by every change of what a name resolves to; lazy loads change nothing

    # -- the allow-list ---------------------------------------------------------------------------
    def allow_list(self) -> AllowList:
        """``TRITONSPEC_BACKENDS`` as it was when first needed (``refresh()`` reads it again)."""
        if self._allow is None:
            self._allow = AllowList.parse(os.environ.get(ALLOW_ENV))
        return self._allow

    def refresh(self) -> None:
        """Read ``TRITONSPEC_BACKENDS`` and the installed entry points again (after changing either)."""
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
        distribution = _module_distribution(module) if allow.pinned(backend) else None
        if not allow.allows(backend, distribution):
            raise SpecError(f"register_spec: backend {backend!r} (module {module.__name__}, distribution "
                            f"{distribution or 'none'}) is not allowed by {ALLOW_ENV}={os.environ[ALLOW_ENV]!r}")
        provider = Provider(backend, module, distribution, origin)
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
        """``name -> [Candidate]`` of the ``tritonspec.specs`` group: every distribution's, none imported."""
        if self._entry_points is None:
            from importlib.metadata import entry_points
            found: dict[str, list] = {}
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                dist = getattr(ep, "dist", None)
                name = dist.metadata["Name"] if dist is not None else None
                found.setdefault(ep.name, []).append(Candidate(ep.name, ep.value, name, dist and dist.version))
            self._entry_points = found
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
        return (f"backend {backend!r} has {len(found)} spec providers: {who}; pick one with "
                f"{ALLOW_ENV}={backend}=<distribution>")

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


def _module_distribution(module: ModuleType) -> str | None:
    """The installed distribution that ships ``module``'s top-level package, or None."""
    from importlib.metadata import packages_distributions
    dists = packages_distributions().get(module.__name__.split(".")[0], [])
    return dists[0] if dists else None


REGISTRY = Registry()


def register_spec(backend: str, module: ModuleType) -> Provider:
    """Register ``module`` as the spec module of ``backend`` (replacing any earlier one).

    Under a pinned allow-list (``TRITONSPEC_BACKENDS=name=distribution``) the module must come
    from that distribution.
    """
    return REGISTRY.register(backend, module)
