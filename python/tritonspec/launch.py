"""Launch parameters for tritonspec kernels, asked of the backend that will run them.

Ops never branch on the backend: they pass their own heuristic as a typed default (a
``LaunchConfig`` of the kernel table) and the backend's ``kernel_config`` hook may override any of
its fields. The override is checked as the default is: an unknown key names the nearest ones, block
sizes are powers of two, counts are in range, and the error names the backend, the kernel and the key.
Overrides are also held to what Triton itself can launch (``limits()``), so ``BLOCK_N=2**40`` fails here,
not deep inside the interpreter or the compiler.

Eager ops call this on every launch that has no launch plan yet, so the result is memoized per
(config type, backend, device, problem) and the memo is dropped whenever the spec registry changes: a
hit is one dict lookup. The device is part of the key because one host may hold GPUs of two
generations.

Backends write their overrides as data, a ``ConfigTable`` keyed by the kernels' names, checked
against the kernel table when the spec is imported: a misspelled or dead kernel name is an error
there, not an entry that silently never applies.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from .specialization.hooks import suggest
from .kernel_table import LaunchConfig, LaunchConfigError, config_types
from .specialization.providers import PROVIDERS
from .specialization.resolve import backend_for_device, lookup

_cache: dict = {}
PROVIDERS.on_change(_cache.clear)
_arch = contextvars.ContextVar("tritonspec_config_arch", default=None)
_arch_listeners: list = []


def on_arch_change(fn) -> None:
    """Call ``fn()`` when ``for_arch`` begins and ends (what holds configs of one arch drops them)."""
    _arch_listeners.append(fn)


@contextlib.contextmanager
def for_arch(arch):
    """Launch configs chosen for ``arch`` (a compile target's, e.g. 80): every backend hook gets
    ``arch=`` in its problem, as if the tensors' device were that part. For offline checks and tests."""
    token = _arch.set(arch)
    for fn in _arch_listeners:
        fn()
    try:
        yield
    finally:
        _arch.reset(token)
        for fn in _arch_listeners:
            fn()


def _with_index(device):
    """``device`` as a torch.device with its index ("cuda" is the current CUDA device, if any)."""
    import torch

    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        try:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        except Exception:  # no such device here (configs asked for offline): keep it without an index
            pass
    return device


def launch_config(config: type[LaunchConfig], device, default, **problem) -> LaunchConfig:
    """``default`` with what the backend for ``device`` specializes for ``config.kernel``.

    ``default`` is a ``config`` instance, or a zero-argument callable building it, called only on a
    miss (so it may depend on nothing but ``problem``). ``problem`` holds hashable facts the choice
    depends on (sizes, dtype names, ...); the backend's hook also gets ``device`` (a torch.device
    with its index), and ``arch`` inside ``for_arch``.
    """
    arch = _arch.get()
    if arch is not None:
        problem["arch"] = arch
    if type(device) is str or device.index is None:  # tensors' devices have their index: not the hot path
        device = _with_index(device)
    backend = backend_for_device(device)
    key = (config, backend, device, *problem.items())
    if not (isinstance(config, type) and issubclass(config, LaunchConfig)):
        raise TypeError(f"launch_config: config must be a LaunchConfig type of the kernel table, got {config!r}")
    if not callable(default):
        key += (default,)
    cfg = _cache.get(key)
    if cfg is None:
        base = default() if callable(default) else default
        if type(base) is not config:
            raise TypeError(
                f"launch_config: the default for {config.kernel!r} must be a {config.__name__}, "
                f"got {type(base).__name__}"
            )
        fn = lookup("kernel_config", backend=backend)
        override = fn(config.kernel, device=device, **problem) if fn is not None else None
        if override:
            where = f"backend {backend!r} kernel_config({config.kernel!r}): "
            base = base.override(override, where=where)
            _check_limits(base, override, where)
        cfg = _cache[key] = base
    return cfg


def limits() -> tuple:
    """(field name prefix, the largest value, why) of what Triton can launch; the first matching prefix applies.

    Lower bounds, powers of two and kernel-specific ranges are the kernel table's types' own checks."""
    from triton.language import TRITON_MAX_TENSOR_NUMEL  # on use: this module loads while triton imports

    return (
        ("BLOCK", TRITON_MAX_TENSOR_NUMEL, "the most elements a Triton tensor holds"),
        ("num_warps", 32, "1024 threads a block, the CUDA and HIP limit, at 32 threads a warp"),
        ("maxnreg", 255, "the most registers a GPU thread can have"),
        ("", 2**31 - 1, "Triton passes launch parameters as int32"),
    )


def _check_limits(cfg: LaunchConfig, changed: dict, where: str) -> None:
    """Each integer ``changed`` sets in ``cfg`` is within what Triton can launch (``limits()``)."""
    for name in changed:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        _, most, why = next(limit for limit in limits() if name.startswith(limit[0]))
        if value > most:
            raise LaunchConfigError(f"{where}{name}={value!r} must be at most {most} ({why})")


@dataclass(frozen=True)
class ConfigTable:
    """A backend's ``kernel_config`` hook as data: kernel name -> ``fn(kernel, *, device, **problem)``.

    Each function returns the fields to override (a dict) or None for the kernel's own default. The
    names are checked against the kernel table when the table is built.

    Example::

        kernel_config = ConfigTable({"rms_norm_fwd": rows, "rms_norm_bwd": rows})
    """

    entries: dict

    def __post_init__(self):
        known = config_types()
        for name, fn in self.entries.items():
            if name not in known:
                raise LaunchConfigError(
                    f"ConfigTable: {name!r} is not a declared kernel{suggest(str(name), known)}; "
                    f"declared: {', '.join(sorted(known))}"
                )
            if not callable(fn):
                raise TypeError(f"ConfigTable: the entry for {name!r} must be a function, got {type(fn).__name__}")

    def __call__(self, kernel: str, *, device=None, **problem):
        fn = self.entries.get(kernel)
        return None if fn is None else fn(kernel, device=device, **problem)
