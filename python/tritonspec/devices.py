"""The device vocabulary every front end shares, and the one answer to "are kernels interpreted?".

The registry (LLaMA-Factory's ``DeviceType``), ``kernelize``'s ``Device``, the hub layers, the
kernel repositories and attention all take their device-type names from ``DEVICE_TYPES`` and ask
``triton_runs`` whether tritonspec's kernels can run on a device type here. Which device types
Triton serves is read from the backends' own declarations (``BackendInfo.devices`` of backends
that are not compile-only), plus the CPU through Triton's interpreter.
"""
from __future__ import annotations

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


def torch_device_type(device_type: str) -> str:
    """The torch device type behind a front end's name ("rocm" tensors are "cuda" tensors to torch)."""
    return "cuda" if device_type == "rocm" else device_type


def check_device_type(argument: str, device_type) -> str:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"{argument}: unsupported device type {device_type!r}; supported: {', '.join(DEVICE_TYPES)}")
    return device_type


_declared: tuple = (None, ())  # (registry generation, device types): layers ask on every forward


def triton_device_types() -> tuple[str, ...]:
    """Device types whose tensors tritonspec's kernels run on: those a backend that is not compile-only
    declares (ascend's NPU binaries cannot be launched from here), and cpu."""
    global _declared
    from .registry import REGISTRY
    generation, found = _declared
    if generation != REGISTRY.generation:
        types = {"cpu"}
        for provider in REGISTRY.providers().values():
            if provider.info.runs != "compile-only":
                types.update(provider.info.devices)
        if "cuda" in types:
            types.add("rocm")
        found = tuple(t for t in DEVICE_TYPES if t in types)
        _declared = (REGISTRY.generation, found)
    return found


def triton_runs(device_type: str) -> bool:
    """Whether tritonspec's kernels run on ``device_type`` here (the CPU only through the interpreter)."""
    if device_type == "cpu":
        return interpreting()
    return device_type in triton_device_types()
