"""AMD spec: compile-only here (hip gfx942 through the stock backend), specializing nothing.

Registered so ``tritonspec check`` lists the backend and compiles its sample kernels for gfx942,
and so cross-compiling for hip resolves to an (empty) spec set instead of another backend's: the
IR must be exactly stock Triton's, which tests/lit checks.
"""

from tritonspec import BackendInfo

backend_info = BackendInfo(
    runs="compile-only",
    targets=("hip",),
    devices=("cuda",),
    check_target=("hip", "gfx942", 64),
    note="no AMD GPU here: offline compile to AMDGCN",
)

__all__ = ["backend_info"]
