"""``kernelize``: the huggingface/kernels front end (layer names -> mapping -> layer forward), on our engine.

Behaviour follows kernels' layers.md: a class declares an extension point with
``use_kernel_forward_from_hub(name)``; a mapping ``{name: {device: repo | {Mode: repo}}}`` (scoped by a
ContextVar) says which layer serves it; ``kernelize(model, mode=...)`` rebinds ``forward`` on every
instance. Modes resolve through the fallback table below, CUDA/ROCm entries by the narrowest capability
interval. Two additions: the kernel table's layers are the default mapping for their layer names
(``RMSNorm``, ``SwiGLUMLP``, ``rotary_pos_emb``: the names transformers uses) on every device type
Triton runs on, and untagged modules that a declared kernel recognizes get its layer name inferred
(``infer_layer_names``), because transformers only tags when it accepts the installed ``kernels``
version. MoE experts that transformers dispatches on ``experts_implementation`` keep their forward when they
all get our ``MoEExperts``: the switch selects ours instead, and stays the user's to turn
(:mod:`tritonspec.nn.experts`).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from types import MethodType
from typing import Any, Callable

import torch
from torch import nn

from .. import kernel_table
from ..devices import check_device_type, triton_device_types
from . import engine, experts
from .repository import TritonspecRepository, validate_layer
from .detectors import function_sites, infer_layer_name, tagged_name

logger = logging.getLogger("tritonspec.nn.kernelize")


class Mode(enum.Flag):
    """What the kernelized model is used for. Combine INFERENCE or TRAINING with TORCH_COMPILE using ``|``.

    FALLBACK only appears in mappings: the entry used when no other mode matches (and what a bare repo means).
    """

    _NONE = 0
    FALLBACK = enum.auto()
    TRAINING = enum.auto()
    INFERENCE = enum.auto()
    TORCH_COMPILE = enum.auto()

    def __or__(self, other):
        union = super().__or__(other)
        if Mode.INFERENCE in union and Mode.TRAINING in union:
            raise ValueError("mode: Mode.INFERENCE and Mode.TRAINING are mutually exclusive")
        if Mode.FALLBACK in union and union != Mode.FALLBACK:
            raise ValueError("mode: Mode.FALLBACK cannot be combined with other modes")
        return union


# huggingface/kernels' mode fallback: a training kernel may serve inference (not the reverse), a
# compile-safe kernel may serve eager, FALLBACK last.
MODE_FALLBACK_PRIORITY: dict[Mode, tuple[Mode, ...]] = {
    Mode.INFERENCE: (
        Mode.INFERENCE,
        Mode.INFERENCE | Mode.TORCH_COMPILE,
        Mode.TRAINING,
        Mode.TRAINING | Mode.TORCH_COMPILE,
        Mode.FALLBACK,
    ),
    Mode.INFERENCE | Mode.TORCH_COMPILE: (
        Mode.INFERENCE | Mode.TORCH_COMPILE,
        Mode.TRAINING | Mode.TORCH_COMPILE,
        Mode.FALLBACK,
    ),
    Mode.TRAINING: (Mode.TRAINING, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.FALLBACK),
    Mode.TRAINING | Mode.TORCH_COMPILE: (Mode.TRAINING | Mode.TORCH_COMPILE, Mode.FALLBACK),
}


@dataclass(frozen=True)
class CUDAProperties:
    """Inclusive compute-capability interval, ``major*10+minor`` (75 = sm_75)."""

    min_capability: int
    max_capability: int

    def __post_init__(self):
        for f in ("min_capability", "max_capability"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f}: expected a non-negative int, got {v!r}")
        if self.min_capability > self.max_capability:
            raise ValueError(
                f"min_capability ({self.min_capability}) must be <= max_capability ({self.max_capability})"
            )


@dataclass(frozen=True)
class ROCMProperties(CUDAProperties):
    """Same as :class:`CUDAProperties`, for ROCm devices."""


@dataclass(frozen=True)
class Device:
    """A device type (``"cuda"``, ``"cpu"``, ...) with optional capability bounds (cuda/rocm only)."""

    type: str
    properties: CUDAProperties | None = None

    def __post_init__(self):
        check_device_type("type", self.type)
        p = self.properties
        if p is not None:
            if isinstance(p, ROCMProperties) and self.type != "rocm":
                raise ValueError("properties: ROCMProperties is only supported for 'rocm' devices")
            if type(p) is CUDAProperties and self.type != "cuda":
                raise ValueError("properties: CUDAProperties is only supported for 'cuda' devices")
            if not isinstance(p, CUDAProperties):
                raise ValueError(f"properties: expected CUDAProperties/ROCMProperties, got {type(p).__name__}")


@dataclass
class _Slot:
    lo: int
    hi: int
    modes: dict  # Mode -> repository


# name -> device type -> capability slots (devices without capabilities use one slot [0, maxsize]).
_Mapping = dict[str, dict[str, list[_Slot]]]


@dataclass
class _State:
    """A context's mapping: what was registered, over the kernel table's layers unless dropped."""

    mapping: _Mapping
    defaults: bool = True


def _table_slots(name: str, device_type: str) -> list[_Slot]:
    """The kernel table's default for layer ``name`` on ``device_type``: its hub layer, where Triton runs."""
    kernel = kernel_table.layers().get(name)
    if kernel is None or device_type not in triton_device_types():
        return []
    return [_Slot(0, sys.maxsize, {Mode.FALLBACK: TritonspecRepository(kernel.layer.name)})]


