"""tritonspec's Triton MoE experts behind transformers' experts-function signature.

transformers' MoE families decorate their experts with ``use_experts_implementation``, which dispatches on
``config._experts_implementation`` and records the weights' layout on the module (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``). :func:`tritonspec_experts_forward` serves two routes: registered with
``ExpertsInterface`` (``register_experts()``, then ``experts_implementation="tritonspec"``: transformers' own
switch, one registration for every family), and as the ``MoEExperts`` hub layer's forward, which the
registry, ``kernelize`` and the YAML rules install. What the kernel does not cover (ungated or post-normed
experts, another activation, a layout other than Qwen/Mixtral/DeepSeek's and GPT-OSS's, an unsupported
dtype) runs transformers' ``grouped_mm`` path, so results never depend on which path ran. Expert-parallel
sentinel ids (``>= num_experts``, zero weights) contribute nothing on either path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..devices import triton_runs

EXPERTS_NAME = "tritonspec"
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _ops():
    from ..ops import moe  # an import statement, not importlib: Dynamo traces it (fullgraph compiles)

    return moe


def _grouped_mm(*args, **kwargs):
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(*args, **kwargs)


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(act, SiLUActivation)


def experts_kind(module: nn.Module) -> tuple[str, str, float | None] | None:
    """(layout, activation, clamp) the Triton kernel computes ``module`` with, or None when it cannot.

    Read from what ``use_experts_implementation`` recorded and from the gate the class uses: transformers'
    default gate with a SiLU is ``"silu"``; GPT-OSS's own gate (``alpha`` 1.702, ``limit``) is ``"gpt_oss"``.
    """
    if not getattr(module, "has_gate", False) or getattr(module, "has_post_expert_norm", False):
        return None
    layout = {(True, False): "concatenated", (False, True): "interleaved_transposed"}.get(
        (getattr(module, "is_concatenated", None), getattr(module, "is_transposed", None))
    )
    if layout is None:
        return None
    from transformers.integrations.moe import _default_apply_gate

    gate = getattr(type(module), "_apply_gate", None)
    if gate is _default_apply_gate:
        return (layout, "silu", None) if _is_silu(getattr(module, "act_fn", None)) else None
    ops = _ops()
    limit = getattr(module, "limit", None)
    if (
        type(module).__module__.endswith(".gpt_oss.modeling_gpt_oss")
        and getattr(module, "alpha", None) == ops.GPT_OSS_ALPHA
        and isinstance(limit, (int, float))
        and limit > 0
    ):
        return layout, "gpt_oss", float(limit)
    return None


def tritonspec_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts-function signature: (T, H) tokens, (T, k) ids and weights -> (T, H)."""
    kind = experts_kind(module)
    weight = module.gate_up_proj if kind is not None else None
    if (
        kind is None
        or hidden_states.dim() != 2
        or hidden_states.dtype not in (_GPU_DTYPES if hidden_states.device.type != "cpu" else _CPU_DTYPES)
        or weight.dtype != hidden_states.dtype
        or module.down_proj.dtype != hidden_states.dtype
        or not triton_runs(hidden_states.device.type)
    ):
        return _grouped_mm(module, hidden_states, top_k_index, top_k_weights)
    layout, activation, clamp = kind
    has_bias = getattr(module, "has_bias", False)
    return _ops().moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        module.gate_up_proj,
        module.down_proj,
        gate_up_bias=module.gate_up_proj_bias if has_bias else None,
        down_bias=module.down_proj_bias if has_bias else None,
        layout=layout,
        activation=activation,
        clamp=clamp,
    )


def register_experts(name: str = EXPERTS_NAME) -> str:
    """Register the experts function with transformers under ``name``; idempotent."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, tritonspec_experts_forward)
    return name
