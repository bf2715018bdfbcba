"""The one module-replacement engine under all three front ends (registry, kernelize, YAML rules).

Why one engine: each front end only decides *which* module gets *which* kernel. Installing it (rebinding a
``forward``, swapping a child module, setting a module-level function or a config attribute), recording
what changed, and undoing it are the same operation everywhere, so a model patched by several front ends
still reverts exactly, and ``report(model)`` lists every change whichever front end made it.

Changes are recorded per root model (the object the user passed). A change to an object that is not part
of the model (a ``modeling_llama.apply_rotary_pos_emb`` global, the shared ``Func`` module transformers
builds for it) is *shared*: several models may hold it, and the original comes back when the last of them
reverts or is garbage-collected, so no patch outlives the models that made it.

A changed model deep-copies completely: the copy gets a ledger of its own whose entries point at the copy's
modules, so ``revert(copy)`` undoes the copy's changes and leaves the original's alone. Pickling one
(``torch.save(model)``) fails with a ``TypeError``: an unpickled model could not be reverted, and its
replaced forwards would not survive the trip.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import weakref
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable, Iterator

import torch.nn as nn

logger = logging.getLogger("tritonspec.nn")


class _Missing:
    """The attribute was not in the target's own ``__dict__``; one object, kept by copies and pickles."""

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()

# The transformers config switches front ends turn (``Change.what``; the config attribute is ``"_" + what``).
SWITCHES = ("attn_implementation", "experts_implementation")


@dataclass(frozen=True)
class Change:
    """One replacement, as reported to the user.

    ``path``: dotted module path inside the model (``""`` is the root), or the dotted name of a shared
    object outside it. ``what``: ``"forward"``, ``"module"``, ``"attribute"``, or a transformers switch
    (``"attn_implementation"``, ``"experts_implementation"``). ``kernel``: qualified name of what was installed
    (for a switch the user has turned since: the implementation it names now). ``source``: ``"registry"``,
    ``"kernelize"`` or ``"rules"``. ``detail``: front-end specific (kernel type and device, mode, rule index).
    """

    path: str
    what: str
    kernel: str
    source: str
    detail: str = ""

    def __str__(self) -> str:
        where = self.path or "<root>"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{where}: {self.what} -> {self.kernel} [{self.source}{extra}]"


class Report(list):
    """A list of :class:`Change` with a readable ``str`` and small summaries."""

    def paths(self, what: str | None = None) -> list[str]:
        return [c.path for c in self if what is None or c.what == what]

    def counts(self) -> dict[str, int]:
        """How many modules got each kernel, e.g. ``{"tritonspec...RMSNorm.forward": 5}``."""
        out: dict[str, int] = {}
        for c in self:
            out[c.kernel] = out.get(c.kernel, 0) + 1
        return out

    def __str__(self) -> str:
        if not self:
            return "no replacements"
        return "\n".join(str(c) for c in self)


@dataclass
class _Entry:
    change: Change
    target: Any
    attr: str
    original: Any  # _MISSING: the attribute was not in the target's own __dict__ (class attribute in use)
    shared: bool
    # Custom undo (a module swap, the attention switch): a partial over the objects it touches, never a closure,
    # so a deep copy of the model gets one that touches the copy's objects.
    undo: Callable[[], None] | None = None
    set_to: Any = _MISSING  # a transformers switch: the value it was set to (``target.attr`` then)
    note: Callable[[], str] | None = None  # what the change has done since (a partial, as ``undo``)

    def current(self) -> Change:
        """The change as it stands: a switch the user has turned since reports what it names now; a note
        (e.g. the calls our attention left to SDPA) is added to the detail."""
        c = self.change
        now = getattr(self.target, self.attr, _MISSING) if self.set_to is not _MISSING else _MISSING
        if now != self.set_to:
            detail = f"switched to {now!r} since {c.source} set {self.set_to!r}; revert restores the original"
            return Change(c.path, c.what, str(now), c.source, detail)
        extra = self.note() if self.note is not None else ""
        return Change(c.path, c.what, c.kernel, c.source, f"{c.detail}; {extra}") if extra else c


