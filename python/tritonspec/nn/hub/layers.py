"""Hub-style pure layers that put tritonspec's Triton kernels behind Hugging Face layer names.

Why this shape: it is the layer contract of huggingface/kernels (kernel-requirements.md, "Writing
layers"). Each class subclasses ``nn.Module``, defines no ``__init__``, no members but ``forward`` and the
``has_backward`` / ``can_torch_compile`` flags, and reads state (``weight``, ``variance_epsilon``,
``gate_proj`` ...) from the module whose ``forward`` it replaces. The same classes serve our own
``kernelize``, the registry kernels, the YAML rules, and — copied into a ``build/<variant>/<package>``
tree by :func:`tritonspec.nn.hub.write_layer_repo` — the real ``kernels`` package.

``can_torch_compile = True``: under torch.compile the ops dispatch to their ``torch.library`` registrations
(``triton_op`` on GPUs), which Dynamo traces; checked with ``torch.compile`` in tests/test_nn_models.py.

Two layers need more than the module's tensors to know what to compute, and ask tritonspec when they run:
``MoEExperts`` the experts' layout and activation (``tritonspec.nn.experts.experts_kind``), ``MoERouter`` the
routing its router computes (``tritonspec.nn.detectors.router_kind``, verified against the router's own forward).

This file must stay self-contained: only the standard library and torch at import time; tritonspec's ops
are imported when a forward runs (the kernels are installed as the ``tritonspec`` package, which a hub
kernel directory cannot ship), so copying the file elsewhere keeps it importable.

Cases the Triton ops do not cover (float64, CPU tensors without the interpreter, an ``unsqueeze_dim``
other than 1, partial rotary, experts in another dtype than their input, a post-attention norm with hooks)
run the original Hugging Face formula (for the experts, transformers' ``grouped_mm``), so a replaced layer
never changes results, only speed.
"""

import importlib

import torch
from torch import nn

__all__ = [
    "RMSNorm",
    "SwiGLUMLP",
    "RotaryPosEmb",
    "MoEExperts",
    "MoERouter",
    "DecoderLayer",
    "CausalLMLoss",
    "MoeCausalLMLoss",
    "rms_norm",
    "swiglu_mlp",
    "rotary_pos_emb",
    "moe_router",
    "decoder_layer",
    "causal_lm_loss",
    "causal_lm_forward",
]


_IMPORTED: dict = {}


def _tritonspec(module: str, name: str):
    """``tritonspec.<module>.<name>``, imported on first call (tritonspec may be installed after us)."""
    fn = _IMPORTED.get((module, name))
    if fn is None:
        fn = _IMPORTED[(module, name)] = getattr(importlib.import_module(f"tritonspec.{module}"), name)
    return fn


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_runs(*tensors) -> bool:
    """Whether the Triton ops take these tensors: float16/bfloat16/float32, on a GPU or in the interpreter.

    Why a replaced layer must check: ``apply_rotary_pos_emb`` is a module global, so replacing it reaches
    every model of that architecture in the process -- a float64 reference model, a CPU copy -- and a
    kernelized model may be cast or moved afterwards. Those run the reference formula instead of failing.
    """
    for t in tensors:
        if t.dtype not in _TRITON_DTYPES:
            return False
    return _tritonspec("devices", "triton_runs")(tensors[0].device.type)


def _rms_norm_eager(hidden_states, weight, eps):
    # transformers' LlamaRMSNorm.forward: fp32 statistics, cast back, then scale.
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def rms_norm(hidden_states, weight, eps):
    """RMSNorm with HF Llama semantics (fp32 statistics, output dtype promote(input, weight))."""
    if not _triton_runs(hidden_states, weight):
        return _rms_norm_eager(hidden_states, weight, eps)
    return _tritonspec("ops.rms_norm", "rms_norm")(hidden_states, weight, eps)


def _fusable_norm(norm) -> bool:
    """Whether ``add_rms_norm`` may stand in for calling ``norm``: it holds a ``weight`` and a float
    ``variance_epsilon``, runs its class forward or our ``RMSNorm`` layer's (not another kernel someone mapped
    to it), and has no hooks that calling it would fire (FSDP2 unsharding its weight, activation capture)."""
    forward = norm.__dict__.get("forward")
    return (
        isinstance(getattr(norm, "weight", None), torch.Tensor)
        and isinstance(getattr(norm, "variance_epsilon", None), float)
        and (forward is None or getattr(forward, "__func__", None) is RMSNorm.forward)
        and not (norm._forward_hooks or norm._forward_pre_hooks)
    )


def _add_post_norm(norm, x, residual):
    """``(norm(residual + x), residual + x)``: one ``add_rms_norm`` (Liger's fused add + RMSNorm) where ``norm``
    allows it (``_fusable_norm``) and the Triton op takes the tensors, else the add and a call of ``norm``."""
    if (
        _fusable_norm(norm)
        and x.shape == residual.shape
        and x.dtype == residual.dtype
        and _triton_runs(x, residual, norm.weight)
    ):
        return _tritonspec("ops.rms_norm", "add_rms_norm")(x, residual, norm.weight, norm.variance_epsilon)
    residual = residual + x
    return norm(residual), residual


