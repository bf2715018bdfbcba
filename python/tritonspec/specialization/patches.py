"""A log of attribute replacements that can be undone exactly, newest first.

Used for both the hook points (install.py) and the tl injections (inject.py): "deactivating
restores the exact original objects" is this class's one job.
"""

from __future__ import annotations

_MISSING = object()


class PatchLog:
    def __init__(self):
        self._entries: list[tuple[object, str, object]] = []

    def set(self, owner, attr: str, value, original=_MISSING) -> None:
        """``owner.attr = value``, remembering what was there (a class's own attribute, not an inherited one)."""
        if original is _MISSING:
            original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
        self._entries.append((owner, attr, original))
        setattr(owner, attr, value)

    def touched(self, owner, attr: str) -> bool:
        return any(o is owner and a == attr for o, a, _ in self._entries)

    def undo(self) -> None:
        while self._entries:
            owner, attr, original = self._entries.pop()
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    def __len__(self):
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)
