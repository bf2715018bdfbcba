"""The decoder-layer fusion (kernel ``add_rmsnorm``, hub layer ``DecoderLayer``) in real transformers models, on the
Triton interpreter: the residual add after attention runs inside the post-attention RMSNorm (``ops.add_rms_norm``).

Where it applies: every decoder layer of Llama, Qwen3, Qwen3-MoE (router logits in the loss) and GPT-OSS (an MLP
returning a pair), through the front ends, and the report says so. Numerics are compared with the same model and
front end with the fusion undone (``engine.restore`` on each decoder layer): every other kernel stays, so only the
fused op differs. It forms ``residual + attention output`` in the input dtype as the layer does and normalizes that
with the RMSNorm kernel's own code; its backward adds the residual's gradient to dx inside the kernel where autograd
adds it outside, one two-term float32 sum either way. So on the interpreter the models come out bitwise equal; a
compiled kernel may contract that add into an FMA, hence a bound of a few float32 eps at each tensor's magnitude.

Where it does not: layers of another structure (Gemma's ``1 + weight`` norms, Gemma2's and OLMo2's extra norms,
Granite's residual scaling, Phi-3's dropouts, Mixtral's forward signature) are left alone by every front end.
"""

import pytest
from helpers import TINY, apply_front_end, build_model, no_interpreter, run_model, token_ids
import torch
from torch import nn

import tritonspec.nn as tnn
from tritonspec.nn import engine
from tritonspec.nn.detectors import is_llama_decoder_layer

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

FUSED = "tritonspec.nn.hub.layers.DecoderLayer.forward"
LAYERS = ["model.layers.0", "model.layers.1"]
# Rules that fit dense and MoE models alike: the fused decoder layers and the RMSNorms, named by kernel.
FUSION_RULES = """
- match: {kernel: add_rmsnorm}
  replace: {kernel: add_rmsnorm}
- match: {kernel: rmsnorm}
  replace: {kernel: rmsnorm}
"""


_BUILT = []


@pytest.fixture(autouse=True)
def _revert_built():
    """Revert every model a test built, so no shared patch (``apply_rotary_pos_emb``) outlives the test."""
    yield
    while _BUILT:
        tnn.revert(_BUILT.pop())


def _model(name, dtype=torch.float32):
    moe = {
        "qwen3_moe": {"output_router_logits": True},  # the router logits reach the loss
        "gpt_oss": {"layer_types": ["full_attention"] * len(LAYERS)},
    }.get(name)
    attn = "eager" if name == "gpt_oss" else "sdpa"  # transformers has no SDPA path for GPT-OSS's attention sinks
    model = build_model(name, dtype, attn, seed=1234, moe=moe, **dict(TINY, num_hidden_layers=len(LAYERS)))
    _BUILT.append(model)
    return model


def _apply(front, model):
    """Apply a front end; the paths of the decoder layers it fused. The fused LM head + loss is taken back off
    (``engine.restore`` on the model): these tests run each model once per step and read its logits."""
    apply_front_end(front, model, FUSION_RULES)
    engine.restore(model, model)
    return [c.path for c in tnn.report(model) if c.kernel == FUSED]


def _unfuse(model):
    for path in LAYERS:
        assert engine.restore(model, model.get_submodule(path))


def _assert_same(got, want):
    """run_model results: equal up to a few float32 eps at each tensor's magnitude (module docstring)."""
    (lg, sg, gg), (lw, sw, gw) = got, want
    assert gg.keys() == gw.keys()
    for what, g, w in [("logits", lg, lw), ("loss", sg, sw)] + [(f"grad {n}", gg[n], gw[n]) for n in gw]:
        atol = 4 * torch.finfo(torch.float32).eps * w.abs().max().item()
        torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=lambda m, what=what: f"{what}: {m}")


# Every front end on Llama; Qwen3 (RMSNorms inside the attention) and Qwen3-MoE through the fast two (the registry
# also switches the attention to the Triton kernel, seconds on the interpreter; test_nn_models runs it fused);
# GPT-OSS, whose MLP returns (output, router scores).
@pytest.mark.parametrize(
    "name, front",
    [
        ("llama", "registry"),
        ("llama", "kernelize"),
        ("llama", "rules"),
        ("qwen3", "kernelize"),
        ("qwen3", "rules"),
        ("qwen3_moe", "kernelize"),
        ("qwen3_moe", "rules"),
        ("gpt_oss", "kernelize"),
    ],
)
def test_fused_layers_match_the_unfused_model(name, front, spy):
    ids = token_ids(96)
    fused, unfused = _model(name), _model(name)
    assert _apply(front, fused) == LAYERS
    assert _apply(front, unfused) == LAYERS
    _unfuse(unfused)
    spy.clear()
    want = run_model(unfused, ids)
    assert "add_rms_norm" not in spy
    got = run_model(fused, ids)
    assert spy["add_rms_norm"] == len(LAYERS)
    _assert_same(got, want)


def test_revert_restores_the_original_forward(spy):
    ids = token_ids(96)
    model, original = _model("llama"), _model("llama")
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    assert [c.path for c in tnn.revert(model) if c.kernel == FUSED] == LAYERS
    assert tnn.report(model) == [] and all("forward" not in vars(m) for m in model.modules())
    spy.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)
    assert spy == {}


# -- where it must not apply ----------------------------------------------------------------------------------------

