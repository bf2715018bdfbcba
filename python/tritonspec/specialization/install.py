"""Activating the layer: every hook point installed into stock Triton, and all of it undone exactly.

Points (``points``) install when their Triton module finishes importing (``import_hook``), so
activating works before, during and after ``import triton``. A point that cannot apply never breaks
the import: its outcome is in ``STATUS``, which ``tritonspec check`` reports.
"""

from __future__ import annotations

import sys

from . import inject
from .import_hook import PostImportFinder, imported
from .points import LOCK, PATCHES, InstallPoint, compiler, interpreter, jit_caches, language, runtime
from .providers import PROVIDERS
from .resolve import on_selection_change

_active = False
# every area's points, in install order
INSTALL_POINTS: tuple[InstallPoint, ...] = (
    language.POINTS + compiler.POINTS + runtime.POINTS + jit_caches.POINTS + interpreter.POINTS
)

# outcome per point: "installed", "pending" (module not imported yet), "n/a: ..." or "failed: ..."
STATUS: dict[str, str] = {}


def _version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def _run(point: InstallPoint, module) -> None:
    with LOCK:
        if not _active or STATUS.get(point.name) == "installed":
            return
        try:
            if _version() < point.min_version:
                STATUS[point.name] = f"n/a: needs triton >= {'.'.join(map(str, point.min_version))}"
                return
            point.install(module)
            STATUS[point.name] = "installed"
        except Exception as e:  # never break `import triton`: report through `tritonspec check`
            STATUS[point.name] = f"failed: {type(e).__name__}: {e}"


def _pending(module_name: str) -> list[InstallPoint]:
    return [p for p in INSTALL_POINTS if p.module == module_name and STATUS.get(p.name) == "pending"]


def _install_imported(module_name: str, module) -> None:
    for point in _pending(module_name):
        _run(point, module)


def _install_ready() -> None:
    for point in INSTALL_POINTS:
        if STATUS.get(point.name) == "pending":
            module = imported(point.module)
            if module is not None:
                _run(point, module)


def _apply_ambient_injections() -> None:
    """On a change of providers or selection: the ambient backend's tl injections, while active."""
    if _active:
        language.apply_ambient_injections()


_finder = PostImportFinder(lambda name: bool(_pending(name)), _install_imported, _install_ready)


def activate() -> None:
    global _active
    with LOCK:
        if _active:
            return
        _active = True
        for point in INSTALL_POINTS:
            STATUS[point.name] = "pending"
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        _install_ready()
        PROVIDERS.on_change(_apply_ambient_injections)
        on_selection_change(_apply_ambient_injections)


def deactivate() -> None:
    global _active
    with LOCK:
        if not _active:
            return
        inject.restore()
        PATCHES.undo()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        STATUS.clear()
        _active = False


def is_active() -> bool:
    return _active
