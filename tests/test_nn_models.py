"""Real transformers models (random weights, tiny configs) through all three front ends, on the Triton
interpreter: logits, loss and every parameter gradient must be as close to a float64 run of the original
model as the original model itself is, the Triton ops must actually have run, and revert must restore it.

Tolerance model: both the original fp32/bf16 model and the kernelized one round differently from the
float64 reference; a correct kernel changes *where* rounding happens, not how much. So the kernelized
error must stay within ``FACTOR`` times the original's error plus a floor of a few units in the last place
of the output's magnitude (the floor covers outputs the original happens to round almost exactly).
"""
import copy

import pytest
import torch

import tritonspec.devices

import tritonspec.nn as tnn
from tritonspec.nn.hub import layers as hub_layers

transformers = pytest.importorskip("transformers")

FACTOR = 2.0
ULPS = {torch.float32: 64, torch.bfloat16: 4}  # floor, in units of eps(dtype) * max|reference|


def _cfg(name, **kw):
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=96, max_position_embeddings=64, num_hidden_layers=1, **kw)
    if name == "llama":
        return transformers.LlamaConfig(**{**common, "num_hidden_layers": 2})
    if name == "qwen2":
        return transformers.Qwen2Config(**common)
    if name == "qwen3":
        return transformers.Qwen3Config(head_dim=8, **common)
    if name == "mistral":
        return transformers.MistralConfig(**common)
    raise ValueError(name)


_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}
MODELS = [m for m in _CLASSES if hasattr(transformers, _CLASSES[m])]


def _build(name, dtype, attn="sdpa"):
    torch.manual_seed(1234)
    cfg = _cfg(name)
    model = getattr(transformers, _CLASSES[name])._from_config(cfg, attn_implementation=attn)
    return model.to(dtype)


def _inputs(vocab):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    return ids


def _run(model, ids, call=None):
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.fixture
def spy(monkeypatch):
    """Count calls of the Triton ops the hub layers, tritonspec.nn.RMSNorm and the attention use."""
    import importlib
    counts = {}

    def wrap(modname, fn_name, *also):
        mod = importlib.import_module(modname)
        orig = getattr(mod, fn_name)

        def counted(*a, **k):
            counts[fn_name] = counts.get(fn_name, 0) + 1
            return orig(*a, **k)
        monkeypatch.setattr(mod, fn_name, counted)
        for other in also:
            monkeypatch.setattr(importlib.import_module(other), fn_name, counted)

    wrap("tritonspec.ops.rms_norm", "rms_norm", "tritonspec.nn.layers")
    wrap("tritonspec.ops.swiglu", "swiglu", "tritonspec.nn.layers")
    wrap("tritonspec.ops.rope", "rope")
    wrap("tritonspec.ops.attention", "attention")
    monkeypatch.setattr(hub_layers, "_IMPORTED", {})
    return counts


def _assert_like_reference(name, got, base, ref, dtype):
    ref = ref.double()
    err_got = (got.double() - ref).abs().max().item()
    err_base = (base.double() - ref).abs().max().item()
    floor = ULPS[dtype] * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1e-30)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert err_got <= FACTOR * err_base + floor, (
        f"{name}: kernelized error {err_got:.3g} vs original {err_base:.3g} (allowed {FACTOR}x + {floor:.3g})")


def _compare(model_name, got, base, ref, dtype):
    (lg, ls, gg), (lb, lsb, gb), (lr, lsr, gr) = got, base, ref
    _assert_like_reference(f"{model_name} logits", lg, lb, lr, dtype)
    _assert_like_reference(f"{model_name} loss", ls, lsb, lsr, dtype)
    assert gg.keys() == gr.keys()
    for n in gr:
        _assert_like_reference(f"{model_name} grad {n}", gg[n], gb[n], gr[n], dtype)


def _assert_reverted(model):
    assert tnn.report(model) == []
    assert all("forward" not in vars(m) for m in model.modules())
    from transformers.models.llama import modeling_llama
    assert modeling_llama.apply_rotary_pos_emb.__module__ == modeling_llama.__name__


RULES = r"""
- match: {name: "\\.mlp$"}
  replace: {class: tritonspec.nn.hub.layers.SwiGLUMLP}
  recursive: false
- match: {name: "norm$", class: torch.nn.modules.module.Module}
  replace: {class: tritonspec.nn.RMSNorm}
"""


