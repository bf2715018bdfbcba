"""Which modules of a Hugging Face model a kernel of the kernel table replaces.

The detectors here (``is_rms_norm``, ``is_swiglu_mlp``, ``is_rotate_half_rope``, ``is_fused_experts``,
``is_topk_router``, ``is_llama_decoder_layer``, ``is_(moe_)causal_lm_head``) are what the table's entries name; the
functions below read the table to find, for any declared kernel, the modules it recognizes and the
module-level functions (``apply_rotary_pos_emb``) the model's classes call.

Why structural checks and not only transformers' ``kernel_layer_name`` tags: the tags exist only when
transformers accepts the installed ``kernels`` version (transformers 5.23 wants kernels >=0.18.2,<0.19, so
with kernels 0.17.2 nothing is tagged), and even then MLPs such as ``LlamaMLP`` carry no ``SwiGLUMLP`` tag.
The checks look at what the replacement layer relies on (attributes, child modules, the activation, the
names the original ``forward`` uses), not at per-model class tables that break on every release.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
import weakref
from dataclasses import dataclass

import torch
from torch import nn

# RMSNorm classes whose math differs from Llama's (1 + weight, gating, zero-centred weight).
RMS_NORM_EXCLUDE = ("Gemma", "Gated", "ZeroCentered")
_SILU_NAMES = {"SiLU", "SiLUActivation"}


def _forward_names(cls) -> set[str]:
    """The global and attribute names ``cls.forward`` reads, under its decorators (transformers 5.24 wraps
    the attention forwards in ``deprecate_kwarg``)."""
    fwd = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(fwd) if callable(fwd) else fwd, "__code__", None)
    return set(code.co_names) if code is not None else set()


def is_rms_norm(module: nn.Module, exclude: tuple[str, ...] = RMS_NORM_EXCLUDE) -> bool:
    """An HF Llama-style RMSNorm: ``*RMSNorm`` with a 1-D ``weight``, a float ``variance_epsilon``, no children."""
    cls = type(module)
    name = cls.__name__
    if not name.endswith("RMSNorm") or any(x in name for x in exclude):
        return False
    w = module._parameters.get("weight")
    return (
        w is not None
        and w.dim() == 1
        and set(module._parameters) == {"weight"}
        and not module._modules
        and isinstance(getattr(module, "variance_epsilon", None), float)
        and {"variance_epsilon", "weight"} <= _forward_names(cls)
    )


def is_swiglu_mlp(module: nn.Module) -> bool:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: the three Linear children, a SiLU ``act_fn``, nothing else."""
    mods = module._modules
    if set(mods) - {"act_fn"} != {"gate_proj", "up_proj", "down_proj"}:
        return False
    if not all(isinstance(mods[n], nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(module, "act_fn", None)
    if act is None or type(act).__name__ not in _SILU_NAMES:
        return False
    return {"gate_proj", "up_proj", "down_proj", "act_fn"} <= _forward_names(type(module))


def tagged_name(obj) -> str | None:
    """The layer name a ``use_kernel_forward_from_hub`` decorator (ours, kernels', transformers') put on the class."""
    name = getattr(type(obj), "kernel_layer_name", None)
    return str(name) if name is not None else None


_ROTARY_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per function: probed once, not kept alive


def is_rotate_half_rope(fn) -> bool:
    """Whether a model's ``apply_rotary_pos_emb`` (a function, or kernels' ``Func`` module) is the
    rotate-half formula with cos/sin as wide as the head that the RoPE layer computes.

    Models share the name, not the math (GPT-OSS's takes half-width cos/sin; GLM's interleaves), so the
    function is run once on a small float64 probe and compared with the reference.
    """
    try:
        return _ROTARY_PROBES[fn]
    except (KeyError, TypeError):  # not probed yet, or not weak-referenceable (probed every time)
        pass
    import torch
    from ..ops.rope import rope_ref

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, h, 3, 8, generator=g, dtype=torch.float64) for h in (2, 1))
    cos, sin = (torch.randn(1, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    call = (lambda *a: type(fn).forward(fn, *a)) if isinstance(fn, nn.Module) else fn
    try:
        with torch.no_grad():
            got = call(q, k, cos, sin)
        ok = all(
            isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b)
            for a, b in zip(got, rope_ref(q, k, cos, sin), strict=True)
        )
    except Exception:  # noqa: BLE001 - a function that cannot take the probe is not this formula
        ok = False
    with contextlib.suppress(TypeError):
        _ROTARY_PROBES[fn] = ok
    return ok


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts (``use_experts_implementation``): 3-D ``gate_up_proj``/``down_proj`` in a layout,
    gate and activation the Triton experts compute (``experts_kind``)."""
    params = module._parameters
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return False
    from .experts import experts_kind

    return experts_kind(module) is not None


@dataclass(frozen=True)
class RouterKind:
    """How a top-k router computes ``(router_logits, weights, ids)``: ``moe_route``'s arguments, which of the
    router's tensors it reads, and the dtypes it returns. Built and verified by :func:`router_kind`."""

    top_k: int
    scoring: str  # moe_route's scoring
    renormalize: bool
    bias: bool  # ``bias`` is added to the logits (GPT-OSS)
    correction_bias: bool  # ``e_score_correction_bias`` is added to the scores for choosing (DeepSeek-V3)
    n_group: int | None
    topk_group: int | None
    scaling_factor: float
    float32_logits: bool  # logits from float32 inputs and weight (DeepSeek-V3), else in the input's dtype
    float32_weights: bool  # weights stay float32 (Mixtral), else are cast to the logits' dtype (Qwen, OLMoE, GPT-OSS)


_ROUTER_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per class: {router state: kind or None}
_VERIFIED_ROUTERS: dict[int, RouterKind | None] = {}  # id(router) -> its kind when it last ran eagerly, while it lives
_MISSING = object()
_PROBE_TOKENS = 8


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _router_weight(module: nn.Module):
    """The (experts, hidden) ``weight`` of what may be a top-k router (with an int ``top_k``), else None."""
    w = module._parameters.get("weight")
    top_k = getattr(module, "top_k", None)
    if w is None or w.dim() != 2 or module._modules or not _is_int(top_k) or not 1 <= top_k <= w.shape[0]:
        return None
    return w


def _router_state(module: nn.Module) -> tuple:
    """What a router's math may depend on besides its class: its plain attributes (``training`` included) and
    the names and shapes of its tensors. A change of any of them is probed again, never served stale."""
    plain = tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str, type(None)))))
    tensors = tuple(
        (n, None if t is None else tuple(t.shape)) for d in (module._parameters, module._buffers) for n, t in d.items()
    )
    return plain, tensors


