"""tritonspec's Triton attention as a transformers attention implementation (``attn_implementation="tritonspec"``).

Why through ``AttentionInterface`` and not a forward patch: every transformers attention module already
dispatches on ``config._attn_implementation``, so one registration covers all models, and transformers'
``set_attn_implementation`` switches away and back.

The mask: transformers builds one per forward (per layer type) through the mask interface, under the same
name. Ours, :func:`tritonspec_mask`, evaluates transformers' own mask function (padding, packed sequences
from ``position_ids``, sliding windows, whatever the model composes) in row chunks and hands the layers
each query's key interval (:func:`bounds_mask`) instead of a dense 4-D mask: the kernel takes those
directly, and a padding token's query sees no key (no compute; it outputs 0). It returns None for a plain
causal batch (the kernel's fastest path) and transformers' dense SDPA mask when some query's keys are not
one interval, under torch.compile, and for decode steps without gradients. Decode steps (at most
``attention_decode.MAX_QUERIES`` queries, no gradient) run the split-K decode kernel, which also reads a dense
mask as it is, so a compiled static-cache step stays one graph. The attention function runs transformers' SDPA
path (eager for models without one, such as GPT-OSS's sinks) for any other dense mask and for anything else the
kernels do not cover (dropout while training, softcap, unsupported dtypes or head sizes); ``fallbacks`` counts
each reason, and ``report()`` shows a model's beside its switch.
"""

from __future__ import annotations

import collections
import functools
import sys
import weakref

import torch
from torch import nn

from . import engine

ATTENTION_NAME = "tritonspec"
_MAX_HEAD_DIM = 256
# fp32 attention exists only in the CPU interpreter; fp32 models on a GPU take the fallback.
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the mask function evaluates at most this many (batch x query x key) elements at once
_MASK_CHUNK = 1 << 26

fallbacks: collections.Counter = collections.Counter()  # reason -> calls that took the fallback, in this process
_FALLBACKS_BY_CONFIG: dict[int, collections.Counter] = {}  # id(a model's config) -> the same, for its report


def _count_fallback(config, reason: str) -> None:
    if torch.compiler.is_compiling():  # a traced count would be a guard on it: a recompile at every call
        return
    fallbacks[reason] += 1
    if config is None:
        return
    counts = _FALLBACKS_BY_CONFIG.get(id(config))
    if counts is None:  # configs are unhashable (they compare by value): keyed by id while the config lives
        counts = _FALLBACKS_BY_CONFIG[id(config)] = collections.Counter()
        weakref.finalize(config, _FALLBACKS_BY_CONFIG.pop, id(config), None)
    counts[reason] += 1


def fallback_note(config) -> str:
    """What ``report()`` adds to the attention switch: the calls of this model that ran transformers' path."""
    counts = _FALLBACKS_BY_CONFIG.get(id(config))
    if not counts:
        return ""
    return "transformers' attention ran " + ", ".join(f"{n} call(s) for {reason}" for reason, n in counts.items())


def bounds_mask(bounds: torch.Tensor) -> torch.Tensor:
    """Key bounds ``(2, batch, q_length)`` as what :func:`tritonspec_mask` returns in place of a dense mask: an int32
    ``(batch, 1, q_length, 2)`` tensor (first key, one past the last). Four dimensions, so transformers passes it on
    as a prepared mask wherever one is handed back to the model (``generate`` builds a static cache's masks before
    each forward); int32, which no mask of transformers' is."""
    return bounds.to(torch.int32).permute(1, 2, 0).unsqueeze(1)


