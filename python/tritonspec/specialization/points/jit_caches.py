"""The per-selection JIT caches: a kernel compiled under one spec selection is never launched under another."""

from __future__ import annotations

import collections
import collections.abc
import functools

from ..resolve import selection_key
from . import InstallPoint, patch


class SelectionCaches(collections.abc.Mapping):
    """A JITFunction's ``device_caches``, kept per spec selection (``resolve.selection_key``).

    A kernel compiled while one thread selects a backend must never be launched for another thread
    with another selection; stock Triton keys its in-memory cache by device only. Reads (Triton's
    ``device_caches[device]``, torch's ``.keys()`` / ``.values()``) see the current selection's caches.
    """

    def __init__(self, factory):
        self._factory = factory
        self._by_selection: dict = {}

    def _current(self) -> dict:
        key = selection_key()
        caches = self._by_selection.get(key)
        if caches is None:
            # caches of an older registry generation can never be selected again: let them go
            self._by_selection = {k: v for k, v in self._by_selection.items() if k[1] == key[1]}
            caches = self._by_selection[key] = collections.defaultdict(self._factory)
        return caches

    def __getitem__(self, device):
        return self._current()[device]

    def __iter__(self):
        return iter(self._current())

    def __len__(self):
        return len(self._current())


def _install_jit(jit):
    cls = jit.JITFunction
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.device_caches = SelectionCaches(self.create_binder)

    patch(cls, "__init__", __init__)


POINTS = (
    InstallPoint(
        "runtime.jit",
        "triton.runtime.jit",
        _install_jit,
        doc="JITFunction: in-memory caches separated per spec selection",
    ),
)
