"""LLM kernels written once in Triton: forward and backward, autograd-aware.

The op functions are the ones the kernel table declares for the modules of this package (``ops``
of each ``tritonspec.kernel_table.Kernel``): ``rms_norm``, ``add_rms_norm``, ``swiglu``, ``rope``,
``attention``, ... Each is bound here when the package is imported.
"""

import importlib as _importlib

from ..kernel_table import KERNELS as _KERNELS

__all__ = []
for _kernel in _KERNELS.values():
    if _kernel.module.startswith(__name__ + "."):
        _module = _importlib.import_module(_kernel.module)
        for _name in _kernel.ops:
            globals()[_name] = getattr(_module, _name)  # over the submodule of the same name
            __all__.append(_name)
del _kernel, _module, _name
