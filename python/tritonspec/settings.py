"""Every ``TRITONSPEC_*`` setting, declared once, typed, with its default: read here and nowhere else.

Modelled on Triton's ``knobs.py``: a setting is an environment variable with a parser and a
documented default, read when it is asked for (``DISABLE.get()``). Booleans take what Triton's
``env_bool`` takes (``1 true yes on y`` / ``0 false no off n``, any case); anything else is a
warning and the default, never a guess. A renamed variable keeps its old spelling working, with a
``FutureWarning`` naming the new one. Vendors declare their own settings the same way, in their
own backend package (ascend's ``TRITONSPEC_ASCEND_*``).
"""

from __future__ import annotations

import os
import warnings
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n", "")


class Setting(Generic[T]):
    """One environment variable: ``name``, its former spellings, its default and what it does."""

    def __init__(self, name: str, default: T, doc: str, *, renamed_from: tuple[str, ...] = ()):
        self.name, self.default, self.doc, self.renamed_from = name, default, doc, renamed_from
        ALL[name] = self

    def raw(self) -> str | None:
        """The variable's text: its own name first, then a former spelling (with a warning)."""
        value = os.environ.get(self.name)
        if value is not None:
            return value
        for old in self.renamed_from:
            value = os.environ.get(old)
            if value is not None:
                warnings.warn(
                    f"{old} is renamed {self.name}; the old spelling still works but will be removed",
                    FutureWarning,
                    stacklevel=3,
                )
                return value
        return None

    def shown(self) -> str:
        """``NAME='value'`` as set, for error messages (the spelling the user actually set)."""
        for name in (self.name, *self.renamed_from):
            if name in os.environ:
                return f"{name}={os.environ[name]!r}"
        return f"{self.name} (unset)"

    def get(self) -> T:
        raise NotImplementedError


class env_bool(Setting[bool]):
    def get(self) -> bool:
        raw = self.raw()
        if raw is None:
            return self.default
        if raw.lower() in _TRUE:
            return True
        if raw.lower() not in _FALSE:
            warnings.warn(
                f"{self.name}={raw!r} is neither true ({', '.join(_TRUE)}) nor false (0, false, no, off, n, "
                f"empty): using the default, {self.default}",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.default
        return False


class env_str(Setting[str | None]):
    def get(self) -> str | None:
        raw = self.raw()
        return self.default if raw is None or raw == "" else raw


ALL: dict[str, Setting] = {}

DISABLE = env_bool(
    "TRITONSPEC_DISABLE",
    False,
    "leave Triton exactly stock: importing tritonspec (or Triton's backend discovery) installs no hook",
)
DEFAULT_BACKEND = env_str(
    "TRITONSPEC_DEFAULT_BACKEND",
    None,
    "the backend whose spec is selected process-wide at start (as set_default_backend)",
    renamed_from=("TRITONSPEC_BACKEND",),
)
ALLOWED_BACKENDS = env_str(
    "TRITONSPEC_ALLOWED_BACKENDS",
    None,
    "allow-list of spec providers, 'name' or 'name=distribution', comma-separated (unset: all)",
    renamed_from=("TRITONSPEC_BACKENDS",),
)
CACHED_LAUNCH = env_bool(
    "TRITONSPEC_CACHED_LAUNCH",
    True,
    "eager GPU launches reuse the compiled kernel without Triton's per-call binding (read at import)",
)
LOCAL_KERNELS = env_str(
    "TRITONSPEC_LOCAL_KERNELS", None, "'repo_id=path:...': local checkouts LayerRepository loads instead of downloading"
)
