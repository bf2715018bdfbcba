"""Iluvatar (CoreX) backend profile, emulated on NVIDIA GPUs: a Triton backend plus its spec.

Triton imports this package during its backend discovery (entry point ``triton.backends:
iluvatar``), so it stays import-light: ``compiler`` and ``driver`` subclass the stock CUDA classes
and nothing touches a device here.

Selecting iluvatar: ``TRITONSPEC_DEFAULT_BACKEND=iluvatar`` (process-wide) or ``with
tritonspec.use_backend("iluvatar")`` selects its spec. Its driver is active only when selected, so
an unselected install never yields "2 active drivers" next to CUDA. When it *is* selected, the
CUDA driver must not also count:
- triton >= 3.7 honours ``TRITON_DEFAULT_BACKEND``; selecting through ``TRITONSPEC_DEFAULT_BACKEND``
  sets it to ``iluvatar`` here (unless already set), so Triton creates only the iluvatar driver;
- triton 3.6 has no such knob: call ``driver.activate()`` (it does
  ``triton.runtime.driver.driver.set_active(IluvatarDriver())``) before the first launch.
"""

import os

# Triton first: imported from here, Triton's backend discovery loads our compiler / driver modules
# whole; imported first from compiler.py, discovery would find that module half-initialized.
# During discovery itself this is a no-op (triton is already in sys.modules).
import triton  # noqa: E402,F401
from tritonspec_backends import DISABLED  # noqa: E402

if not DISABLED:
    import tritonspec  # activates the hooks; safe during Triton's import

    # Triton reads TRITON_DEFAULT_BACKEND when it creates its driver, after discovery.
    if tritonspec.settings.DEFAULT_BACKEND.get() == "iluvatar":
        os.environ.setdefault("TRITON_DEFAULT_BACKEND", "iluvatar")
