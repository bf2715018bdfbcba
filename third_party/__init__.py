"""tritonspec's vendor backends (``third_party/<vendor>/``), installed as ``tritonspec_backends``.

Triton's backend discovery imports the Triton backends declared here (iluvatar, ascend) through
its ``triton.backends`` entry points, and those imports activate tritonspec. With
``TRITONSPEC_DISABLE`` true (``tritonspec.settings``) the layer must leave Triton exactly stock, yet
discovery imports these packages anyway: ``leave_triton_stock`` then takes them back out as soon as discovery is over
(their entries in ``triton.backends.backends``, those of out-of-tree vendors of this layer too, and
the ``tritonspec*`` modules discovery imported).
"""

import os
import sys

# The one reading of a setting outside tritonspec.settings: whether to import tritonspec at all is
# decided before importing it (an out-of-tree vendor's backend must load with no tritonspec module).
# Same rule as settings.DISABLE (tests/test_spec_providers.py checks the two agree on every spelling).
DISABLED = os.environ.get("TRITONSPEC_DISABLE", "").lower() in ("1", "true", "yes", "on", "y")


class _AfterDiscovery:
    """A meta-path finder that acts on the first import after ``triton.backends`` has finished.

    The tritonspec modules a user imported before Triton (``tritonspec check`` does, with the layer
    disabled) stay: only what discovery brought in goes."""

    def __init__(self):
        self.kept = {m for m in sys.modules if m.split(".")[0] == "tritonspec"}

    def find_spec(self, fullname, path=None, target=None):
        backends = sys.modules.get("triton.backends")
        if backends is None or not hasattr(backends, "backends") or fullname.startswith("tritonspec"):
            return None
        sys.meta_path.remove(self)
        # Ours, and those of out-of-tree vendors of this layer (packages with a tritonspec.specs entry point).
        from importlib.metadata import entry_points

        vendors = {__name__} | {ep.value.split(".")[0] for ep in entry_points(group="tritonspec.specs")}
        for name, backend in list(backends.backends.items()):
            if backend.compiler.__module__.split(".")[0] in vendors:
                del backends.backends[name]
        for name in [m for m in sys.modules if m.split(".")[0] in ("tritonspec", __name__) and m not in self.kept]:
            del sys.modules[name]
        return None


def leave_triton_stock() -> None:
    """Called while Triton discovers backends with the layer disabled (idempotent)."""
    if not any(isinstance(f, _AfterDiscovery) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDiscovery())


if DISABLED:
    leave_triton_stock()
