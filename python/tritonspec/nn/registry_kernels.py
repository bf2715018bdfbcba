"""The kernel table's kernels as registry kernels (LLaMA-Factory style), and discovering and applying them.

One class per (kernel, device type Triton runs on), named ``<Device>Triton<Layer>Kernel`` after the
kernel's layer (``CudaTritonRMSNormKernel``, ``CpuTritonSwiGLUMLPKernel``, ``CudaTritonRotaryPosEmbKernel``,
``CudaTritonMoEExpertsKernel``, ``CudaTritonMoERouterKernel``; ``CudaTritonFlashAttentionKernel`` for the
attention, which has no layer) and bound in this module under that name. ``sync()`` generates them for
kernels declared after import too, and drops those of withdrawn kernels; ``discover_kernels`` calls it.

Why CPU too: Triton runs on CPU through its interpreter (TRITON_INTERPRET=1), which is how CI checks
numerics on real models; without the interpreter the CPU kernels report a missing dependency and leave
the model unchanged, as LLaMA-Factory's registry does. The forwards are the hub layers' (the kernel
table's ``Layer.impl``), so the registry, kernelize and the YAML rules install the very same code.
"""

from __future__ import annotations

import logging
import re
from types import MethodType
from typing import Iterable

import torch
from torch import nn

from .. import kernel_table
from ..devices import triton_device_types
from . import engine
from .attention import use_tritonspec_attention
from .kernel_registry import KERNEL_REGISTRY, AutoRegisterKernelMeta, DeviceType, KernelType, MetaKernel, as_kernel_type
from .repository import kernel_available, validate_layer
from .detectors import function_sites, infer_layer_name, tagged_name

logger = logging.getLogger("tritonspec.nn.kernel_registry")


def _excluded(path: str, exclude: Iterable[str] | None) -> bool:
    return any(re.search(p, path) for p in (exclude or ()))


class TritonKernel(MetaKernel):
    """Base of the generated kernels: ``entry`` is the kernel table's entry it installs."""

    entry: kernel_table.Kernel | None = None

    @classmethod
    def _unavailable(cls) -> bool:
        ok = kernel_available(cls.entry, cls.device.value)
        if not ok:
            logger.info("%s: Triton/op not available on %s; model unchanged", cls.__name__, cls.device.value)
        return not ok


class TritonLayerKernel(TritonKernel):
    """Rebinds ``forward`` of every module the kernel's layer recognizes (tagged, or inferred)."""

    @classmethod
    def apply(cls, model: nn.Module, *, exclude: Iterable[str] | None = None, **kwargs) -> nn.Module:
        """``exclude``: regexes on module paths to skip."""
        if cls._unavailable():
            return model
        layer = cls.entry.layer
        impl = layer.load()

        def pick(path, module):
            if _excluded(path, exclude):
                return False
            name = tagged_name(module)
            if name not in layer.names and not (name is None and infer_layer_name(module) == layer.name):
                return False
            validate_layer(impl, type(module), repo=cls.__name__)
            return True

        changes = cls.patch_forward(model, pick, impl.forward)
        logger.info("%s: %d modules", cls.__name__, len(changes))
        return model


class TritonFunctionKernel(TritonKernel):
    """Replaces a modeling module's function (``apply_rotary_pos_emb``), shared by every model of that
    architecture."""

    @classmethod
    def apply(cls, model: nn.Module, **kwargs) -> nn.Module:
        if cls._unavailable():
            return model
        impl = cls.entry.layer.load()
        kernel = engine.qualname(impl.forward)
        for entry, pymod, attr, value in function_sites(model):
            if entry is not cls.entry:
                continue
            where = f"{pymod.__name__}.{attr}"
            if isinstance(value, nn.Module):  # transformers built it with kernels: a Func module
                validate_layer(impl, type(value), repo=cls.__name__)
                engine.replace_forward(
                    model,
                    value,
                    impl.forward,
                    path=where,
                    kernel=kernel,
                    source="registry",
                    detail=cls._detail(),
                    shared=True,
                )
            else:  # a bound forward of the (stateless) layer stands in for the module-level function
                validate_layer(impl, value, repo=cls.__name__)
                engine.patch_attr(
                    model,
                    pymod,
                    attr,
                    MethodType(impl.forward, impl()),
                    path=where,
                    kernel=kernel,
                    source="registry",
                    detail=cls._detail(),
                    shared=True,
                )
        return model