def decoder_layer(module, hidden_states, attn_kwargs):
    """A pre-norm decoder layer, ``h = x + self_attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h))``,
    with the first add fused into the post-attention norm (``_add_post_norm``).

    ``self_attn`` gets ``attn_kwargs`` by name, as transformers' layers pass their arguments on; its
    ``(output, weights)`` pair and an MoE ``mlp``'s ``(output, router scores)`` pair (GPT-OSS) are unpacked
    as the layers do. ``tritonspec.nn.detectors.is_llama_decoder_layer`` checks a layer's own forward against this.
    """
    residual = hidden_states
    hidden_states, _ = module.self_attn(hidden_states=module.input_layernorm(hidden_states), **attn_kwargs)
    hidden_states, residual = _add_post_norm(module.post_attention_layernorm, hidden_states, residual)
    hidden_states = module.mlp(hidden_states)
    if isinstance(hidden_states, tuple):
        hidden_states, _ = hidden_states
    return residual + hidden_states


def causal_lm_loss(model, hidden, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """transformers' ``ForCausalLMLoss`` of ``lm_head(hidden)`` (labels shifted so tokens < n predict n, or
    ``shift_labels`` as given; ``num_items_in_batch`` for gradient accumulation) and Gemma's final logit
    softcapping, as one ``linear_cross_entropy``: the logits are never formed."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.lm_head
    return _tritonspec("ops.linear_cross_entropy", "linear_cross_entropy")(
        hidden,
        head.weight,
        shift_labels.to(hidden.device),
        bias=head.bias,
        ignore_index=ignore_index,
        softcap=getattr(model.config, "final_logit_softcapping", None),
        num_items_in_batch=num_items_in_batch,
    )


def swiglu_mlp(module, x):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gating done by the Triton kernel.

    gate/up are created here and read only by the kernel, so its backward may reuse their storage.
    """
    gate = module.gate_proj(x)
    up = module.up_proj(x)
    if not _triton_runs(gate, up):
        return module.down_proj(torch.nn.functional.silu(gate) * up)
    return module.down_proj(_tritonspec("ops.swiglu", "swiglu")(gate, up, in_place_backward=True))


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotary_eager(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """HF ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``; q, k are (batch, heads, seq, head_dim)."""
    if (
        unsqueeze_dim != 1
        or q.dim() != 4
        or k.dim() != 4
        or cos.dim() != 3
        or q.shape[-1] != cos.shape[-1]
        or q.dtype != k.dtype
        or not _triton_runs(q, k, cos, sin)
    ):
        # Partial rotary (cos narrower than head_dim) and other layouts stay on the reference formula.
        return _rotary_eager(q, k, cos, sin, unsqueeze_dim)
    return _tritonspec("ops.rope", "rope")(q, k, cos, sin)


def moe_router(module, hidden_states, kind):
    """``(router_logits, weights, ids)`` of a top-k router, with the routing ``kind`` describes (a
    ``tritonspec.nn.detectors.RouterKind``): the router's ``weight`` (and ``bias``, ``e_score_correction_bias``
    where ``kind`` says), ``moe_route``, and the router's dtypes."""
    weight = module.weight
    bias = module.bias if kind.bias else None
    x = hidden_states.reshape(-1, weight.shape[-1])
    if kind.float32_logits:
        x, weight, bias = x.float(), weight.float(), None if bias is None else bias.float()
    logits = torch.nn.functional.linear(x, weight, bias)
    weights, ids = _tritonspec("ops.moe_routing", "moe_route")(
        logits,
        kind.top_k,
        scoring=kind.scoring,
        renormalize=kind.renormalize,
        correction_bias=module.e_score_correction_bias if kind.correction_bias else None,
        n_group=kind.n_group,
        topk_group=kind.topk_group,
        scaling_factor=kind.scaling_factor,
    )
    return logits, weights if kind.float32_weights else weights.to(logits.dtype), ids


class RMSNorm(nn.Module):
    """Replaces the forward of HF ``*RMSNorm`` (layer name ``RMSNorm``); uses ``weight``, ``variance_epsilon``."""

    weight: torch.Tensor
    variance_epsilon: float

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class SwiGLUMLP(nn.Module):
    """Replaces the forward of a gated-SiLU MLP (layer name ``SwiGLUMLP``); uses ``gate_proj/up_proj/down_proj``."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(self, x)


class RotaryPosEmb(nn.Module):
    """Replaces transformers' ``apply_rotary_pos_emb`` function module (layer name ``rotary_pos_emb``)."""

    has_backward = True
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


class MoEExperts(nn.Module):
    """Replaces the forward of transformers' fused experts (layer name ``MoEExperts``); uses ``gate_up_proj``,
    ``down_proj`` (and their biases) with ``tritonspec.nn.experts.tritonspec_experts_forward``: the Triton
    experts, or transformers' ``grouped_mm`` where they do not apply."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _tritonspec("nn.experts", "tritonspec_experts_forward")(self, hidden_states, top_k_index, top_k_weights)


class MoERouter(nn.Module):
    """Replaces the forward of a top-k MoE router (layer name ``MoERouter``); uses ``weight`` (and ``bias``,
    ``e_score_correction_bias``) with ``moe_route``, returning what the router returns, in its dtypes.

    float64 (``moe_route`` computes in float32) and a router whose routing is no longer one ``router_kind``
    verified run the router's own forward.
    """

    weight: torch.Tensor

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        kind = _tritonspec("nn.detectors", "router_kind")(self)
        if kind is None or hidden_states.dtype == torch.float64:
            return type(self).forward(self, hidden_states)
        return moe_router(self, hidden_states, kind)


class DecoderLayer(nn.Module):
    """Replaces the forward of a Llama-style decoder layer (layer name ``DecoderLayer``; Llama, Mistral, Qwen2/3,
    Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS ...): the residual add after attention runs inside the
    post-attention RMSNorm (``add_rms_norm``). Uses ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp``; the forward signature is those layers' (transformers 5).

    Under gradient checkpointing in training the layer's class forward runs, unfused: transformers checkpoints
    there (``GradientCheckpointingLayer``), and an instance forward would silently skip it.
    """

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        attn_kwargs = dict(
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if past_key_values is not None:  # given by name only where the model's layers call it that (5.24: cache)
            attn_kwargs["past_key_values"] = past_key_values
        if self.training and getattr(self, "gradient_checkpointing", False):
            return type(self).forward(self, hidden_states, **attn_kwargs)  # by name: how the checkpointer wants them
        return decoder_layer(self, hidden_states, attn_kwargs)


def _given(kwargs, **named):
    """``kwargs`` plus the named arguments that were given (not None; None is every one's default): a parameter
    transformers renamed (5.24: past_key_values -> cache) then reaches the model under the caller's name only."""
    kwargs.update((k, v) for k, v in named.items() if v is not None)
    return kwargs


def causal_lm_forward(module, labels, logits_to_keep, kwargs):
    """``module``'s own ``*ForCausalLM`` forward, with the LM head and the loss fused where that applies: in
    training with labels, the logits are never formed and the output's ``logits`` is None (as Liger's fused
    linear cross-entropy); otherwise (inference, no labels) the model's forward runs unchanged.

    The model's forward stays in charge: it runs with ``logits_to_keep`` an empty index (the head projects no
    position) and, for that call, a ``loss_function`` that takes the decoder's last hidden state (caught by a
    forward hook) to :func:`causal_lm_loss`. So what the model adds to the loss (MoE load-balancing terms) and
    what else it returns stay its own. ``tritonspec.nn.detectors.is_causal_lm_head`` checks that the model's
    forward is the plain ``loss_function(lm_head(hidden))`` this relies on."""
    original = type(module).forward
    weight = module.lm_head.weight
    if not (
        module.training
        and (labels is not None or kwargs.get("shift_labels") is not None)
        and "_loss_function" not in module.__dict__  # a loss the user set is theirs to run
        and getattr(module, "loss_type", None) in (None, "ForCausalLM")
        and _triton_runs(weight)
    ):
        return original(module, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    hidden = []
    hook = module.get_decoder().register_forward_hook(lambda mod, inputs, out: hidden.append(out[0]))
    module._loss_function = lambda logits, labels, vocab_size, **kw: causal_lm_loss(module, hidden[-1], labels, **kw)
    try:
        out = original(module, labels=labels, logits_to_keep=weight.new_empty(0, dtype=torch.long), **kwargs)
    finally:
        hook.remove()
        del module._loss_function
    if hasattr(out, "keys"):  # a ModelOutput: rebuilt without the (batch, 0, vocab) placeholder logits
        out = type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return out


class CausalLMLoss(nn.Module):
    """Replaces a dense ``*ForCausalLM`` forward (layer name ``CausalLMLoss``; Llama, Mistral, Qwen2/3, Gemma,
    Gemma2/3 with their final logit softcapping, ...): the LM head and the loss as one ``linear_cross_entropy``
    in training (:func:`causal_lm_forward`)."""

    lm_head: nn.Module

    has_backward = True
    can_torch_compile = False  # a hook and a loss function swapped per call: the fused op alone compiles

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return causal_lm_forward(
            self,
            labels,
            logits_to_keep,
            _given(
                kwargs,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
            ),
        )


class MoeCausalLMLoss(nn.Module):
    """``CausalLMLoss`` for the MoE causal LMs' forward signature (``output_router_logits``; Qwen2/3-MoE,
    Mixtral, OLMoE, GPT-OSS): the load-balancing loss is still the model's, added to the fused loss."""

    lm_head: nn.Module

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_router_logits=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return causal_lm_forward(
            self,
            labels,
            logits_to_keep,
            _given(
                kwargs,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                output_router_logits=output_router_logits,
            ),
        )