class _Ledger:
    """The changes made to one root model, newest last; lives in the model's ``__dict__``."""

    def __init__(self, model: nn.Module):
        self.entries: list[_Entry] = []
        self.model = weakref.ref(model)

    def find(self, target, attr) -> _Entry | None:
        for e in self.entries:
            if e.target is target and e.attr == attr:
                return e
        return None

    def __deepcopy__(self, memo) -> "_Ledger":
        model = self.model()
        twin = memo.get(id(model)) if model is not None else None
        if twin is None:
            raise TypeError("a tritonspec ledger is copied with its model: copy.deepcopy(model)")
        new = _Ledger(twin)
        memo[id(self)] = new
        for e in self.entries:
            if e.shared:
                # The copy shares the patched object when it lies outside the model (a Python module's function);
                # an object the model's copy holds its own copy of (transformers' Func module) is the copy's.
                target = memo.get(id(e.target), e.target)
                original = e.original if target is e.target else copy.deepcopy(e.original, memo)
                _share(twin, target, e.attr, original)
                new.entries.append(_Entry(e.change, target, e.attr, original, True))
            else:
                new.entries.append(
                    _Entry(
                        e.change,
                        copy.deepcopy(e.target, memo),
                        e.attr,
                        copy.deepcopy(e.original, memo),
                        False,
                        copy.deepcopy(e.undo, memo),
                        copy.deepcopy(e.set_to, memo),
                        copy.deepcopy(e.note, memo),
                    )
                )
        return new

    def __reduce__(self):
        raise TypeError(
            f"cannot pickle a model changed by tritonspec ({len(self.entries)} replacements; "
            "tritonspec.nn.report(model) lists them): revert(model) first, or save model.state_dict()"
        )


# Per root model, in the model's own __dict__: its entries reference the model itself (a replaced root forward,
# the attention switch's undo), so a table keyed by the model, even weakly, would keep every model alive; held
# by the model, the two form a cycle the garbage collector frees with it.
_LEDGER_ATTR = "_tritonspec_ledger"


class _SharedPatch:
    """A patch of an object outside any model: its original and the models holding it."""

    def __init__(self, target: Any, attr: str, original: Any):
        self.target, self.attr, self.original = target, attr, original
        self.owners: dict[int, weakref.ref] = {}  # id(model) -> weakref whose callback drops the owner

    def add(self, model: nn.Module) -> None:
        if id(model) not in self.owners:
            self.owners[id(model)] = weakref.ref(model, functools.partial(_owner_gone, self, id(model)))

    def discard(self, model_id: int) -> None:
        """Forget an owner; the last one gone puts the original back."""
        self.owners.pop(model_id, None)
        if not self.owners and _SHARED.get((id(self.target), self.attr)) is self:
            _write(self.target, self.attr, self.original)
            del _SHARED[(id(self.target), self.attr)]


def _owner_gone(patch: _SharedPatch, model_id: int, _ref) -> None:
    patch.discard(model_id)


# (id(target), attr) -> patch state; the patch holds the target, so the id stays valid.
_SHARED: dict[tuple[int, str], _SharedPatch] = {}


def _share(model: nn.Module, target: Any, attr: str, original: Any) -> Any:
    """Make ``model`` an owner of the shared patch of ``target.attr``; returns the patch's original."""
    held = _SHARED.get((id(target), attr))
    if held is None:
        held = _SHARED[(id(target), attr)] = _SharedPatch(target, attr, original)
    held.add(model)
    return held.original


def shared_original(target: Any, attr: str, default: Any = None) -> Any:
    """What ``target.attr`` was before any front end patched it as a shared object (``default`` if unpatched)."""
    held = _SHARED.get((id(target), attr))
    if held is None or held.original is _MISSING:
        return default
    return held.original


