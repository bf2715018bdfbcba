"""tritonspec: FlagTree-style backend specialization hooks installed into stock Triton.

Importing tritonspec (or any ``import triton`` once it is installed) installs the hooks unless
``TRITONSPEC_DISABLE`` is set to what Triton's boolean knobs take for true (``1``, ``true``, ``yes``,
``on``, ``y``, any case). Nothing here creates a device driver.
"""
from .hooks import HOOKS, Hook, Kind, SpecContractError, SpecError, get_hook
from .identity import BackendInfo
from .kernel_table import LaunchConfig, LaunchConfigError
from .launch import ConfigTable, launch_config
from .registry import REGISTRY, register_spec
from .resolve import (SpecHookError, backend_for_device, current_backend, default_backend, lookup,
                      set_default_backend, spec, spec_func, use_backend, value)

__version__ = "0.1.0"

__all__ = [
    "HOOKS", "Hook", "Kind", "SpecContractError", "SpecError", "SpecHookError", "get_hook", "BackendInfo",
    "LaunchConfig", "LaunchConfigError", "ConfigTable", "launch_config", "REGISTRY", "register_spec",
    "backend_for_device", "current_backend", "default_backend", "lookup", "set_default_backend", "spec", "spec_func", "use_backend", "value",
    "activate", "deactivate",
]


def activate():
    """Install the hook points into the imported (or later imported) stock Triton; idempotent."""
    from .install import activate as _activate
    _activate()


def deactivate():
    """Remove every hook point and injection, restoring Triton's original objects."""
    from .install import deactivate as _deactivate
    _deactivate()


def _disabled() -> bool:
    """``TRITONSPEC_DISABLE`` read as Triton reads its boolean knobs (``triton.knobs.env_bool``); the same
    rule as ``tritonspec_backends.DISABLED``. A value that is neither true nor false is a warning, not a guess."""
    import os
    raw = os.environ.get("TRITONSPEC_DISABLE", "")
    if raw.lower() in ("1", "true", "yes", "on", "y"):
        return True
    if raw.lower() not in ("", "0", "false", "no", "off", "n"):
        import warnings
        warnings.warn(f"TRITONSPEC_DISABLE={raw!r} is neither true (1, true, yes, on, y) nor false (0, false, no, off, "
                      "n, empty): tritonspec stays enabled", RuntimeWarning, stacklevel=2)
    return False


if not _disabled():
    activate()