def _front_end(front, model):
    if front == "registry":
        tnn.apply_available_kernels(model)
        expected = {"rms_norm", "swiglu", "rope", "attention"}
    elif front == "kernelize":
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
        expected = {"rms_norm", "swiglu", "rope", "attention"}  # attention: built with attn_implementation
    else:
        rep = tnn.apply_rules(model, RULES)
        assert {c.what for c in rep} == {"forward", "module"}
        expected = {"rms_norm", "swiglu"}
    return expected


@pytest.mark.parametrize("front", ["registry", "kernelize", "rules"])
@pytest.mark.parametrize("model_name", MODELS)
def test_fp32_model_matches_original(model_name, front, spy):
    if front == "kernelize":
        tnn.register_attention()
    ids = _inputs(96)
    ref = _run(_build(model_name, torch.float64), ids)
    original = _build(model_name, torch.float32)
    base = _run(original, ids)
    model = _build(model_name, torch.float32, attn="tritonspec" if front == "kernelize" else "sdpa")
    expected = _front_end(front, model)
    spy.clear()
    got = _run(model, ids)
    assert expected <= set(spy), f"ops that did not run: {expected - set(spy)}"
    _compare(model_name, got, base, ref, torch.float32)

    undone = tnn.revert(model)
    assert len(undone) > 0
    if front != "kernelize":
        _assert_reverted(model)
        spy.clear()
        again = _run(model, ids)
        assert spy == {}
        torch.testing.assert_close(again[0], base[0], rtol=0, atol=0)  # the very same code path as the original


def test_bf16_llama_registry(spy):
    ids = _inputs(96)
    ref = _run(_build("llama", torch.float64), ids)
    base = _run(_build("llama", torch.bfloat16), ids)
    model = _build("llama", torch.bfloat16)
    tnn.apply_available_kernels(model)
    got = _run(model, ids)
    assert {"rms_norm", "swiglu", "rope", "attention"} <= set(spy)
    _compare("llama bf16", got, base, ref, torch.bfloat16)
    tnn.revert(model)


def test_kernelize_then_torch_compile(spy):
    """can_torch_compile=True layers stay installed in TRAINING|TORCH_COMPILE and compile (aot_eager on CPU)."""
    ids = _inputs(96)
    ref = _run(_build("qwen3", torch.float64), ids)
    base = _run(_build("qwen3", torch.float32), ids)
    model = _build("qwen3", torch.float32)
    tnn.kernelize(model, mode=tnn.Mode.TRAINING | tnn.Mode.TORCH_COMPILE)
    assert len(tnn.report(model)) >= 5
    compiled = torch.compile(model, backend="aot_eager")
    got = _run(model, ids, call=compiled)
    assert {"rms_norm", "swiglu", "rope"} <= set(spy)
    _compare("qwen3 compiled", got, base, ref, torch.float32)
    tnn.revert(model)
    torch._dynamo.reset()


def test_front_ends_compose_and_revert_together(spy):
    model = _build("llama", torch.float32)
    original = copy.deepcopy(model)
    ids = _inputs(96)
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    n_kernelized = len(tnn.report(model))
    tnn.apply_available_kernels(model)  # re-patches the same targets: one entry each, first original kept
    rep = tnn.report(model)
    assert len(rep) == n_kernelized + 1  # + the attention switch, which kernelize does not do
    assert {c.source for c in rep} == {"registry"}
    tnn.revert(model)
    _assert_reverted(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)


def test_attention_falls_back_to_sdpa_with_padding(spy):
    """A padded batch needs a mask our kernel does not take: the SDPA path runs and results still match."""
    tnn.register_attention()
    ids = _inputs(96)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model = _build("llama", torch.float32, attn="tritonspec")
    original = _build("llama", torch.float32)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        assert "attention" not in spy
        ref = original(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, ref)


def test_shared_rotary_patch_is_safe_for_other_models(monkeypatch, spy):
    """kernelize replaces the module-level apply_rotary_pos_emb, which every Llama in the process calls: a
    float64 model, or a CPU model when Triton cannot run there, must keep working on the reference formula."""
    ids = _inputs(96)
    other = _build("llama", torch.float64)
    with torch.no_grad():
        before = other(input_ids=ids).logits
    model = tnn.kernelize(_build("llama", torch.float32), mode=tnn.Mode.INFERENCE)
    with torch.no_grad():
        spy.clear()
        after = other(input_ids=ids).logits  # fp64: the Triton ops do not take it
        assert "rope" not in spy
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        monkeypatch.setattr(tritonspec.devices, "_interpreting", False)  # as if on a CPU without the interpreter
        ref32 = _build("llama", torch.float32)
        spy.clear()
        torch.testing.assert_close(model(input_ids=ids).logits, ref32(input_ids=ids).logits)
        assert spy == {}
    tnn.revert(model)