def mask_bounds(mask) -> torch.Tensor | None:
    """The key bounds ``(2, batch, q_length)`` a mask from :func:`bounds_mask` holds, or None for any other mask."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4 and mask.shape[-1] == 2:
        from ..ops._library import derived

        # one view for every layer of the forward, so what the kernels derive from it is built once
        return derived(mask, "key_bounds", lambda: mask[:, 0].permute(2, 0, 1))
    return None


def _dense(bounds: torch.Tensor, kv_length: int) -> torch.Tensor:
    """The boolean ``(batch, 1, q_length, kv_length)`` mask (True: attend) the bounds describe."""
    keys = torch.arange(kv_length, device=bounds.device)
    lo, hi = bounds[0][..., None], bounds[1][..., None]
    return ((keys >= lo) & (keys < hi))[:, None]


def tritonspec_mask(*args, **kwargs):
    """transformers' mask-interface signature (that of ``sdpa_mask``, called with keywords): None, key bounds
    (:func:`bounds_mask`) or transformers' dense mask. Queries are given by ``q_length`` and ``q_offset``
    (transformers 5.2x) or by ``cache_position`` (earlier 5.x); a chunk of rows is either.

    Decode steps without gradients keep transformers' dense mask: the decode kernel reads it as it is, exactly,
    with no host synchronization (finding intervals would need one at every step)."""
    from transformers.masking_utils import sdpa_mask

    by_length, by_position = "q_length" in kwargs, "cache_position" in kwargs
    if args or not (by_length or by_position) or "kv_length" not in kwargs or torch.compiler.is_compiling():
        return sdpa_mask(*args, **kwargs)  # a call we cannot chunk; under compile, no data-dependent Python
    batch, kv_len = kwargs.get("batch_size", 1), kwargs["kv_length"]
    q_len = kwargs["q_length"] if by_length else kwargs["cache_position"].shape[0]
    from ..ops.attention import key_bounds_from_mask
    from ..ops.attention_decode import MAX_QUERIES

    if q_len <= MAX_QUERIES and not torch.is_grad_enabled():
        return sdpa_mask(*args, **kwargs)
    rows = max(1, _MASK_CHUNK // max(1, batch * kv_len))
    if q_len <= rows:  # one chunk: transformers' own call, its skips (a plain causal batch, a decode step) kept
        mask = sdpa_mask(*args, **kwargs)
        parts = [None if mask is None else key_bounds_from_mask(mask)]
        if parts[0] is None:
            return mask
    else:
        parts = []
        for start in range(0, q_len, rows):
            n = min(rows, q_len - start)
            if by_length:
                chunk = dict(q_length=n, q_offset=kwargs.get("q_offset", 0) + start)
            else:
                chunk = dict(cache_position=kwargs["cache_position"][start : start + n])
            mask = sdpa_mask(**dict(kwargs, allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **chunk))
            bounds = key_bounds_from_mask(mask)
            if bounds is None:  # not intervals: transformers' own mask, for SDPA
                return sdpa_mask(*args, **kwargs)
            parts.append(bounds)
    bounds = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    if q_len == kv_len and _is_plain_causal(bounds):
        return None
    padding = kwargs.get("attention_mask")
    if by_length and padding is not None and padding.dim() == 2 and padding.shape[-1] == kv_len == q_len:
        # no cache: query i is token i. A padding token's query sees nothing and outputs 0, as transformers'
        # FlashAttention path leaves it, instead of a row no real token reads.
        if kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0:
            bounds = bounds * padding.to(torch.bool)[None]
    return bounds_mask(bounds)


def _is_plain_causal(bounds: torch.Tensor) -> bool:
    rows = torch.arange(1, bounds.shape[-1] + 1, device=bounds.device, dtype=bounds.dtype)
    return bool(((bounds[0] == 0) & (bounds[1] == rows)).all())


def _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    """transformers' own path for this call: SDPA, or the model's eager function where it passes sinks (GPT-OSS
    has no SDPA path); key bounds go back to the mask that path expects."""
    _count_fallback(getattr(module, "config", None), reason)
    bounds = mask_bounds(attention_mask)
    if bounds is not None:
        attention_mask = _dense(bounds, key.shape[2])
    if kwargs.get("s_aux") is not None:
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _decoding(query, key, value, sinks) -> bool:
    """A decode step the split-K kernel serves: a few queries, no gradient wanted."""
    from ..ops.attention_decode import MAX_QUERIES

    if query.shape[2] > MAX_QUERIES:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks)))


def _unsupported(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why the kernels cannot take this call, or None."""
    q_len, kv_len = query.shape[2], key.shape[2]
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    bounded = mask_bounds(attention_mask) is not None
    dense = attention_mask is not None and not bounded
    decoding = _decoding(query, key, value, sinks)  # a dense mask: the decode kernel's
    checks = (
        (dense and not (decoding and attention_mask.dtype == torch.bool), "a mask whose rows are not key intervals"),
        (dropout != 0.0 and module.training, "attention dropout while training"),
        (attention_mask is None and q_len != kv_len and q_len > 1, "queries against a longer cache without a mask"),
        (attention_mask is None and window is not None and kv_len > window, "a sliding window without its mask"),
        (any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "cache")), "softcap or position bias"),
        (sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != query.shape[1]), "sinks not one per head"),
        (query.shape[-1] != value.shape[-1] or query.shape[-1] > _MAX_HEAD_DIM, "head_dim"),
        (query.shape[1] % key.shape[1] != 0, "heads not a multiple of the kv heads"),
        (not (key.dtype == value.dtype == query.dtype), "mixed dtypes"),
        (query.dtype not in (_GPU_DTYPES if query.device.type != "cpu" else _CPU_DTYPES), f"dtype {query.dtype}"),
    )
    return next((reason for bad, reason in checks if bad), None)


def tritonspec_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers attention-function signature; q (b, h, s, d), k/v (b, h_kv, s, d) -> ((b, s, h, d), None)."""
    reason = _unsupported(module, query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    from ..ops.attention import attention  # import statements, not importlib: Dynamo traces them
    from ..ops.attention_decode import attention_decode

    sinks = kwargs.get("s_aux")
    bounds = mask_bounds(attention_mask)
    if _decoding(query, key, value, sinks) and (attention_mask is not None or query.shape[2] == 1):
        dense = attention_mask if bounds is None else None
        out = attention_decode(query, key, value, scale=scaling, mask=dense, key_bounds=bounds, sinks=sinks)
    elif bounds is not None:
        out = attention(query, key, value, scale=scaling, key_bounds=bounds, sinks=sinks)
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        q_len = query.shape[2]
        out = attention(query, key, value, causal=bool(causal) and q_len > 1, scale=scaling, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def register_attention(name: str = ATTENTION_NAME) -> str:
    """Register the attention function and its mask function with transformers under ``name``; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, tritonspec_attention_forward)
    AttentionMaskInterface.register(name, tritonspec_mask)
    return name


def _takes_sinks(model: nn.Module) -> bool:
    """GPT-OSS-style attention: the model passes ``s_aux`` (its sinks) and has an eager function for our fallback."""
    return any(
        hasattr(m, "sinks") and hasattr(sys.modules[type(m).__module__], "eager_attention_forward")
        for m in model.modules()
    )


def use_tritonspec_attention(model: nn.Module, *, source: str = "registry", detail: str = "") -> engine.Change | None:
    """Switch a transformers model to ``attn_implementation="tritonspec"``, recorded for ``revert``.

    Returns None (and leaves the model alone) for models without ``set_attn_implementation``, and for models
    whose own attention path our fallback would not be: models with SDPA, or with GPT-OSS's sinks, qualify.
    """
    setter = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    if setter is None or config is None or not (getattr(model, "_supports_sdpa", False) or _takes_sinks(model)):
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
        note=functools.partial(fallback_note, config),
    )
