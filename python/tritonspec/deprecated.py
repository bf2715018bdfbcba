"""Names from earlier layouts that still work, with a ``FutureWarning`` naming the new one: one table.

Old module paths (``tritonspec.registry``) are served by a meta-path finder as the module that
replaced them (the same object, so state is shared); old attribute names (``tritonspec.REGISTRY``)
by the owning package's ``__getattr__`` through ``renamed_attribute``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MODULES = {
    "tritonspec.hooks": "tritonspec.specialization.hooks",
    "tritonspec.identity": "tritonspec.specialization.backend_info",
    "tritonspec.registry": "tritonspec.specialization.providers",
    "tritonspec.resolve": "tritonspec.specialization.resolve",
    "tritonspec.inject": "tritonspec.specialization.inject",
    "tritonspec.fingerprint": "tritonspec.specialization.fingerprint",
    "tritonspec.patches": "tritonspec.specialization.patches",
    "tritonspec.check": "tritonspec.specialization.check",
    "tritonspec.install": "tritonspec.specialization.install",
    "tritonspec.nn.registry": "tritonspec.nn.kernel_registry",
    "tritonspec.nn.triton_kernels": "tritonspec.nn.registry_kernels",
    "tritonspec.nn.layers": "tritonspec.nn.modules",
    "tritonspec.nn.targets": "tritonspec.nn.detectors",
}

# (module, old attribute) -> new attribute of the same module
ATTRIBUTES = {
    ("tritonspec", "REGISTRY"): "PROVIDERS",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is now {new}; the old name still works but will be removed", FutureWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MODULES.get(fullname)
        if new is None:
            return None
        _warn(fullname, new)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install_module_aliases() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def renamed_attribute(module_name: str, name: str):
    """The object an old attribute name of ``module_name`` now has, with the warning; AttributeError if none."""
    new = ATTRIBUTES.get((module_name, name))
    if new is None:
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    _warn(f"{module_name}.{name}", f"{module_name}.{new}")
    return getattr(sys.modules[module_name], new)
