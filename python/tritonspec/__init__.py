"""tritonspec: FlagTree-style backend specialization hooks installed into stock Triton.

Importing tritonspec (or any ``import triton`` once it is installed) installs the hooks unless
``TRITONSPEC_DISABLE`` is set to what Triton's boolean knobs take for true (``1``, ``true``, ``yes``,
``on``, ``y``, any case). Nothing here creates a device driver.
"""

from . import deprecated, settings
from .specialization.hooks import HOOKS, Hook, Kind, SpecContractError, SpecError, get_hook
from .specialization.backend_info import BackendInfo, CheckTarget
from .kernel_table import LaunchConfig, LaunchConfigError
from .launch import ConfigTable, launch_config
from .specialization.providers import PROVIDERS, register_spec
from .specialization.resolve import (
    SpecHookError,
    backend_for_device,
    current_backend,
    default_backend,
    lookup,
    set_default_backend,
    spec,
    spec_func,
    use_backend,
    value,
)

__version__ = "0.1.0"

__all__ = [
    "HOOKS",
    "Hook",
    "Kind",
    "SpecContractError",
    "SpecError",
    "SpecHookError",
    "get_hook",
    "BackendInfo",
    "CheckTarget",
    "LaunchConfig",
    "LaunchConfigError",
    "ConfigTable",
    "launch_config",
    "PROVIDERS",
    "register_spec",
    "backend_for_device",
    "current_backend",
    "default_backend",
    "lookup",
    "set_default_backend",
    "spec",
    "spec_func",
    "use_backend",
    "value",
    "activate",
    "deactivate",
]


def activate():
    """Install the hook points into the imported (or later imported) stock Triton; idempotent."""
    from .specialization.install import activate as _activate

    _activate()


def deactivate():
    """Remove every hook point and injection, restoring Triton's original objects."""
    from .specialization.install import deactivate as _deactivate

    _deactivate()


def __getattr__(name):
    from .deprecated import renamed_attribute

    return renamed_attribute(__name__, name)


deprecated.install_module_aliases()
if not settings.DISABLE.get():
    activate()
