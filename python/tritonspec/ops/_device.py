"""What the device under a tensor offers a kernel launch: whether Triton can run there, how many cores.

Kept apart from argument checks because it asks the device, not the arguments: persistent grids
size themselves by the number of compute units, and CPU tensors only run through the interpreter.
"""
from __future__ import annotations

import functools

import torch

from ..devices import interpreting

# Persistent grids on devices that do not report a unit count (the CPU interpreter runs programs
# one after another, so a few programs with many rows each is also the fastest choice there).
DEFAULT_COMPUTE_UNITS = 4


@functools.lru_cache(maxsize=None)
def _units(device_type: str, index: int | None) -> int:
    mod = getattr(torch, device_type, None)
    props_fn = getattr(mod, "get_device_properties", None)
    if props_fn is None:
        return DEFAULT_COMPUTE_UNITS
    try:
        props = props_fn(index if index is not None else mod.current_device())
    except Exception:  # no such device or an API without properties: fall back, never crash a launch
        return DEFAULT_COMPUTE_UNITS
    return int(getattr(props, "multi_processor_count", 0) or DEFAULT_COMPUTE_UNITS)


def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors (or the device's equivalent) for sizing persistent grids."""
    if device.type == "cpu":
        return DEFAULT_COMPUTE_UNITS
    return _units(device.type, device.index)


def check_launchable(op: str, name: str, t: torch.Tensor) -> None:
    """CPU tensors work only through the interpreter; say so instead of Triton's pointer error."""
    if t.is_cpu and not interpreting():
        raise ValueError(f"{op}: argument '{name}' is on the CPU; Triton kernels need a GPU tensor, or set "
                         "TRITON_INTERPRET=1 before importing tritonspec to run them in the interpreter")
