"""A post-import hook: runs install functions right after their Triton module finishes executing.

This makes activation safe from inside ``import triton`` (our backends' entry points run during
Triton's backend discovery): a point whose module is not imported yet, or is mid-import, installs
the moment that module is complete.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Calls ``on_imported(name, module)`` after module ``name`` executes, for the names ``wanted(name)``
    says are pending; ``before_find()`` first, on every import (modules mid-import may be complete)."""

    def __init__(self, wanted: Callable[[str], bool], on_imported: Callable, before_find: Callable):
        self.wanted, self.on_imported, self.before_find = wanted, on_imported, before_find

    def find_spec(self, fullname, path, target=None):
        self.before_find()
        if not self.wanted(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            found = finder.find_spec(fullname, path, target)
            if found is not None:
                break
        else:
            return None
        loader = found.loader
        exec_module = loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            self.on_imported(fullname, module)

        loader.exec_module = exec_then_install
        return found


def imported(name: str):
    """``sys.modules[name]`` once it finished executing, else None."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module
