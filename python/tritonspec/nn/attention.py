"""tritonspec's Triton attention as a transformers attention implementation (``attn_implementation="tritonspec"``).

Why through ``AttentionInterface`` and not a forward patch: every transformers attention module already
dispatches on ``config._attn_implementation``, so one registration covers all models. The mask interface
gets ``sdpa_mask`` under the same name: it returns None for a plain causal batch (our kernel's fast path)
and a 4-D mask when there is padding, packing or a sliding window; those cases, and anything else the
kernel does not cover (dropout while training, softcap, sinks, decoding with a cache), run transformers'
SDPA path, so results never depend on which path ran.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from . import engine

ATTENTION_NAME = "tritonspec"
_MAX_HEAD_DIM = 256
# fp32 attention exists only in the CPU interpreter; fp32 models on a GPU take the SDPA path.
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _op():
    return importlib.import_module("tritonspec.ops.attention").attention


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def tritonspec_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers attention-function signature; q (b, h, s, d), k/v (b, h_kv, s, d) -> ((b, s, h, d), None)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    window = kwargs.get("sliding_window")
    unsupported = (
        attention_mask is not None
        or (dropout != 0.0 and module.training)
        or q_len != kv_len  # decoding against a cache: causal alignment differs; SDPA handles it
        or (window is not None and kv_len >= window)
        or any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias", "cache"))
        or query.shape[-1] != value.shape[-1]
        or query.shape[-1] > _MAX_HEAD_DIM
        or query.shape[1] % key.shape[1] != 0
        or not (key.dtype == value.dtype == query.dtype)
        or query.dtype not in (_GPU_DTYPES if query.device.type != "cpu" else _CPU_DTYPES)
    )
    if unsupported:
        return _sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = _op()(query, key, value, causal=bool(causal) and q_len > 1, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_attention(name: str = ATTENTION_NAME) -> str:
    """Register the attention function and its mask builder with transformers under ``name``; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, tritonspec_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def use_tritonspec_attention(model: nn.Module, *, source: str = "registry", detail: str = "") -> engine.Change | None:
    """Switch a transformers model to ``attn_implementation="tritonspec"``, recorded for ``revert``.

    Returns None (and leaves the model alone) for models without ``set_attn_implementation``, and for
    models transformers runs without SDPA (GPT-OSS's attention sinks): SDPA is this implementation's
    fallback, so it must be the model's too.
    """
    setter = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if setter is None or config is None or not getattr(model, "_supports_sdpa", False):
        return None
    register_attention()
    old = config._attn_implementation
    setter(ATTENTION_NAME)
    return engine.record_custom(
        model,
        config,
        "_attn_implementation",
        functools.partial(setter, old or "eager"),
        path="",
        what="attn_implementation",
        kernel=engine.qualname(tritonspec_attention_forward),
        source=source,
        detail=detail or f"{old} -> {ATTENTION_NAME}",
    )