REFUSED = [  # (config class, model class, config overrides, why its decoder layers are not the fused layer)
    (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2),
        "forward(hidden_states, position_embeddings, attention_mask, ...): another signature",
    ),
    ("GemmaConfig", "GemmaForCausalLM", {}, "GemmaRMSNorm scales by 1 + weight"),
    ("Gemma2Config", "Gemma2ForCausalLM", {}, "pre/post feed-forward norms, the post-attention norm before the add"),
    ("GraniteConfig", "GraniteForCausalLM", {}, "its forward scales the residual branches (residual_multiplier)"),
    ("Olmo2Config", "Olmo2ForCausalLM", {}, "no input norm: post-norms on the attention and MLP outputs"),
    ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0), "residual dropouts"),
]


@pytest.mark.parametrize("config_cls, model_cls, overrides, why", REFUSED, ids=[r[1] for r in REFUSED])
def test_layers_of_another_structure_are_left_alone(config_cls, model_cls, overrides, why):
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    cfg = getattr(transformers, config_cls)(**dict(TINY, num_hidden_layers=len(LAYERS)), **overrides)
    model = getattr(transformers, model_cls)._from_config(cfg)
    _BUILT.append(model)
    assert not is_llama_decoder_layer(model.model.layers[0]), why
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    tnn.apply_available_kernels(model)
    assert tnn.report(model) and FUSED not in tnn.report(model).counts()
    with pytest.raises(tnn.RuleError, match="matched no module"):
        tnn.apply_rules(model, FUSION_RULES)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.o_proj = nn.Linear(8, 8)

    def forward(self, hidden_states, **kwargs):
        return self.o_proj(hidden_states), None


class _Block(nn.Module):
    """Llama's decoder layer written anew, in no transformers module: recognized by what it does, not its name."""

    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(8), LlamaRMSNorm(8)
        self.self_attn, self.mlp = _Attention(), nn.Linear(8, 8)

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
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class _SandwichNorm(_Block):
    """The same children and signature; the post-attention norm on the attention output (OLMo2's order)."""

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
        attn, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        return hidden_states + self.mlp(hidden_states)


class _Parallel(_Block):
    """Attention and MLP side by side on the same input (GPT-J's order)."""

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
        attn, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        return hidden_states + attn + self.mlp(self.post_attention_layernorm(hidden_states))


class _DropsAnArgument(_Block):
    """Llama's order, but ``position_ids`` never reaches the attention."""

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
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class _ExtraChild(_Block):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.0)


@pytest.mark.parametrize(
    "cls, fused",
    [(_Block, True), (_SandwichNorm, False), (_Parallel, False), (_DropsAnArgument, False), (_ExtraChild, False)],
)
def test_detection_reads_the_forward_not_the_name(cls, fused):
    model = nn.Sequential(cls())
    assert is_llama_decoder_layer(model[0]) is fused
    tnn.kernelize(model, mode=tnn.Mode.TRAINING, device="cpu")
    assert (FUSED in tnn.report(model).counts()) is fused
    if fused:  # and the fused forward computes what the layer did
        x = torch.randn(2, 3, 8)
        with torch.no_grad():
            torch.testing.assert_close(model(x), cls.forward(model[0], x))
    tnn.revert(model)


# -- where the fused op does not run: the layer's own formula -----------------------------------------------------


@pytest.mark.parametrize("case", ["float64", "no interpreter"])
def test_unsupported_dtype_or_device_falls_back(case, monkeypatch, spy):
    """A float64 model, or a model kernelized where Triton runs and then run where it does not (a CPU copy)."""
    ids = token_ids(96)
    dtype = torch.float64 if case == "float64" else torch.float32
    model, original = _model("llama", dtype), _model("llama", dtype)
    assert _apply("kernelize", model) == LAYERS
    if case == "no interpreter":
        no_interpreter(monkeypatch)
    spy.clear()
    with torch.no_grad():
        got = model(input_ids=ids).logits
        assert spy == {}
        torch.testing.assert_close(got, original(input_ids=ids).logits, rtol=0, atol=0)  # the same formula


def test_hooked_post_attention_norm_is_called(spy):
    """A hook on the norm (activation capture; FSDP2 unsharding a norm sharded on its own) must see it run."""
    ids = token_ids(96)
    model, unfused = _model("llama"), _model("llama")
    for m in (model, unfused):
        _apply("kernelize", m)
    _unfuse(unfused)
    seen = []
    for path in LAYERS:
        model.get_submodule(path).post_attention_layernorm.register_forward_hook(lambda *a: seen.append(1))
    spy.clear()
    got = run_model(model, ids)
    assert len(seen) == len(LAYERS) and "add_rms_norm" not in spy
    _assert_same(got, run_model(unfused, ids))


def test_gradient_checkpointing_runs_the_class_forward(spy):
    """transformers checkpoints inside the class forward; the fused instance forward hands over to it."""
    ids = token_ids(96)
    model, unfused = _model("llama"), _model("llama")
    for m in (model, unfused):
        _apply("kernelize", m)
    _unfuse(unfused)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    checkpointed = []
    for path in LAYERS:
        layer = model.get_submodule(path)
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=inner, **k: checkpointed.append(1) or _f(*a, **k)
    spy.clear()
    got = run_model(model, ids)
    assert len(checkpointed) == len(LAYERS) and "add_rms_norm" not in spy
    _assert_same(got, run_model(unfused, ids))
