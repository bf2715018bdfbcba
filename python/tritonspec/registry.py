"""Spec providers: which module specializes which backend, and where it came from.

Providers come from ``register_spec`` calls and from the ``tritonspec.specs`` entry-point group.
Any installed package can otherwise change kernel semantics process-wide, so
``TRITONSPEC_BACKENDS=a,b`` restricts which providers may load, and every provider records the
distribution it comes from (``tritonspec check`` lists them).
"""
from __future__ import annotations

import glob
import hashlib
import importlib
import inspect
import os
import threading
from dataclasses import dataclass, field
from types import ModuleType

from .hooks import HOOKS, SpecError, spec_module_exports, validate_spec_module

ENTRY_POINT_GROUP = "tritonspec.specs"


@dataclass
class Provider:
    backend: str
    module: ModuleType
    origin: str  # "register_spec" or "entry point <dist>==<version>"
    fingerprint: str = field(init=False)

    def __post_init__(self):
        validate_spec_module(self.backend, self.module)
        self.fingerprint = _fingerprint(self.backend, self.module)

    def get(self, name: str):
        """The module's attribute for hook ``name``, or None when the backend does not specialize it."""
        return getattr(self.module, name, None) if name in self.exports else None

    @property
    def exports(self) -> frozenset[str]:
        return frozenset(spec_module_exports(self.module))

    @property
    def hooks(self) -> list[str]:
        return sorted(n for n in self.exports if n in HOOKS)


def _fingerprint(backend: str, module: ModuleType) -> str:
    """Identity of a spec set for cache keys: backend, its package's source files, exported objects.

    Whole files, not just exported functions: injected builtins call helpers the lists don't name.
    """
    h = hashlib.sha256(backend.encode())
    path = getattr(module, "__file__", None)
    if path:
        root = os.path.dirname(path) if os.path.basename(path) == "__init__.py" else None
        files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)) if root else [path]
        for f in files:
            with open(f, "rb") as fh:
                h.update(fh.read())
    for name in sorted(spec_module_exports(module)):
        obj = getattr(module, name)
        h.update(name.encode())
        try:
            h.update(inspect.getsource(obj).encode())
        except (TypeError, OSError):
            h.update(repr(obj).encode())
    return h.hexdigest()[:16]


class Registry:
    def __init__(self):
        self._lock = threading.RLock()
        self._providers: dict[str, Provider] = {}
        self._entry_points = None  # name -> EntryPoint, loaded lazily
        self._listeners = []  # called after any change of registrations or selection
        self.generation = 0  # bumped by register/unregister only: lazy entry-point loads change nothing

    def allowed(self, backend: str) -> bool:
        allow = os.environ.get("TRITONSPEC_BACKENDS")
        return allow is None or backend in {b.strip() for b in allow.split(",") if b.strip()}

    def register(self, backend: str, module: ModuleType, origin: str = "register_spec") -> Provider:
        if not isinstance(backend, str) or not backend:
            raise TypeError(f"register_spec: backend must be a non-empty str, got {backend!r}")
        if not isinstance(module, ModuleType):
            raise TypeError(f"register_spec: module must be a module, got {type(module).__name__}")
        if not self.allowed(backend):
            raise SpecError(f"backend {backend!r} is not in TRITONSPEC_BACKENDS={os.environ['TRITONSPEC_BACKENDS']!r}")
        provider = Provider(backend, module, origin)
        with self._lock:
            self._providers[backend] = provider
            self.generation += 1
            self._changed()
        return provider

    def unregister(self, backend: str) -> None:
        with self._lock:
            if self._providers.pop(backend, None) is not None:
                self.generation += 1
                self._changed()

    def _changed(self):
        for fn in list(self._listeners):
            fn()

    def on_change(self, fn) -> None:
        if fn not in self._listeners:
            self._listeners.append(fn)

    def entry_points(self) -> dict:
        if self._entry_points is None:
            from importlib.metadata import entry_points
            self._entry_points = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        return self._entry_points

    def get(self, backend: str | None) -> Provider | None:
        """The provider for ``backend``, loading its entry point on first use; None if there is none."""
        if backend is None:
            return None
        provider = self._providers.get(backend)
        if provider is not None or not self.allowed(backend):
            return provider
        ep = self.entry_points().get(backend)
        if ep is None:
            return None
        with self._lock:
            if backend not in self._providers:
                module = importlib.import_module(ep.value)
                dist = f"{ep.dist.name}=={ep.dist.version}" if ep.dist is not None else "unknown distribution"
                self._providers[backend] = Provider(backend, module, f"entry point of {dist}")
        return self._providers[backend]

    def names(self) -> list[str]:
        return sorted(set(self._providers) | set(self.entry_points()))


REGISTRY = Registry()


def register_spec(backend: str, module: ModuleType) -> Provider:
    """Register ``module`` as the spec module of ``backend`` (replacing any earlier one)."""
    return REGISTRY.register(backend, module)
