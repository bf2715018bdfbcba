"""tritonspec.nn: put tritonspec's Triton kernels into Hugging Face models, three ways, one engine.

- Registry (LLaMA-Factory style): ``apply_available_kernels(model)`` / ``apply_kernel(model, Kernel)``.
- kernelize (huggingface/kernels style): ``kernelize(model, mode=Mode.TRAINING)``.
- YAML rules (KTransformers style): ``apply_rules(model, "rules.yaml")``.

Whichever you use, ``report(model)`` lists what was replaced and ``revert(model)`` restores the
original forwards. transformers' own switches work once this package is imported:
``attn_implementation="tritonspec"`` selects the Triton attention and ``experts_implementation="tritonspec"`` the
Triton MoE experts. MoE experts and routers are also layers like the others (``MoEExperts``, ``MoERouter``: the
MOE and MOE_ROUTER registry kernels); the front ends put the experts in by that switch where it can say what they
chose, so ``set_experts_implementation`` / ``set_attn_implementation`` keep switching away and back, and
``report(model)`` shows what the switches select now (:mod:`.experts`).

``RMSNorm`` and ``SwiGLUMLP`` (stateful modules, :mod:`tritonspec.nn.modules`) are loaded on first use. MoE models
larger than the GPU: :func:`offload_experts` (experts in host memory or on disk, a GPU cache; :mod:`.offload`).
Greedy decode whose steps are CUDA-graph replays: :class:`GraphDecoder` (:mod:`.graph_decode`).
"""

from .attention import ATTENTION_NAME, register_attention, tritonspec_attention_forward, use_tritonspec_attention
from .experts import EXPERTS_NAME, register_experts, tritonspec_experts_forward
from .engine import Change, Report, report, revert
from .kernelizer import (
    CUDAProperties,
    Device,
    Mode,
    ROCMProperties,
    kernelize,
    register_kernel_mapping,
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
)
from .kernel_registry import KERNEL_REGISTRY, AutoRegisterKernelMeta, DeviceType, KernelRegistry, KernelType, MetaKernel
from .registry_kernels import apply_available_kernels, apply_kernel, discover_kernels
from .repository import HubUnavailableError, LayerRepository, LocalLayerRepository, TritonspecRepository
from .rules import Rule, RuleError, apply_rules, load_rules, register_module_converter

__all__ = [
    # registry
    "KernelType",
    "DeviceType",
    "KernelRegistry",
    "KERNEL_REGISTRY",
    "AutoRegisterKernelMeta",
    "MetaKernel",
    "discover_kernels",
    "apply_kernel",
    "apply_available_kernels",
    # kernelize
    "Mode",
    "Device",
    "CUDAProperties",
    "ROCMProperties",
    "kernelize",
    "register_kernel_mapping",
    "use_kernel_mapping",
    "use_kernel_forward_from_hub",
    "replace_kernel_forward_from_hub",
    "LayerRepository",
    "LocalLayerRepository",
    "TritonspecRepository",
    "HubUnavailableError",
    # rules
    "apply_rules",
    "load_rules",
    "Rule",
    "RuleError",
    "register_module_converter",
    # engine
    "revert",
    "report",
    "Report",
    "Change",
    # attention
    "ATTENTION_NAME",
    "register_attention",
    "tritonspec_attention_forward",
    "use_tritonspec_attention",
    # experts
    "EXPERTS_NAME",
    "register_experts",
    "tritonspec_experts_forward",
    # stateful modules (tritonspec.nn.modules) and offloaded experts (tritonspec.nn.offload), loaded on first use
    "RMSNorm",
    "SwiGLUMLP",
    "offload_experts",
    # greedy decode in CUDA graphs (tritonspec.nn.graph_decode), loaded on first use
    "GraphDecoder",
]

_LAZY = {"RMSNorm": "modules", "SwiGLUMLP": "modules", "offload_experts": "offload", "GraphDecoder": "graph_decode"}


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def _register_with_transformers() -> None:
    """``attn_implementation="tritonspec"`` and ``experts_implementation="tritonspec"`` work once tritonspec.nn
    is imported. Without transformers (``pip install tritonspec[hf]``) there is nothing to register with; an
    older transformers without an experts interface gets the attention only."""
    try:
        register_attention()
    except ImportError:
        return
    try:
        register_experts()
    except ImportError:
        pass


_register_with_transformers()
