"""What a backend says about itself, declared once in its own spec module (``backend_info``).

The core never spells a vendor's names: which Triton compile targets a spec applies to, which
torch device types its kernels serve, what ``tritonspec check`` compiles for it, and whether it
really runs here are read from these declarations, for in-tree and out-of-tree backends alike.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNS = {
    "real": "runs on the hardware it names",
    "emulated": "runs as another device's profile (its limits, another device's hardware)",
    "compile-only": "compiles offline; nothing here can run its binaries",
    "unknown": "declares nothing (e.g. a FlagTree-style driver.spec module)",
}


@dataclass(frozen=True)
class BackendInfo:
    """A backend's identity, as its spec module declares it.

    Args:
        runs: one of ``RUNS``: where this backend's kernels really execute.
        targets: Triton target names (``GPUTarget.backend``) whose compiles use this spec.
        devices: torch device types whose tensors this backend's kernels run on; ``cpu`` means
            Triton's interpreter. Two backends may share a device type only when their targets
            tell them apart (``cuda`` tensors are a ``cuda`` or ``hip`` target by torch's build).
        check_target: the ``GPUTarget(...)`` arguments ``tritonspec check`` compiles samples for.
        note: one line on what ``runs`` means for this backend.

    Example::

        backend_info = BackendInfo(runs="emulated", targets=("toyvendor",), check_target=("toyvendor", 90, 32))
    """

    runs: str = "unknown"
    targets: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    check_target: tuple | None = None
    note: str = ""

    def __post_init__(self):
        if self.runs not in RUNS:
            raise ValueError(f"BackendInfo: runs must be one of {', '.join(RUNS)}, got {self.runs!r}")
        for name in ("targets", "devices"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise TypeError(f"BackendInfo: {name} must be a tuple of names, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.check_target is not None and (not isinstance(self.check_target, tuple) or len(self.check_target) != 3):
            raise TypeError(
                f"BackendInfo: check_target must be GPUTarget's (backend, arch, warp_size), got {self.check_target!r}"
            )
