"""The device vocabulary every front end shares, the one answer to "are kernels interpreted?", and what
a device offers a kernel launch (compute units for persistent grids).

The registry (LLaMA-Factory's ``DeviceType``), ``kernelize``'s ``Device``, the hub layers, the
kernel repositories and attention all take their device-type names from ``DEVICE_TYPES`` and ask
``triton_runs`` whether tritonspec's kernels can run on a device type here. Which device types
Triton serves is read from the backends' own declarations (``BackendInfo.devices`` of backends
that are not compile-only), plus the CPU through Triton's interpreter.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch's device types, plus "rocm": huggingface/kernels' name for a CUDA device on a ROCm build.
DEVICE_TYPES = ("cpu", "cuda", "rocm", "xpu", "npu", "mps", "neuron", "tpu")

_interpreting: bool | None = None


def interpreting() -> bool:
    """True when Triton builds interpreted kernels in this process (``TRITON_INTERPRET``).

    Read once, as ``@triton.jit`` reads it when kernels are defined (and torch.compile cannot trace
    Triton's knob descriptors): flipping the variable later changes neither.
    """
    global _interpreting
    if _interpreting is None:
        from triton import knobs

        _interpreting = bool(knobs.runtime.interpret)
    return _interpreting


def check_device_type(argument: str, device_type) -> str:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"{argument}: unsupported device type {device_type!r}; supported: {', '.join(DEVICE_TYPES)}")
    return device_type


_declared: tuple = (None, ())  # (registry generation, device types): layers ask on every forward


def triton_device_types() -> tuple[str, ...]:
    """Device types whose tensors tritonspec's kernels run on: those a backend that is not compile-only
    declares (ascend's NPU binaries cannot be launched from here), and cpu."""
    global _declared
    from .specialization.providers import PROVIDERS

    generation, found = _declared
    if generation != PROVIDERS.generation:
        types = {"cpu"}
        for provider in PROVIDERS.providers().values():
            if provider.info.runs != "compile-only":
                types.update(provider.info.devices)
        if "cuda" in types:
            types.add("rocm")
        found = tuple(t for t in DEVICE_TYPES if t in types)
        _declared = (PROVIDERS.generation, found)
    return found


def triton_runs(device_type: str) -> bool:
    """Whether tritonspec's kernels run on ``device_type`` here (the CPU only through the interpreter)."""
    if device_type == "cpu":
        return interpreting()
    return device_type in triton_device_types()


# Persistent grids on devices that do not report a unit count (the CPU interpreter runs programs
# one after another, so a few programs with many rows each is also the fastest choice there).
DEFAULT_COMPUTE_UNITS = 4


@functools.lru_cache(maxsize=None)
def _units(device_type: str, index: int | None) -> int:
    import torch  # on use: resolving a spec (which reads this module) never imports torch

    mod = getattr(torch, device_type, None)
    props_fn = getattr(mod, "get_device_properties", None)
    if props_fn is None:
        return DEFAULT_COMPUTE_UNITS
    try:
        props = props_fn(index if index is not None else mod.current_device())
    except Exception:  # no such device or an API without properties: fall back, never crash a launch
        return DEFAULT_COMPUTE_UNITS
    return int(getattr(props, "multi_processor_count", 0) or DEFAULT_COMPUTE_UNITS)


# The compute units meta tensors stand for: set while kernels are recorded for a compile target offline.
META_COMPUTE_UNITS = DEFAULT_COMPUTE_UNITS


def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors (or the device's equivalent) for sizing persistent grids."""
    if device.type == "cpu":
        return DEFAULT_COMPUTE_UNITS
    if device.type == "meta":
        return META_COMPUTE_UNITS
    return _units(device.type, device.index)


def check_launchable(op: str, name: str, t: torch.Tensor) -> None:
    """CPU tensors work only through the interpreter; say so instead of Triton's pointer error."""
    if t.is_cpu and not interpreting():
        raise ValueError(
            f"{op}: argument '{name}' is on the CPU; Triton kernels need a GPU tensor, or set "
            "TRITON_INTERPRET=1 before importing tritonspec to run them in the interpreter"
        )