class TritonAttentionKernel(TritonKernel):
    """Switches transformers models to ``attn_implementation="tritonspec"`` (recorded for revert)."""

    @classmethod
    def apply(cls, model: nn.Module, **kwargs) -> nn.Module:
        if not cls._unavailable():
            use_tritonspec_attention(model, source="registry", detail=cls._detail())
        return model


_SITE_BASES = {"module": TritonLayerKernel, "function": TritonFunctionKernel, "attention": TritonAttentionKernel}
_generated: dict[tuple[str, str], type] = {}


def class_name(kernel: kernel_table.Kernel, device_type: str) -> str:
    stem = kernel.layer.name if kernel.layer is not None else kernel.name.title().replace("_", "")
    return f"{device_type.capitalize()}Triton{stem}Kernel"


def sync() -> None:
    """Registry kernels for every declared kernel on every device type Triton runs on (torch's names)."""
    devices = [d for d in triton_device_types() if d != "rocm"]  # torch calls a ROCm device "cuda"
    for kernel in kernel_table.KERNELS.values():
        for device in devices:
            if (kernel.name, device) in _generated:
                continue
            name = class_name(kernel, device)
            base = _SITE_BASES[kernel.site]
            cls = AutoRegisterKernelMeta(
                name,
                (base,),
                {
                    "type": as_kernel_type(kernel.name),
                    "device": DeviceType(device),
                    "entry": kernel,
                    "kernel": staticmethod(kernel.op(kernel.ops[0])) if kernel.layer is None else None,
                    "__module__": __name__,
                    "__qualname__": name,
                    "__doc__": f"{base.__doc__.splitlines()[0]} Kernel {kernel.name!r} on {device}.",
                },
            )
            _generated[(kernel.name, device)] = cls
            globals()[name] = cls
    for (name, device), cls in list(_generated.items()):
        if name not in kernel_table.KERNELS:
            del _generated[(name, device)]
            globals().pop(cls.__name__, None)
            if KERNEL_REGISTRY.get_kernel(cls.type, cls.device) is cls:
                KERNEL_REGISTRY.unregister(cls.type, cls.device)


sync()


# -- the front end: discover and apply (LLaMA-Factory's names) ----------------------------------


def current_device_type(model: nn.Module | None = None) -> DeviceType:
    """The model's device type when it has (non-meta) parameters, else the runtime's accelerator."""
    if model is not None:
        for p in model.parameters():
            if p.device.type != "meta":
                try:
                    return DeviceType(p.device.type)
                except ValueError:
                    raise ValueError(f"model: device type {p.device.type!r} has no DeviceType") from None
            break
    if torch.cuda.is_available():
        return DeviceType.CUDA
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return DeviceType.NPU
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return DeviceType.XPU
    if torch.backends.mps.is_available():
        return DeviceType.MPS
    return DeviceType.CPU


def discover_kernels(model: nn.Module | None = None) -> list[type[MetaKernel]]:
    """Registered MetaKernel classes for the current device (the model's, when given), in KernelType order.

    Entries that are not MetaKernel subclasses are skipped silently; their ``apply`` decides later whether
    they can actually be used.
    """
    sync()  # kernels of the table declared since
    device = current_device_type(model)
    out = []
    for kind in dict.fromkeys([*KernelType, *KERNEL_REGISTRY._registry]):  # KernelType order, then later ones
        impl = KERNEL_REGISTRY.get_kernel(kind, device)
        if isinstance(impl, type) and issubclass(impl, MetaKernel):
            out.append(impl)
    return out


def apply_kernel(model: nn.Module, kernel: type[MetaKernel], /, **kwargs) -> nn.Module:
    """Run ``kernel.apply(model, **kwargs)``.

    Raises ValueError when ``kernel`` is not a MetaKernel subclass or is for another device than the
    current one (the model's device when it has parameters). Changes made before an exception are undone.
    """
    if not (isinstance(kernel, type) and issubclass(kernel, MetaKernel)):
        raise ValueError(f"kernel: {kernel!r} is not a MetaKernel subclass")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    device = current_device_type(model)
    if kernel.device != device:
        raise ValueError(
            f"kernel: {kernel.__name__} is for device {getattr(kernel.device, 'name', None)}, "
            f"the current device is {device.name}"
        )
    with engine.transaction(model):
        out = kernel.apply(model, **kwargs)
    return model if out is None else out


def apply_available_kernels(model: nn.Module, **kwargs) -> nn.Module:
    """Apply every kernel :func:`discover_kernels` finds for the model's device."""
    for kernel in discover_kernels(model):
        model = apply_kernel(model, kernel, **kwargs)
    return model
