"""transformers MoE models (random weights, tiny configs) with tritonspec's experts, on the Triton interpreter.

The registry's MOE kernel switches ``experts_implementation`` to ``"tritonspec"``; logits, loss (with the
auxiliary load-balancing loss: ``output_router_logits=True``) and every gradient (router included) must be
as close to a float64 run of the model's own eager experts as the
original ``grouped_mm`` model is (helpers.compare_to_original's tolerance model). One layer, so every
router sees the same input in both models and picks the same experts.
"""
import pytest
from helpers import MOE_ARCHITECTURES, available_models, build_model, compare_to_original, run_model, token_ids
import torch

import tritonspec.nn as tnn
from tritonspec.nn.experts import EXPERTS_NAME

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

MODELS = available_models(MOE_ARCHITECTURES)
SIZES = dict(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
             max_position_embeddings=64, num_hidden_layers=1, output_router_logits=True)


def _model(name, dtype, experts=None, **sizes):
    attn = "eager" if name == "gpt_oss" else "sdpa"  # GPT-OSS's attention sinks: eager only
    model = build_model(name, dtype, attn, seed=4321, **dict(SIZES, **sizes))
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


@pytest.mark.parametrize("model_name", MODELS)
def test_registry_switches_experts_and_matches_original(model_name, spy):
    ids = token_ids(96)
    ref = run_model(_model(model_name, torch.float64, "eager"), ids)
    base = run_model(_model(model_name, torch.float32), ids)
    model = _model(model_name, torch.float32)
    before = model.config._experts_implementation
    tnn.apply_available_kernels(model)
    assert model.config._experts_implementation == EXPERTS_NAME
    spy.clear()
    got = run_model(model, ids)
    assert spy.get("moe_experts", 0) >= 1, "the Triton experts did not run"
    compare_to_original(model_name, got, base, ref, torch.float32)
    tnn.revert(model)
    assert model.config._experts_implementation == before


def test_bf16_qwen3_moe(spy):
    ids = token_ids(96)
    ref = run_model(_model("qwen3_moe", torch.float64, "eager"), ids)
    base = run_model(_model("qwen3_moe", torch.bfloat16), ids)
    model = _model("qwen3_moe", torch.bfloat16)
    tnn.register_experts()
    model.set_experts_implementation(EXPERTS_NAME)
    got = run_model(model, ids)
    assert spy.get("moe_experts", 0) >= 1
    compare_to_original("qwen3_moe bf16", got, base, ref, torch.bfloat16)


def test_unsupported_activation_runs_transformers_grouped_mm(spy):
    """A GELU expert is not the kernel's: transformers' grouped_mm runs, the very same code as the original."""
    ids = token_ids(96)
    base = run_model(_model("mixtral", torch.float32, hidden_act="gelu"), ids)
    model = _model("mixtral", torch.float32, hidden_act="gelu")
    assert tnn.use_tritonspec_experts(model) is not None
    assert model.config._experts_implementation == EXPERTS_NAME
    spy.clear()
    got = run_model(model, ids)
    assert "moe_experts" not in spy
    torch.testing.assert_close(got[0], base[0], rtol=0, atol=0)


def test_gpt_oss_keeps_its_attention_and_rotary():
    """GPT-OSS's sinks need its eager attention, and its apply_rotary_pos_emb takes half-width cos/sin:
    the registry switches its experts and leaves both be."""
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama

    from tritonspec.nn.targets import is_rotate_half_rope
    rotary = modeling_gpt_oss.apply_rotary_pos_emb
    assert not is_rotate_half_rope(rotary) and is_rotate_half_rope(modeling_llama.apply_rotary_pos_emb)
    model = _model("gpt_oss", torch.float32)
    tnn.apply_available_kernels(model)
    assert model.config._attn_implementation == "eager"
    assert model.config._experts_implementation == EXPERTS_NAME
    assert modeling_gpt_oss.apply_rotary_pos_emb is rotary
    tnn.revert(model)


def test_dense_models_are_left_alone():
    model = build_model("llama", torch.float32, seed=1, **SIZES)
    assert tnn.use_tritonspec_experts(model) is None
    assert all(c.what != "experts_implementation" for c in tnn.report(model))
