"""What a backend says about itself, declared once in its own spec module (``backend_info``).

The core never spells a vendor's names: which Triton compile targets a spec applies to, which
torch device types its kernels serve, what ``tritonspec check`` compiles for it, and whether it
really runs here are read from these declarations, for in-tree and out-of-tree backends alike.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

RUNS = {
    "real": "runs on the hardware it names",
    "emulated": "runs as another device's profile (its limits, another device's hardware)",
    "compile-only": "compiles offline; nothing here can run its binaries",
    "unknown": "declares nothing (e.g. a FlagTree-style driver.spec module)",
}


@dataclass(frozen=True)
class CheckTarget:
    """A compile target ``tritonspec check`` builds for, and what one program may use there.

    The limits are the vendor's own statement of its hardware; ``tritonspec check --kernels`` compiles every
    kernel of the kernel table for the target and compares each binary with them. A limit left None is
    not checked (a TTIR-only target has no binary to read).

    Args:
        name: how tables name it (``sm90``, ``gfx942``).
        target: ``GPUTarget``'s arguments: (backend, arch, warp_size).
        shared_memory: bytes of shared memory (LDS) one program may use: the opt-in maximum per block.
        registers: registers one thread may use.
        scratch: bytes of per-thread scratch (register spills, stack) tolerated; None reports it only.
        units: streaming multiprocessors (compute units) of the part, which sizes persistent grids.
        part: the hardware these numbers describe.

    Example::

        CheckTarget("sm90", ("cuda", 90, 32), shared_memory=232448, registers=255, units=132, part="H100")
    """

    name: str
    target: tuple
    shared_memory: int | None = None
    registers: int | None = None
    scratch: int | None = None
    units: int | None = None
    part: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"CheckTarget: name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.target, tuple) or len(self.target) != 3:
            raise TypeError(
                f"CheckTarget {self.name!r}: target must be GPUTarget's (backend, arch, warp_size), got {self.target!r}"
            )
        for field in ("shared_memory", "registers", "scratch", "units"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise TypeError(f"CheckTarget {self.name!r}: {field} must be an int >= 0 or None, got {value!r}")


@dataclass(frozen=True)
class BackendInfo:
    """A backend's identity, as its spec module declares it.

    Args:
        runs: one of ``RUNS``: where this backend's kernels really execute.
        targets: Triton target names (``GPUTarget.backend``) whose compiles use this spec.
        devices: torch device types whose tensors this backend's kernels run on; ``cpu`` means
            Triton's interpreter. Two backends may share a device type only when their targets
            tell them apart (``cuda`` tensors are a ``cuda`` or ``hip`` target by torch's build).
        check_targets: the ``CheckTarget`` s ``tritonspec check`` compiles for (the first one for the
            sample kernels; all of them, with their limits, for ``--kernels``).
        check_target: deprecated: one target's ``GPUTarget(...)`` arguments, without limits.
        note: one line on what ``runs`` means for this backend.

    Example::

        backend_info = BackendInfo(
            runs="emulated", targets=("toyvendor",), check_targets=(CheckTarget("toy90", ("toyvendor", 90, 32)),)
        )
    """

    runs: str = "unknown"
    targets: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    check_targets: tuple[CheckTarget, ...] = ()
    note: str = ""
    check_target: tuple | None = None

    def __post_init__(self):
        if self.runs not in RUNS:
            raise ValueError(f"BackendInfo: runs must be one of {', '.join(RUNS)}, got {self.runs!r}")
        for name in ("targets", "devices"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise TypeError(f"BackendInfo: {name} must be a tuple of names, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.check_target is not None:
            warnings.warn(
                "BackendInfo(check_target=...) is deprecated: declare check_targets=(CheckTarget(name, target, ...),) "
                "with the target's limits",
                FutureWarning,
                stacklevel=3,
            )
            arch = self.check_target[1] if isinstance(self.check_target, tuple) and len(self.check_target) > 1 else ""
            old = CheckTarget(str(arch) or "target", self.check_target)
            object.__setattr__(self, "check_targets", (*self.check_targets, old))
        if not isinstance(self.check_targets, tuple) or not all(isinstance(t, CheckTarget) for t in self.check_targets):
            raise TypeError(f"BackendInfo: check_targets must be a tuple of CheckTarget, got {self.check_targets!r}")
