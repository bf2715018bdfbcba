"""The fused LM head + loss (kernel ``linear_cross_entropy``, hub layer ``CausalLMLoss``) in real transformers
models, on the Triton interpreter.

In training with labels the model's forward runs with the head projecting nothing and its loss taken by
``ops.linear_cross_entropy`` from the decoder's last hidden state: the loss and every parameter gradient must
equal the unfused model's (float32; the fused loss sums in another order, so a few eps), including what the
model adds to it (Qwen3-MoE's load-balancing term), Gemma2's final logit softcapping, tied embeddings,
``num_items_in_batch`` and ignored labels; ``logits`` is None there, as with Liger. In eval mode, or without
labels, the model's own forward runs and returns its logits. Models whose forward rescales the logits
(Cohere, Granite) are left alone.
"""

import pytest
from helpers import TINY, apply_front_end, build_model, token_ids
import torch

import tritonspec.nn as tnn
from tritonspec.nn.detectors import is_causal_lm_head

transformers = pytest.importorskip("transformers")

FUSED = ("tritonspec.nn.hub.layers.CausalLMLoss.forward", "tritonspec.nn.hub.layers.MoeCausalLMLoss.forward")
RULES = """
- match: {kernel: linear_cross_entropy}
  replace: {kernel: linear_cross_entropy}
"""
MOE_RULES = RULES.replace("linear_cross_entropy", "moe_linear_cross_entropy")


def _model(name, **extra):
    moe = {"output_router_logits": True} if name == "qwen3_moe" else None
    return build_model(
        name,
        torch.float32,
        "eager" if name == "gemma2" else "sdpa",
        seed=99,
        moe=moe,
        **dict(TINY, num_hidden_layers=2),
        **extra,
    )


def _gemma2(**extra):
    cfg = transformers.Gemma2Config(**dict(TINY, num_hidden_layers=2, head_dim=8, final_logit_softcapping=5.0), **extra)
    torch.manual_seed(99)
    return transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="eager")


def _apply(front, model):
    report = apply_front_end(front, model, MOE_RULES if "Moe" in type(model).__name__ else RULES)
    return [c.path for c in report if c.kernel in FUSED]


def _step(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _labels(vocab):
    labels = token_ids(vocab).clone()
    labels[0, :3] = -100  # a prompt the loss ignores
    labels[1, -2] = -100
    return labels


def _assert_same(got, want):
    (out, grads), (ref, ref_grads) = got, want
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(out.loss, ref.loss, rtol=16 * eps, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        atol = 64 * eps * max(ref_grads[name].abs().max().item(), 1e-30)
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("front", ["registry", "kernelize", "rules"])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gemma2"])
def test_loss_and_gradients_equal_the_unfused_model(name, front):
    model = _gemma2() if name == "gemma2" else _model(name)
    ids = token_ids(model.config.vocab_size)
    labels = _labels(model.config.vocab_size)
    want = _step(model, ids, labels)
    assert want[0].logits is not None
    assert _apply(front, model) == [""]  # the root module: the causal LM itself
    got = _step(model, ids, labels)
    assert got[0].logits is None  # never formed in training (Liger's convention)
    if name == "qwen3_moe":
        assert got[0].aux_loss is not None  # the model still adds its load-balancing term
    _assert_same(got, want)
    tnn.revert(model)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings_and_num_items_in_batch(tied):
    model = _model("llama", tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids, labels = token_ids(model.config.vocab_size), _labels(model.config.vocab_size)
    n_items = torch.tensor(23)  # transformers' gradient accumulation: the sum over a larger batch's count
    want = _step(model, ids, labels, num_items_in_batch=n_items)
    tnn.apply_rules(model, RULES)
    _assert_same(_step(model, ids, labels, num_items_in_batch=n_items), want)
    tnn.revert(model)


def test_inference_and_label_free_calls_run_the_model_unchanged():
    model = _model("llama")
    ids = token_ids(model.config.vocab_size)
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids)
    tnn.apply_rules(model, RULES)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
        model.train()
        unlabelled = model(input_ids=ids)
    assert torch.equal(unlabelled.logits, want.logits)
    tnn.revert(model)


def test_a_loss_function_the_user_set_is_kept():
    model = _model("llama")
    ids = token_ids(model.config.vocab_size)
    seen = []

    def custom(logits, labels, vocab_size, **kwargs):
        seen.append(logits.shape)
        return logits.float().logsumexp(-1).mean()

    model.loss_function = custom
    tnn.apply_rules(model, RULES)
    out = model(input_ids=ids, labels=ids)
    assert seen == [(*ids.shape, model.config.vocab_size)] and out.logits is not None
    tnn.revert(model)


@pytest.mark.parametrize("cls", ["CohereForCausalLM", "GraniteForCausalLM"])
def test_models_that_rescale_logits_are_left_alone(cls):
    if not hasattr(transformers, cls):
        pytest.skip(f"no {cls} in this transformers")
    config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**dict(TINY, num_hidden_layers=1))
    model = getattr(transformers, cls)._from_config(config)
    assert not is_causal_lm_head(model)
    with pytest.raises(ValueError, match="matched no module"):
        tnn.apply_rules(model, RULES)


def test_a_softcap_the_forward_does_not_apply_is_refused():
    model = _model("llama")
    assert is_causal_lm_head(model)
    model.config.final_logit_softcapping = 30.0
    assert not is_causal_lm_head(model)