def _slots(name: str, device_type: str) -> list[_Slot]:
    state = _MAPPING.get()
    slots = state.mapping.get(name, {}).get(device_type)
    if slots:
        return slots
    return _table_slots(name, device_type) if state.defaults else []


_MAPPING: ContextVar[_State] = ContextVar("tritonspec_kernel_mapping", default=_State({}))


def _copy(m: _Mapping) -> _Mapping:
    return {
        n: {d: [_Slot(s.lo, s.hi, dict(s.modes)) for s in slots] for d, slots in devs.items()} for n, devs in m.items()
    }


def _insert(current: _Mapping, mapping: dict) -> None:
    if not isinstance(mapping, dict):
        raise TypeError(f"mapping: expected a dict, got {type(mapping).__name__}")
    for name, per_device in mapping.items():
        if not isinstance(per_device, dict):
            raise TypeError(f"mapping[{name!r}]: expected {{device: repository}}, got {type(per_device).__name__}")
        devs = current.setdefault(str(name), {})
        for dev, repos in per_device.items():
            device = Device(type=dev) if isinstance(dev, str) else dev
            if not isinstance(device, Device):
                raise TypeError(f"mapping[{name!r}]: key {dev!r} is not a device type or Device")
            modes = dict(repos) if isinstance(repos, dict) else {Mode.FALLBACK: repos}
            for mode, repo in modes.items():
                if not isinstance(mode, Mode) or (mode not in MODE_FALLBACK_PRIORITY and mode != Mode.FALLBACK):
                    raise ValueError(f"mapping[{name!r}][{device.type!r}]: {mode!r} is not a valid mode")
                if not callable(getattr(repo, "load", None)):
                    raise TypeError(f"mapping[{name!r}][{device.type!r}][{mode}]: {repo!r} has no load()")
            lo, hi = (
                (0, sys.maxsize)
                if device.properties is None
                else (device.properties.min_capability, device.properties.max_capability)
            )
            slots = devs.setdefault(device.type, [])
            for s in slots:
                if (s.lo, s.hi) == (lo, hi):  # same interval: the new registration replaces the old one
                    s.modes = modes
                    break
            else:
                slots.append(_Slot(lo, hi, modes))


def register_kernel_mapping(mapping: dict, inherit_mapping: bool = True) -> None:
    """Add ``mapping`` (``{name: {device: repo | {Mode: repo}}}``) to the current context's mapping.

    ``inherit_mapping=False`` first drops everything, tritonspec's defaults included.
    """
    if not inherit_mapping:
        _MAPPING.set(_State({}, defaults=False))
    _insert(_MAPPING.get().mapping, mapping)