def _ledger(model: nn.Module, create: bool = True) -> _Ledger | None:
    led = model.__dict__.get(_LEDGER_ATTR)
    if led is None and create:
        led = model.__dict__[_LEDGER_ATTR] = _Ledger(model)
    return led


def _own(target, attr):
    d = getattr(target, "__dict__", None)
    if d is not None and attr in d:
        return d[attr]
    return _MISSING


def _write(target, attr, value):
    if value is _MISSING:
        # Drop the instance attribute so the class attribute (the original method) shows through again.
        if attr in getattr(target, "__dict__", {}):
            delattr(target, attr)
    else:
        setattr(target, attr, value)


def patch_attr(
    model: nn.Module,
    target: Any,
    attr: str,
    value: Any,
    *,
    path: str,
    what: str = "attribute",
    kernel: str,
    source: str,
    detail: str = "",
    shared: bool = False,
) -> Change:
    """Set ``target.attr = value`` for ``model`` and record how to undo it.

    Patching the same (target, attr) again keeps the first original, so ``revert`` always restores the
    state from before any front end touched it. ``shared=True`` marks objects outside the model tree.
    """
    led = _ledger(model)
    change = Change(path, what, kernel, source, detail)
    entry = led.find(target, attr)
    if entry is not None:
        entry.change = change
        _write(target, attr, value)
        return change
    if shared:
        original = _share(model, target, attr, _own(target, attr))
    else:
        original = _own(target, attr)
    _write(target, attr, value)
    led.entries.append(_Entry(change, target, attr, original, shared))
    return change


def replace_forward(
    model: nn.Module,
    module: nn.Module,
    fn: Callable,
    *,
    path: str,
    kernel: str,
    source: str,
    detail: str = "",
    shared: bool = False,
) -> Change:
    """Bind ``fn`` as ``module.forward`` (an instance attribute; the class is untouched)."""
    return patch_attr(
        model,
        module,
        "forward",
        MethodType(fn, module),
        path=path,
        what="forward",
        kernel=kernel,
        source=source,
        detail=detail,
        shared=shared,
    )


def replace_module(
    model: nn.Module,
    path: str,
    new: nn.Module,
    *,
    kernel: str,
    source: str,
    detail: str = "",
    parent: nn.Module | None = None,
) -> Change:
    """Put ``new`` at dotted ``path``: as child ``path.rsplit('.')[-1]`` of ``parent``, by default the
    module found at the parent path in the live tree. Undoing it calls ``new.release()`` if it has one."""
    if not path:
        raise ValueError("cannot replace the root module in place; match one of its submodules")
    parent_path, _, name = path.rpartition(".")
    if parent is None:
        parent = model.get_submodule(parent_path) if parent_path else model
    led = _ledger(model)
    change = Change(path, "module", kernel, source, detail)
    entry = led.find(parent, name)
    old = parent._modules[name]
    setattr(parent, name, new)
    if entry is not None:
        entry.change = change
    else:
        led.entries.append(
            _Entry(change, parent, name, old, False, undo=functools.partial(_put_back, parent, name, old, new))
        )
    return change


