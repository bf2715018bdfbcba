"""Ascend NPU backend: compile-only here, registered through Triton's ``triton.backends`` entry point.

Triton imports this package during its backend discovery, so it stays import-light; the driver
is active only where ``torch_npu`` finds an NPU (never on our machines).
"""

# Triton first: imported from here, Triton's backend discovery loads our compiler / driver modules
# whole; imported first from compiler.py, discovery would find that module half-initialized.
# During discovery itself this is a no-op (triton is already in sys.modules).
import triton  # noqa: F401
from tritonspec_backends import DISABLED

if not DISABLED:
    import tritonspec  # noqa: F401  (activates the hooks; safe during Triton's import)