def _router_candidates(module: nn.Module, weight) -> list[RouterKind]:
    """The routings the router's attributes allow: moe_route's arguments from ``top_k``, ``norm_topk_prob``
    (absent: Mixtral always renormalizes, so that first), ``e_score_correction_bias``, ``n_group`` (or
    ``num_group``), ``topk_group``, ``routed_scaling_factor``; each scoring and dtype convention."""
    experts = weight.shape[0]
    bias = module._parameters.get("bias")
    correction = getattr(module, "e_score_correction_bias", None)
    if (
        set(module._parameters) - {"weight", "bias"}
        or getattr(module, "num_experts", experts) != experts
        or (bias is not None and tuple(bias.shape) != (experts,))
        or (correction is not None and tuple(getattr(correction, "shape", ())) != (experts,))
    ):
        return []
    norm = getattr(module, "norm_topk_prob", None)
    renorms = (norm,) if isinstance(norm, bool) else (True, False)
    scaling = getattr(module, "routed_scaling_factor", None)
    common = dict(
        top_k=module.top_k,
        bias=bias is not None,
        correction_bias=correction is not None,
        n_group=getattr(module, "n_group", getattr(module, "num_group", None)),
        topk_group=getattr(module, "topk_group", None),
        scaling_factor=1.0 if scaling is None else scaling,
    )
    return [
        RouterKind(
            scoring=scoring, renormalize=renormalize, float32_logits=f32_logits, float32_weights=f32_weights, **common
        )
        for scoring in ("softmax", "sigmoid", "topk_softmax")
        for renormalize in (renorms if scoring != "topk_softmax" else (False,))  # its weights sum to 1 anyway
        for f32_logits in (False, True)
        for f32_weights in (False, True)
    ]


def _same_routing(got, want) -> bool:
    """Logits and ids equal, every dtype and shape the same; float32 weights equal, and others within two units
    of their dtype's eps (a float32 result cast down once, against the same math run in that dtype)."""
    import torch

    if not (isinstance(want, tuple) and len(want) == 3 and all(isinstance(t, torch.Tensor) for t in want)):
        return False
    for g, w in zip(got, want):
        if g.dtype != w.dtype or g.shape != w.shape:
            return False
    (g_logits, g_weights, g_ids), (w_logits, w_weights, w_ids) = got, want
    if not (torch.equal(g_logits, w_logits) and torch.equal(g_ids, w_ids)):
        return False
    if w_weights.dtype == torch.float32:
        return torch.equal(g_weights, w_weights)
    eps = torch.finfo(w_weights.dtype).eps
    return torch.allclose(g_weights.float(), w_weights.float(), rtol=2 * eps, atol=0.0)