def _put_back(parent: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    setattr(parent, name, old)
    release = getattr(new, "release", None)
    if callable(release):
        release()


def record_custom(
    model: nn.Module,
    target: Any,
    key: str,
    undo: Callable[[], None],
    *,
    path: str,
    what: str,
    kernel: str,
    source: str,
    detail: str = "",
    note: Callable[[], str] | None = None,
) -> Change:
    """Record a change made by the caller through an API (e.g. ``set_attn_implementation``).

    ``undo`` runs on revert. Recording the same (target, key) twice keeps the first ``undo``. Pass a
    ``functools.partial`` of a function over the objects it restores, not a closure: a deep copy of the model
    then gets an undo that restores the copy's objects.

    A transformers switch (``what`` in :data:`SWITCHES`, ``key`` the config attribute it sets, recorded after
    setting it) is a value the user may turn again: :func:`report` reads ``target.key`` when it is built, so it
    never claims ours runs after the user switched away. ``note`` (a partial, as ``undo``), when it returns text,
    is added to the change's detail in every report.
    """
    led = _ledger(model)
    change = Change(path, what, kernel, source, detail)
    set_to = getattr(target, key, _MISSING) if what in SWITCHES else _MISSING
    entry = led.find(target, key)
    if entry is not None:
        entry.change, entry.set_to, entry.note = change, set_to, note
    else:
        led.entries.append(_Entry(change, target, key, None, False, undo=undo, set_to=set_to, note=note))
    return change


def recorded(model: nn.Module, target: Any, attr: str) -> Change | None:
    """The change recorded for ``target.attr`` on ``model`` (as :func:`report` shows it), or None."""
    led = _ledger(model, create=False)
    entry = led.find(target, attr) if led is not None else None
    return entry.current() if entry is not None else None


def _undo(model: nn.Module, e: _Entry) -> None:
    if e.undo is not None:
        e.undo()
        return
    if e.shared:
        held = _SHARED.get((id(e.target), e.attr))
        if held is not None:
            held.discard(id(model))
        return
    _write(e.target, e.attr, e.original)


def restore(model: nn.Module, target: Any, attr: str = "forward") -> bool:
    """Undo one recorded change (e.g. kernelize falling back to the original forward). True if one existed."""
    led = _ledger(model, create=False)
    entry = led.find(target, attr) if led is not None else None
    if entry is None:
        return False
    _undo(model, entry)
    led.entries.remove(entry)
    return True


def report(model: nn.Module) -> Report:
    """Every change currently installed on ``model``, in the order it was made; a transformers switch as it
    stands now (see :func:`record_custom`)."""
    led = _ledger(model, create=False)
    return Report(e.current() for e in led.entries) if led is not None else Report()


def revert(model: nn.Module) -> Report:
    """Undo every change on ``model`` (newest first) and return what was undone.

    Parameters are never copied by any front end, so trained weights survive a revert.
    """
    led = model.__dict__.pop(_LEDGER_ATTR, None)
    if led is None:
        return Report()
    for e in reversed(led.entries):
        _undo(model, e)
    return Report(e.change for e in led.entries)


@contextlib.contextmanager
def transaction(model: nn.Module) -> Iterator[Report]:
    """All-or-nothing: if the body raises, changes it made to ``model`` are undone before re-raising.

    Yields a report that is filled with the changes made inside the block.
    """
    led = _ledger(model)
    start = len(led.entries)
    before = {id(e): e.change for e in led.entries}
    made = Report()
    try:
        yield made
    except BaseException:
        for e in reversed(led.entries[start:]):
            _undo(model, e)
        del led.entries[start:]
        raise
    # Entries updated in place (re-patch of a known target) count as made here too.
    for e in led.entries:
        if id(e) not in before or before[id(e)] is not e.change:
            made.append(e.change)


def iter_modules(
    model: nn.Module, prune: Callable[[str, nn.Module], bool] | None = None
) -> Iterator[tuple[str, nn.Module]]:
    """Pre-order walk of submodules (not the root) as (dotted path, module).

    ``prune(path, module)`` returning True stops the walk below that module (YAML ``recursive: false``).
    Shared submodules are visited once, like ``named_modules``.
    """
    seen: set[int] = set()

    def walk(prefix: str, mod: nn.Module):
        for name, child in mod._modules.items():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}.{name}" if prefix else name
            yield path, child
            if prune is None or not prune(path, child):
                yield from walk(path, child)

    yield from walk("", model)


def qualname(obj: Any) -> str:
    """``module.QualName`` of a function, class or bound method, for reports and logs."""
    obj = getattr(obj, "__func__", obj)
    mod = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{mod}.{name}"
