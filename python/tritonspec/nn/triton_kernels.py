"""tritonspec's Triton kernels as registry kernels (RMSNORM, SWIGLU, ROPE, FLASH_ATTENTION) for CUDA and CPU.

Why CPU too: Triton runs on CPU through its interpreter (TRITON_INTERPRET=1), which is how CI checks
numerics on real models; without the interpreter the CPU kernels report a missing dependency and leave
the model unchanged, as seed 000 asks. Other Triton devices (NPU, XPU) plug in by subclassing with
``device = DeviceType.NPU``; there is no MOE kernel yet, and one would be one more subclass here whose
``apply`` matches expert modules, without touching the engine.

The forwards are the hub layers' (:mod:`tritonspec.nn.hub.layers`), so the registry, kernelize and YAML
rules install the very same code.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable

from torch import nn

from . import engine
from .attention import attention_available, tritonspec_attention_forward, use_tritonspec_attention
from .hub import layers
from .registry import AutoRegisterKernelMeta, DeviceType, KernelType, MetaKernel
from .repository import TritonspecRepository, validate_layer
from .targets import is_rms_norm, is_swiglu_mlp, rotary_sites, tagged_name

logger = logging.getLogger("tritonspec.nn.registry")


def _excluded(path: str, exclude: Iterable[str] | None) -> bool:
    return any(re.search(p, path) for p in (exclude or ()))


class TritonLayerKernel(MetaKernel):
    """Base for kernels that rebind ``forward`` of matching modules to one of our hub layers."""

    layer_name: str = ""
    tag: str = ""  # transformers' layer name for the same thing

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        raise NotImplementedError

    @classmethod
    def apply(cls, model: nn.Module, *, exclude: Iterable[str] | None = None, **kwargs) -> nn.Module:
        """Rebind forward on every matching module; ``exclude``: regexes on module paths to skip."""
        if not TritonspecRepository(cls.layer_name).available(cls.device.value):
            logger.info("%s: Triton/op not available on %s; model unchanged", cls.__name__, cls.device.value)
            return model
        layer = getattr(layers, cls.layer_name)

        def pick(path, module):
            if _excluded(path, exclude) or not (tagged_name(module) == cls.tag or cls.matches(module)):
                return False
            validate_layer(layer, type(module), repo=cls.__name__)
            return True

        changes = cls.patch_forward(model, pick, layer.forward)
        logger.info("%s: %d modules", cls.__name__, len(changes))
        return model


class TritonRMSNormKernel(TritonLayerKernel):
    kernel = layers.RMSNorm.forward
    layer_name, tag = "RMSNorm", "RMSNorm"

    @classmethod
    def matches(cls, module):
        return is_rms_norm(module)


class TritonSwiGLUKernel(TritonLayerKernel):
    kernel = layers.SwiGLUMLP.forward
    layer_name, tag = "SwiGLUMLP", "SwiGLUMLP"

    @classmethod
    def matches(cls, module):
        return is_swiglu_mlp(module)


class TritonRoPEKernel(MetaKernel):
    """Replaces the modeling module's ``apply_rotary_pos_emb`` (shared by every model of that architecture)."""

    kernel = staticmethod(layers.rotary_pos_emb)

    @classmethod
    def apply(cls, model: nn.Module, **kwargs) -> nn.Module:
        if not TritonspecRepository("RotaryPosEmb").available(cls.device.value):
            logger.info("%s: Triton/op not available on %s; model unchanged", cls.__name__, cls.device.value)
            return model
        for pymod, attr, value in rotary_sites(model):
            where = f"{pymod.__name__}.{attr}"
            if isinstance(value, nn.Module):  # transformers built it with kernels: a Func module
                validate_layer(layers.RotaryPosEmb, type(value), repo=cls.__name__)
                engine.replace_forward(model, value, layers.RotaryPosEmb.forward, path=where,
                                       kernel=engine.qualname(layers.RotaryPosEmb.forward), source="registry",
                                       detail=cls._detail(), shared=True)
            else:
                validate_layer(layers.RotaryPosEmb, value, repo=cls.__name__)
                engine.patch_attr(model, pymod, attr, layers.rotary_pos_emb, path=where,
                                  kernel=engine.qualname(layers.rotary_pos_emb), source="registry",
                                  detail=cls._detail(), shared=True)
        return model


class TritonAttentionKernel(MetaKernel):
    """Switches transformers models to ``attn_implementation="tritonspec"``."""

    kernel = staticmethod(tritonspec_attention_forward)

    @classmethod
    def apply(cls, model: nn.Module, **kwargs) -> nn.Module:
        if not attention_available(cls.device.value):
            logger.info("%s: attention op not available on %s; model unchanged", cls.__name__, cls.device.value)
            return model
        use_tritonspec_attention(model, source="registry", detail=cls._detail())
        return model


_BASES = {KernelType.RMSNORM: TritonRMSNormKernel, KernelType.SWIGLU: TritonSwiGLUKernel,
          KernelType.ROPE: TritonRoPEKernel, KernelType.FLASH_ATTENTION: TritonAttentionKernel}

# One registered class per (type, device): e.g. CudaTritonRMSNormKernel. Created through the metaclass so
# they auto-register exactly like hand-written kernels.
for _dev in (DeviceType.CUDA, DeviceType.CPU):
    for _kt, _base in _BASES.items():
        _name = f"{_dev.name.capitalize()}{_base.__name__}"
        globals()[_name] = AutoRegisterKernelMeta(_name, (_base,), {
            "type": _kt, "device": _dev, "__module__": __name__, "__qualname__": _name,
            "__doc__": f"{_base.__doc__ or _base.__name__} ({_dev.name})"})
del _dev, _kt, _base, _name
