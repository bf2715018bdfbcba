"""Hook points: where the declared hooks (``hooks.HOOKS``) go into the stock ``triton`` package.

One module per area (``language``, ``compiler``, ``runtime``, ``jit_caches``, ``interpreter``), each
declaring its ``POINTS`` beside the code that installs them. An ``InstallPoint`` names the Triton
module it patches and the Triton versions it applies to; its install function records every original
it replaces in ``PATCHES``, so deactivating restores stock Triton exactly. Upgrading Triton means
re-validating these tables: ``tritonspec check`` reports every point that could not apply.

All hooks act at compile (trace) time or on compile-cache misses. Per launch there is one thing:
a JIT function's in-memory cache is looked up under the current spec selection (``jit_caches``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from .. import inject
from ..patches import PatchLog
from ..resolve import active_provider

LOCK = threading.RLock()  # installs and uninstalls, and the host-compiler switch
PATCHES = PatchLog()
patch = PATCHES.set


@dataclass(frozen=True)
class InstallPoint:
    name: str  # matches Hook.point in hooks.py
    module: str  # the stock Triton module it patches
    install: Callable
    min_version: tuple[int, int] = (3, 4)  # TritonSemantic / entry-point backends arrived in 3.4
    doc: str = ""


def injecting_spec():
    """The spec module whose tl injections code running now must see (None: stock tl)."""
    provider = active_provider()
    return provider.module if provider is not None and inject.has_injections(provider.module) else None