@contextlib.contextmanager
def use_kernel_mapping(mapping: dict, inherit_mapping: bool = True):
    """Use ``mapping`` inside the ``with`` block only (extending the current one unless ``inherit_mapping=False``)."""
    state = _MAPPING.get()
    token = _MAPPING.set(_State(_copy(state.mapping), state.defaults) if inherit_mapping else _State({}, False))
    try:
        _insert(_MAPPING.get().mapping, mapping)
        yield
    finally:
        _MAPPING.reset(token)


def _capability() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _select(name: str, device: Device, mode: Mode):
    """(repo, repo_mode) or (None, reason) for ``name`` on ``device`` in ``mode``."""
    slots = _slots(name, device.type)
    if not slots:
        state = _MAPPING.get()
        if name not in state.mapping and not (state.defaults and name in kernel_table.layers()):
            return None, f"no kernel mapping for layer `{name}`"
        return None, f"no kernel mapping for layer `{name}` on device type `{device.type}`"
    if device.type in ("cuda", "rocm") and any(s.lo != 0 or s.hi != sys.maxsize for s in slots):
        cap = _capability()
        fits = [s for s in slots if s.lo <= cap <= s.hi]
        if not fits:
            return None, f"no kernel mapping for layer `{name}` on `{device.type}` with capability {cap}"
        slot = min(fits, key=lambda s: s.hi - s.lo)  # narrowest interval: the most specialised kernel
    else:
        slot = slots[-1]
    for m in MODE_FALLBACK_PRIORITY[mode]:
        repo = slot.modes.get(m)
        if repo is not None:
            available = getattr(repo, "available", None)
            if available is not None and not available(device.type):
                return None, f"{repo} cannot run on `{device.type}` here"
            return (repo, m), ""
    return None, f"no repository for layer `{name}` usable in mode {mode}"


def replace_kernel_forward_from_hub(cls: type, layer_name: str, condition: Callable[[nn.Module], bool] | None = None):
    """Mark an existing (third-party) class as extensible under ``layer_name``. Prefer the decorator."""
    if not inspect.isclass(cls):
        raise TypeError(f"cls: expected a class, got {cls!r}")
    cls.kernel_layer_name = layer_name
    if condition is not None:
        cls.kernel_condition = staticmethod(condition)


def use_kernel_forward_from_hub(layer_name: str, condition: Callable[[nn.Module], bool] | None = None):
    """Class decorator: declare the class extensible under ``layer_name``; it does not change behaviour.

    On a function it returns a stateless module instance (called like the function) carrying the name, the
    same shape transformers/kernels give ``apply_rotary_pos_emb``.
    """

    def decorate(obj):
        if inspect.isclass(obj):
            replace_kernel_forward_from_hub(obj, layer_name, condition)
            return obj
        if inspect.isfunction(obj):
            return _function_module(obj, layer_name)
        raise TypeError(
            f"use_kernel_forward_from_hub({layer_name!r}) applies to classes or functions, not {type(obj).__name__}"
        )

    return decorate


def _function_module(fn: Callable, layer_name: str) -> nn.Module:
    class Func(nn.Module):
        def forward(self, *args, **kwargs):
            return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    Func.forward.__signature__ = sig.replace(
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *sig.parameters.values()]
    )
    Func.__name__ = Func.__qualname__ = f"Func[{fn.__name__}]"
    Func.kernel_layer_name = layer_name
    return Func()


def _model_device(model: nn.Module) -> Device:
    try:
        p = next(model.parameters())
    except StopIteration:
        raise ValueError("device: cannot infer the device of a model without parameters; pass device=") from None
    t = p.device.type
    if t == "cuda" and getattr(torch.version, "hip", None) is not None:
        t = "rocm"
    return Device(type=t)


_VALIDATED: dict = {}