def _probe_router(module: nn.Module, weight, candidates: list[RouterKind]) -> RouterKind | None:
    """The first candidate whose routing is the class forward's on random tensors, else None.

    Two probes: float32, where the candidate must give the very same weights (the same ops in the same order,
    so softmax-then-renormalize does not pass for GPT-OSS's softmax over the top-k logits), and bfloat16,
    where each router's casts show in the dtypes (in float32 they are no-ops). The class forward runs on a
    shallow copy holding the random tensors: the module is neither changed nor called through its hooks
    (transformers records router logits with a forward hook), and a forward already replaced on the
    instance is not what is checked.
    """
    import torch
    from .hub.layers import moe_router

    g = torch.Generator().manual_seed(0)
    hidden = weight.shape[1]

    def rand(t, scale):
        return t if t is None or not t.is_floating_point() else torch.randn(tuple(t.shape), generator=g) * scale

    params = {n: rand(p, hidden**-0.5 if n == "weight" else 1.0) for n, p in module._parameters.items()}
    buffers = {n: rand(b, 0.5) for n, b in module._buffers.items()}
    x = torch.randn(_PROBE_TOKENS, hidden, generator=g)
    probes = []
    for dtype in (torch.float32, torch.bfloat16):
        cast = lambda t: t.to(dtype) if t is not None and t.is_floating_point() else t  # noqa: E731
        probe = object.__new__(type(module))
        probe.__dict__.update(module.__dict__)
        probe.__dict__.pop("forward", None)
        probe.__dict__["_parameters"] = {n: cast(p) for n, p in params.items()}
        probe.__dict__["_buffers"] = {n: cast(b) for n, b in buffers.items()}
        probes.append((probe, cast(x)))
    with torch.no_grad():
        try:
            wants = [type(module).forward(probe, px) for probe, px in probes]
        except Exception:  # noqa: BLE001 - a forward that cannot take the probe is not a router we know
            return None
        for kind in candidates:
            try:
                if all(_same_routing(moe_router(probe, px, kind), want) for (probe, px), want in zip(probes, wants)):
                    return kind
            except (TypeError, ValueError):  # arguments moe_route refuses (a bad n_group, ...)
                continue
    return None


def router_kind(module: nn.Module) -> RouterKind | None:
    """How ``module`` routes, if it is a top-k MoE router whose math ``moe_route`` reproduces, else None.

    Why probed: routers share attribute names, not math (Qwen casts the weights back to the logits' dtype,
    Mixtral keeps float32, DeepSeek-V3 computes the logits in float32, GPT-OSS applies softmax after top-k).
    The candidates read from the attributes are run against the class forward once per class and router
    state (:func:`_router_state`), cached weakly per class.
    """
    if torch.compiler.is_compiling() and id(module) in _VERIFIED_ROUTERS:
        # Traced: the kind this router was verified to have when it last ran eagerly (kernelize verifies every
        # router it installs). Dynamo cannot read a module's __dict__ in every torch release (2.11 breaks the
        # graph there), and a compiled step is replayed without Python anyway.
        return _VERIFIED_ROUTERS[id(module)]
    weight = _router_weight(module)
    if weight is None:
        return None
    probes = _ROUTER_PROBES.setdefault(type(module), {})
    state = _router_state(module)
    kind = probes.get(state, _MISSING)
    if kind is _MISSING:
        kind = probes[state] = _probe_router(module, weight, _router_candidates(module, weight))
    if id(module) not in _VERIFIED_ROUTERS:
        weakref.finalize(module, _VERIFIED_ROUTERS.pop, id(module), None)
    _VERIFIED_ROUTERS[id(module)] = kind
    return kind


def is_topk_router(module: nn.Module) -> bool:
    """A top-k MoE router ``moe_route`` computes exactly (:func:`router_kind`)."""
    return router_kind(module) is not None


# What a Llama-style decoder layer holds, and all its forward reads (besides its arguments).
_DECODER_CHILDREN = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})
_DECODER_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per class: bool


