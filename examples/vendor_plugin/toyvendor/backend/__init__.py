"""The toyvendor Triton backend: the CUDA pipeline for ``GPUTarget("toyvendor", <sm>, 32)`` targets.

Triton imports this package during backend discovery (entry point ``triton.backends: toyvendor``);
nothing here touches a device. Select it with ``tritonspec.use_backend("toyvendor")`` (or
``TRITONSPEC_DEFAULT_BACKEND=toyvendor``); compiles for a toyvendor target get its spec without selection.
"""

import os

# Triton first: imported from here, discovery loads our compiler / driver modules whole (imported
# first from compiler.py, discovery would find that module half-initialized). During discovery
# itself this is a no-op: triton is already in sys.modules.
import triton  # noqa: E402,F401

# TRITONSPEC_DISABLE read as Triton reads its boolean knobs: then no tritonspec module is imported at all.
if os.environ.get("TRITONSPEC_DISABLE", "").lower() not in ("1", "true", "yes", "on", "y"):
    import tritonspec  # noqa: F401  (activates the hooks; safe during Triton's import)
