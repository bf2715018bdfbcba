"""The LLaMA-Factory-style kernel registry front end: ``{KernelType: {DeviceType: MetaKernel}}``.

Why kept although kernelize exists: it is the interface LLaMA-Factory users know (``apply_kernel``,
``apply_available_kernels``), and it covers what layer names cannot: switching the attention
implementation, and kernels that patch functions rather than layers. Each ``MetaKernel.apply`` decides
where its kernel goes; installing it goes through :mod:`tritonspec.nn.engine` (see
:meth:`MetaKernel.patch_forward`), so registry changes are reported and reverted like the others.

``KernelType`` holds the kernel table's kernels (LLaMA-Factory's RMSNORM, SWIGLU, ROPE, FLASH_ATTENTION, MOE, and
MOE_ROUTER) and ``DeviceType`` tritonspec's device vocabulary (:mod:`tritonspec.devices`). A kernel declared after
import (a vendor's, an experiment's) is registered under its table name, a str.
"""

from __future__ import annotations

import enum
import logging
from abc import ABCMeta, abstractmethod
from typing import Any, Callable, ClassVar, Optional

from torch import nn

from .. import kernel_table
from ..devices import DEVICE_TYPES
from . import engine, experts

logger = logging.getLogger("tritonspec.nn.kernel_registry")

# What a kernel replaces: the kernel table's names.
KernelType = enum.Enum("KernelType", {n.upper(): n for n in kernel_table.KERNELS}, type=str, module=__name__)
KernelType.__doc__ = "What a kernel replaces: a kernel of the kernel table (``KernelType(name)``)."

# Where a kernel runs.
DeviceType = enum.Enum("DeviceType", {n.upper(): n for n in DEVICE_TYPES}, type=str, module=__name__)
DeviceType.__doc__ = "Where a kernel runs: tritonspec's device vocabulary (``tritonspec.devices.DEVICE_TYPES``)."


def as_kernel_type(value) -> KernelType | str:
    """``value`` as a registry key: a KernelType, or the name of a kernel declared after import."""
    if isinstance(value, KernelType):
        return value
    if isinstance(value, str) and value in kernel_table.KERNELS:
        try:
            return KernelType(value)
        except ValueError:  # declared after import
            return value
    raise TypeError(f"kernel_type: expected a KernelType or a declared kernel's name, got {value!r}")


class KernelRegistry:
    """Process-wide singleton table of kernel implementations (``KernelRegistry() is KERNEL_REGISTRY``)."""

    _instance: ClassVar[Optional["KernelRegistry"]] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "KernelRegistry":
        if cls._instance is None:
            inst = super().__new__(cls)
            inst._registry = {}
            cls._instance = inst
        return cls._instance

    def register(self, kernel_type: KernelType, device_type: DeviceType, kernel_impl: Optional[Callable]) -> None:
        """Register ``kernel_impl`` for (kernel_type, device_type); overwriting one warns (logging)."""
        kernel_type = as_kernel_type(kernel_type)
        if not isinstance(device_type, DeviceType):
            raise TypeError(f"device_type: expected DeviceType, got {device_type!r}")
        per_device = self._registry.setdefault(kernel_type, {})
        old = per_device.get(device_type)
        if old is not None and old is not kernel_impl:
            logger.warning(
                "Overwriting kernel for %s on %s: %s replaces %s",
                getattr(kernel_type, "name", kernel_type),
                device_type.name,
                engine.qualname(kernel_impl),
                engine.qualname(old),
            )
        per_device[device_type] = kernel_impl

    def get_kernel(self, kernel_type: KernelType, device_type: DeviceType) -> Optional[Callable]:
        """The implementation registered for (kernel_type, device_type), or None."""
        return self._registry.get(kernel_type, {}).get(device_type)

    def unregister(self, kernel_type: KernelType, device_type: DeviceType) -> Optional[Callable]:
        """Remove and return an entry (tests and experiments); None if there was none."""
        return self._registry.get(kernel_type, {}).pop(device_type, None)

    def items(self):
        """(kernel_type, device_type, impl) for every entry."""
        return [(k, d, impl) for k, per in self._registry.items() for d, impl in per.items()]


KERNEL_REGISTRY = KernelRegistry()


class AutoRegisterKernelMeta(ABCMeta):
    """Registers a class in KERNEL_REGISTRY when it defines both ``type`` and ``device`` (and not
    ``auto_register = False``) in its own body."""

    def __new__(mcs, name, bases, namespace, **kwargs):
        cls = super().__new__(mcs, name, bases, namespace, **kwargs)
        kernel_type = namespace.get("type")
        device_type = namespace.get("device")
        if namespace.get("auto_register", True) and kernel_type is not None and device_type is not None:
            KERNEL_REGISTRY.register(kernel_type, device_type, cls)
        return cls


class MetaKernel(metaclass=AutoRegisterKernelMeta):
    """Base of every registry kernel.

    ``type``/``device``: the registry key. ``kernel``: the implementation (for layer kernels, a forward
    function taking the module as ``self``). ``auto_register``: False keeps the class out of the registry
    (model-specific or experimental kernels; still usable with ``apply_kernel``). ``apply(model, **kw)``
    installs the kernel and returns the model, or returns it unchanged when a dependency is missing.
    """

    type: Optional[KernelType] = None
    device: Optional[DeviceType] = None
    kernel: Optional[Callable] = None
    auto_register: bool = True

    @classmethod
    @abstractmethod
    def apply(cls, model: nn.Module, **kwargs) -> nn.Module:
        raise NotImplementedError

    @classmethod
    def patch_forward(
        cls, model: nn.Module, predicate: Callable[[str, nn.Module], bool], forward: Callable | None = None
    ) -> list[engine.Change]:
        """Rebind ``forward`` (default ``cls.kernel``) on every submodule where ``predicate(path, module)``.

        The helper most ``apply`` methods need; it records the changes in the engine. MoE experts that
        transformers dispatches go in through its switch where it can say what was chosen
        (:class:`tritonspec.nn.experts.Plan`).
        """
        fn = forward if forward is not None else cls.kernel
        fn = getattr(fn, "__func__", fn)
        kernel = engine.qualname(fn)
        out = []
        plan = experts.Plan(model, "registry")
        for path, module in model.named_modules():
            if not predicate(path, module):
                continue
            if experts.dispatched(module):
                plan.choose(path, module, fn, kernel=kernel, detail=cls._detail())
                continue
            out.append(
                engine.replace_forward(
                    model, module, fn, path=path, kernel=kernel, source="registry", detail=cls._detail()
                )
            )
        return out + plan.apply()

    @classmethod
    def _detail(cls) -> str:
        t = getattr(cls.type, "name", cls.type) if cls.type is not None else "?"
        d = cls.device.name if cls.device is not None else "?"
        return f"{cls.__name__} {t}/{d}"