class _ProbeChild(nn.Module):
    """A decoder layer's child in the probe: a fixed nonlinear map of its input, logging how it was called
    (positional count, keyword names, and which non-tensor objects were passed on)."""

    def __init__(self, name: str, log: list, scale: float, pair: bool):
        super().__init__()
        self.name, self.log, self.scale, self.pair = name, log, scale, pair

    def forward(self, *args, **kwargs):
        import torch

        self.log.append(
            (
                self.name,
                len(args),
                tuple(sorted((k, None if isinstance(v, torch.Tensor) else id(v)) for k, v in kwargs.items())),
            )
        )
        x = args[0] if args else kwargs["hidden_states"]
        y = torch.tanh(x * self.scale) + self.scale
        return (y, object()) if self.pair else y


# Parameters transformers renamed between releases, under the name the hub layers use (5.24: past_key_values ->
# cache). The layers pass on only the arguments they were given, so either name reaches the model's modules.
_RENAMED = {"cache": "past_key_values"}


def _signature(fn) -> list | None:
    """(name, kind, default) of each parameter, renamed parameters under the hub layers' names."""
    try:
        return [(_RENAMED.get(p.name, p.name), p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return None


def _probe_decoder_layer(cls: type) -> bool:
    """Whether ``cls.forward`` computes what the ``DecoderLayer`` hub layer does, on stand-in children.

    Its forward must read nothing but the four children and take the hub layer's parameters (names up to
    :data:`_RENAMED`, kinds, defaults); then it runs once in float64 with a :class:`_ProbeChild` per child and a
    distinct object per argument, next to ``decoder_layer`` on its own stand-ins: the outputs must agree, and the
    children must be called in the same order, the same way, with every argument passed on unchanged to
    ``self_attn``. Tried with an ``mlp`` returning a tensor, then an ``(output, router scores)`` pair (GPT-OSS).
    """
    import torch
    from .hub.layers import DecoderLayer, decoder_layer

    forward = inspect.unwrap(cls.forward)  # transformers' GradientCheckpointingLayer wraps it
    code = getattr(forward, "__code__", None)
    if code is None or set(code.co_names) != _DECODER_CHILDREN:
        return False
    params = _signature(forward)
    if params is None or params != _signature(DecoderLayer.forward):
        return False
    args = {
        p.name: object()
        for p in list(inspect.signature(forward).parameters.values())[2:]  # its own names
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    }
    args["probe_kwarg"] = object()  # **kwargs are passed on too
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def run(fn, mlp_pair):
        log: list = []
        probe = object.__new__(cls)
        nn.Module.__init__(probe)
        for i, name in enumerate(sorted(_DECODER_CHILDREN)):
            setattr(
                probe,
                name,
                _ProbeChild(name, log, 0.5 + 0.25 * i, pair=name == "self_attn" or (name == "mlp" and mlp_pair)),
            )
        probe.training = False
        return fn(probe), log

    with torch.no_grad():
        for mlp_pair in (False, True):
            try:
                got, got_log = run(lambda p: cls.forward(p, x, **args), mlp_pair)
            except Exception:  # noqa: BLE001 - a forward that cannot take the probe is not this layer
                continue
            want, want_log = run(lambda p: decoder_layer(p, x, args), mlp_pair)
            if (
                isinstance(got, torch.Tensor)
                and got.shape == want.shape
                and torch.allclose(got, want)
                and got_log == want_log
            ):
                return True
    return False


def is_llama_decoder_layer(module: nn.Module) -> bool:
    """A pre-norm decoder layer whose forward is ``h = x + self_attn(input_layernorm(x));
    h + mlp(post_attention_layernorm(h))`` over Llama-style RMSNorms (:func:`is_rms_norm`): what the
    ``DecoderLayer`` hub layer computes with the residual add fused into the post-attention norm.

    Why a probe and not a class list: models share this structure under many names (dozens of transformers 5
    classes) while others with the same children differ (Gemma's norms, Gemma2/3's and OLMo2's extra norms,
    Granite's residual scaling, Phi-3's dropouts). The children are checked on the instance, the forward once
    per class (:func:`_probe_decoder_layer`).
    """
    mods = module._modules
    if set(mods) != _DECODER_CHILDREN or not (
        is_rms_norm(mods["input_layernorm"]) and is_rms_norm(mods["post_attention_layernorm"])
    ):
        return False
    cls = type(module)
    ok = _DECODER_PROBES.get(cls)
    if ok is None:
        ok = _DECODER_PROBES[cls] = _probe_decoder_layer(cls)
    return ok


# All a causal LM's forward may read for the fused head + loss to stand in for it: Llama's and the other dense
# models' (transformers 5.x; 5.17 slices with isinstance/slice/int, 5.24 says cache for past_key_values), the
# MoE models' load-balancing loss, and Gemma2/3's final logit softcapping (applied inside the fused loss).
# Anything else (Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier) changes the
# logits and leaves the model alone.
_CAUSAL_LM_NAMES = frozenset(
    {
        "CausalLMOutputWithPast",
        "attentions",
        "config",
        "hidden_states",
        "last_hidden_state",
        "lm_head",
        "loss_function",
        "model",
        "past_key_values",
        "cache",
        "slice_logits_to_keep",
        "vocab_size",
        "isinstance",
        "slice",
        "int",
        "MoeCausalLMOutputWithPast",
        "device",
        "load_balancing_loss_func",
        "num_experts",
        "num_experts_per_tok",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_logits",
        "to",
        "final_logit_softcapping",
        "tanh",
        "torch",
    }
)


def is_causal_lm_head(module: nn.Module) -> bool:
    """A dense ``*ForCausalLM`` the ``CausalLMLoss`` hub layer may serve (:func:`_fusable_causal_lm`)."""
    from .hub.layers import CausalLMLoss

    return _fusable_causal_lm(module, CausalLMLoss)


def is_moe_causal_lm_head(module: nn.Module) -> bool:
    """An MoE ``*ForCausalLM`` (``output_router_logits`` in its forward) ``MoeCausalLMLoss`` may serve."""
    from .hub.layers import MoeCausalLMLoss

    return _fusable_causal_lm(module, MoeCausalLMLoss)


def _fusable_causal_lm(module: nn.Module, layer: type) -> bool:
    """A ``*ForCausalLM`` whose forward is ``loss_function(lm_head(decoder(...).last_hidden_state), labels)``
    with an ``nn.Linear`` head, nothing that rescales the logits (:data:`_CAUSAL_LM_NAMES`), and the
    parameters of ``layer``'s forward (names, kinds, defaults): what that hub layer computes without logits."""
    cls = type(module)
    if not cls.__name__.endswith("ForCausalLM") or not isinstance(module._modules.get("lm_head"), nn.Linear):
        return False
    if not callable(getattr(module, "get_decoder", None)):
        return False
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    if code is None or not {"lm_head", "loss_function"} <= set(code.co_names) <= _CAUSAL_LM_NAMES:
        return False
    if "final_logit_softcapping" not in code.co_names and getattr(module.config, "final_logit_softcapping", None):
        return False  # a softcap in the config the forward does not apply: not what the fused loss would do
    return _signature(forward) == _signature(layer.forward)


def infer_layer_name(module: nn.Module) -> str | None:
    """The layer name of the first declared kernel that recognizes an untagged module (by class name,
    then by its structural detector), else None."""
    from ..kernel_table import KERNELS

    name = type(module).__name__
    for kernel in KERNELS.values():
        layer = kernel.layer
        if kernel.site != "module" or layer is None:
            continue
        if name in layer.classes:
            return layer.name
        detect = layer.detector()
        if detect is not None and detect(module):
            return layer.name
    return None


def function_sites(model: nn.Module) -> list[tuple[object, types.ModuleType, str, object]]:
    """(kernel, python module, attribute, original value) for each module-level function a declared
    kernel replaces (``site="function"``) that the model's classes call, once per python module.

    The original is a plain function when transformers built the model without ``kernels``, or the
    ``Func`` module the kernels decorator made; where the layer declares a detector, only originals it
    accepts are listed. If a front end has already replaced the global, it
    is the value that front end replaced, so re-running a front end works.
    """
    from ..kernel_table import KERNELS
    from .engine import shared_original

    out = []
    classes = {type(m) for m in model.modules()}
    for kernel in KERNELS.values():
        if kernel.site != "function":
            continue
        attr = kernel.layer.function
        seen = set()
        for cls in classes:
            if attr not in _forward_names(cls):
                continue
            pymod = sys.modules.get(cls.__module__)
            fn = shared_original(pymod, attr, getattr(pymod, attr, None))
            if fn is None or id(pymod) in seen:
                continue
            if not (inspect.isfunction(fn) or isinstance(fn, nn.Module)):
                continue
            detect = kernel.layer.detector()
            if detect is not None and not detect(fn):
                continue
            seen.add(id(pymod))
            out.append((kernel, pymod, attr, fn))
    return out
