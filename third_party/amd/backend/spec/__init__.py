"""AMD spec: compile-only here (hip gfx942 and gfx90a through the stock backend); launch configs only.

No language or compiler hooks: cross-compiling for hip gives exactly stock Triton's IR (tests/lit checks
it). ``kernel_config`` (``configs.py``) fits the ops' tiles to CDNA's 64 KB of LDS and 64-wide wavefronts;
``tritonspec check --kernels`` compiles every kernel with it for both targets and reads the binaries.
"""

from tritonspec import BackendInfo, CheckTarget

from .configs import kernel_config

backend_info = BackendInfo(
    runs="compile-only",
    targets=("hip",),
    devices=("cuda",),
    # LDS per workgroup and VGPRs per lane (arch + accumulation registers), from AMD's CDNA 2 / CDNA 3 ISA guides
    check_targets=(
        CheckTarget("gfx942", ("hip", "gfx942", 64), shared_memory=65536, registers=512, units=304, part="MI300X"),
        CheckTarget(
            "gfx90a", ("hip", "gfx90a", 64), shared_memory=65536, registers=512, units=110, part="MI250X (one GCD)"
        ),
    ),
    note="no AMD GPU here: offline compile to AMDGCN",
)

__all__ = ["backend_info", "kernel_config"]