def _load(repo, reference) -> type:
    key = (repo, reference)
    layer = _VALIDATED.get(key)
    if layer is None:
        layer = repo.load()
        validate_layer(layer, reference, repo=repo)
        _VALIDATED[key] = layer
    return layer


def _check_repo_mode(name, layer, repo, repo_mode):
    # A repo registered explicitly for TRAINING / TORCH_COMPILE must support it: that is a mapping bug.
    if Mode.TRAINING in repo_mode and not getattr(layer, "has_backward", True):
        raise ValueError(f"{repo} is registered for `{name}` in mode {repo_mode} but has no backward")
    if Mode.TORCH_COMPILE in repo_mode and not getattr(layer, "can_torch_compile", False):
        raise ValueError(f"{repo} is registered for `{name}` in mode {repo_mode} but does not support torch.compile")


def kernelize(
    model: nn.Module,
    *,
    mode: Mode,
    device: str | torch.device | Device | None = None,
    use_fallback: bool = True,
    infer_layer_names: bool = True,
) -> nn.Module:
    """Rebind ``forward`` of every extensible layer of ``model`` to the kernel the mapping selects.

    Args:
        model: modified in place and returned.
        mode: INFERENCE or TRAINING, optionally ``| Mode.TORCH_COMPILE``. Run kernelize again to change it.
        device: device type to select kernels for; inferred from the first parameter when omitted.
        use_fallback: when no mapping, device, capability or mode fits, or the layer lacks backward /
            torch.compile support, keep the original forward (True) or raise ValueError (False).
            Loading errors always raise.
        infer_layer_names: give untagged modules that match our layers' contracts (Llama-style RMSNorm,
            SwiGLU MLP, module-level ``apply_rotary_pos_emb``, transformers' fused MoE experts, top-k MoE
            routers) the matching layer name.

    Every replacement is logged at INFO on ``tritonspec.nn.kernelize`` and listed by
    ``tritonspec.nn.report(model)``; ``tritonspec.nn.revert(model)`` undoes them. Where every experts module
    transformers dispatches gets ``MoEExperts``, their forwards stay and ``experts_implementation="tritonspec"``
    is set instead (:class:`tritonspec.nn.experts.Plan`).
    """
    if not isinstance(mode, Mode):
        raise TypeError(f"mode: expected a tritonspec.nn.Mode, got {type(mode).__name__}")
    if mode == Mode.FALLBACK:
        raise ValueError("mode: Mode.FALLBACK can only be used in kernel mappings")
    if Mode.INFERENCE not in mode and Mode.TRAINING not in mode:
        raise ValueError("mode: must contain Mode.INFERENCE or Mode.TRAINING")
    if device is None:
        dev = _model_device(model)
    elif isinstance(device, Device):
        dev = device
    elif isinstance(device, torch.device):
        dev = Device(type=device.type)
    elif isinstance(device, str):
        dev = Device(type=device)
    else:
        raise TypeError(f"device: expected str, torch.device or Device, got {type(device).__name__}")

    def one(
        path: str,
        target: Any,
        label: str,
        name: str,
        reference,
        *,
        shared: bool = False,
        install: Callable | None = None,
        undo_key: tuple | None = None,
        inferred: bool = False,
    ):
        """Select, load, validate and install the layer for one target (a module, or a global function)."""
        undo_key = undo_key or (target, "forward")
        routed = install is None and experts.dispatched(target)  # the experts plan decides how it goes in

        def keep():
            if routed:
                plan.keep(path, target)
            else:
                engine.restore(model, *undo_key)

        cond = getattr(type(target), "kernel_condition", None)
        if cond is not None and not cond(target):
            logger.info("kernelize: %s (%s) skipped by its kernel_condition", path, label)
            return
        choice, reason = _select(name, dev, mode)
        if choice is None:
            if inferred and reason.startswith("no kernel mapping for layer"):
                return  # not declared extensible by its author and nobody asked for it: leave alone quietly
            if not use_fallback:
                raise ValueError(f"kernelize: {path} ({label}): {reason}")
            logger.info("kernelize: %s (%s) keeps its original forward: %s", path, label, reason)
            keep()
            return
        repo, repo_mode = choice
        layer = _load(repo, reference)
        _check_repo_mode(name, layer, repo, repo_mode)
        missing = [
            what
            for what, bad in (
                ("torch.compile", Mode.TORCH_COMPILE in mode and not getattr(layer, "can_torch_compile", False)),
                ("backward", Mode.TRAINING in mode and not getattr(layer, "has_backward", True)),
            )
            if bad
        ]
        if missing:
            if not use_fallback:
                raise ValueError(f"kernelize: {repo} for {path} does not support {' or '.join(missing)} (mode {mode})")
            logger.info(
                "kernelize: %s (%s) keeps its original forward: %s lacks %s support",
                path,
                label,
                repo,
                " and ".join(missing),
            )
            keep()
            return
        kernel = engine.qualname(layer.forward)
        detail = f"{name}, mode {mode}, from {repo} ({repo_mode})"
        if routed:
            plan.choose(path, target, layer.forward, kernel=kernel, detail=detail)
        elif install is not None:
            install(layer, kernel, detail)
        else:
            engine.replace_forward(
                model, target, layer.forward, path=path, kernel=kernel, source="kernelize", detail=detail, shared=shared
            )
        logger.info("kernelize: %s (%s) -> %s [%s]", path or "<root>", label, kernel, detail)

    plan = experts.Plan(model, "kernelize")
    with engine.transaction(model):
        done: set[int] = set()
        for path, module in model.named_modules():
            for fname, func_mod in list(getattr(module, "_kernel_funcs", {}).items()):
                fn_name = tagged_name(func_mod)
                if id(func_mod) not in done and fn_name is not None:
                    done.add(id(func_mod))
                    one(
                        f"{path}._kernel_funcs.{fname}" if path else fname,
                        func_mod,
                        type(func_mod).__name__,
                        fn_name,
                        type(func_mod),
                        shared=True,
                    )
            name, inferred = tagged_name(module), False
            if name is None and infer_layer_names:
                name, inferred = infer_layer_name(module), True
            if name is not None and id(module) not in done:
                done.add(id(module))
                one(path, module, type(module).__name__, name, type(module), inferred=inferred)
        for kernel, pymod, attr, value in function_sites(model):
            where = f"{pymod.__name__}.{attr}"
            if isinstance(value, nn.Module):  # kernels' Func module: patch its forward (a shared object)
                if id(value) not in done and tagged_name(value) is not None:
                    done.add(id(value))
                    one(where, value, type(value).__name__, tagged_name(value), type(value), shared=True)
                continue
            if not infer_layer_names:
                continue
            original = value

            def install(layer, kernel_name, detail, pymod=pymod, attr=attr, where=where):
                # A bound forward of a (stateless) layer instance stands in for the module-level function.
                engine.patch_attr(
                    model,
                    pymod,
                    attr,
                    MethodType(layer.forward, layer()),
                    path=where,
                    kernel=kernel_name,
                    source="kernelize",
                    detail=detail,
                    shared=True,
                )

            one(
                where,
                original,
                f"function {original.__name__}",
                kernel.layer.tag,
                original,
                install=install,
                undo_key=(pymod, attr),
                inferred=True,
            )
        plan.apply()  # last: it may take back earlier calls' changes, which a rollback would not restore
    return model


def mapping_snapshot() -> dict[str, dict[str, list[tuple[int, int, dict[Any, Any]]]]]:
    """The current context's mapping as plain data, the kernel table's defaults included (inspection, tests)."""
    state = _MAPPING.get()
    names = set(state.mapping) | (set(kernel_table.layers()) if state.defaults else set())
    out = {}
    for name in sorted(names):
        devices = set(state.mapping.get(name, {})) | (set(triton_device_types()) if state.defaults else set())
        per = {d: [(s.lo, s.hi, dict(s.modes)) for s in _slots(name, d)] for d in sorted(devices)}
        per = {d: slots for d, slots in per.items() if slots}
        if per:
            out[name] = per
    return out
