"""Real transformers models (random weights, tiny configs) through all three front ends, on the Triton
interpreter: logits, loss and every parameter gradient must be as close to a float64 run of the original
model as the original model itself is, the Triton ops must actually have run, and revert must restore it.

Tolerance model: both the original fp32/bf16 model and the kernelized one round differently from the
float64 reference; a correct kernel changes *where* rounding happens, not how much. So the kernelized
error must stay within ``FACTOR`` times the original's error plus a floor of a few units in the last place
of the output's magnitude (the floor covers outputs the original happens to round almost exactly). The
models, the tolerance and the comparison are helpers.py's (test_nn_interop.py uses them too).
"""

import copy

import pytest
from helpers import RULES, available_models, compare_to_original, no_interpreter, run_model, tiny_model, token_ids
import torch

import tritonspec.nn as tnn

transformers = pytest.importorskip("transformers")

MODELS = available_models()


def _assert_reverted(model):
    assert tnn.report(model) == []
    assert all("forward" not in vars(m) for m in model.modules())
    from transformers.models.llama import modeling_llama

    assert modeling_llama.apply_rotary_pos_emb.__module__ == modeling_llama.__name__


def _front_end(front, model):
    if front == "registry":
        tnn.apply_available_kernels(model)
        expected = {"rms_norm", "add_rms_norm", "swiglu", "rope", "attention"}
    elif front == "kernelize":
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
        expected = {"rms_norm", "add_rms_norm", "swiglu", "rope", "attention"}  # attention: attn_implementation
    else:
        rep = tnn.apply_rules(model, RULES)
        assert {c.what for c in rep} == {"forward", "module"}
        expected = {"rms_norm", "add_rms_norm", "swiglu"}
    return expected


@pytest.mark.parametrize("front", ["registry", "kernelize", "rules"])
@pytest.mark.parametrize("model_name", MODELS)
def test_fp32_model_matches_original(model_name, front, spy):
    if front == "kernelize":
        tnn.register_attention()
    ids = token_ids(96)
    ref = run_model(tiny_model(model_name, torch.float64), ids)
    original = tiny_model(model_name, torch.float32)
    base = run_model(original, ids)
    model = tiny_model(model_name, torch.float32, attn="tritonspec" if front == "kernelize" else "sdpa")
    expected = _front_end(front, model)
    spy.clear()
    got = run_model(model, ids)
    assert expected <= set(spy), f"ops that did not run: {expected - set(spy)}"
    compare_to_original(model_name, got, base, ref, torch.float32)

    undone = tnn.revert(model)
    assert len(undone) > 0
    if front != "kernelize":
        _assert_reverted(model)
        spy.clear()
        again = run_model(model, ids)
        assert spy == {}
        torch.testing.assert_close(again[0], base[0], rtol=0, atol=0)  # the very same code path as the original


def test_bf16_llama_registry(spy):
    ids = token_ids(96)
    ref = run_model(tiny_model("llama", torch.float64), ids)
    base = run_model(tiny_model("llama", torch.bfloat16), ids)
    model = tiny_model("llama", torch.bfloat16)
    tnn.apply_available_kernels(model)
    got = run_model(model, ids)
    assert {"rms_norm", "add_rms_norm", "swiglu", "rope", "attention"} <= set(spy)
    compare_to_original("llama bf16", got, base, ref, torch.bfloat16)
    tnn.revert(model)


def test_kernelize_then_torch_compile(spy):
    """can_torch_compile=True layers stay installed in TRAINING|TORCH_COMPILE and compile (aot_eager on CPU)."""
    ids = token_ids(96)
    ref = run_model(tiny_model("qwen3", torch.float64), ids)
    base = run_model(tiny_model("qwen3", torch.float32), ids)
    model = tiny_model("qwen3", torch.float32)
    tnn.kernelize(model, mode=tnn.Mode.TRAINING | tnn.Mode.TORCH_COMPILE)
    assert len(tnn.report(model)) >= 5
    compiled = torch.compile(model, backend="aot_eager")
    got = run_model(model, ids, call=compiled)
    assert {"rms_norm", "add_rms_norm", "swiglu", "rope"} <= set(spy)
    compare_to_original("qwen3 compiled", got, base, ref, torch.float32)
    tnn.revert(model)
    torch._dynamo.reset()


def test_front_ends_compose_and_revert_together(spy):
    model = tiny_model("llama", torch.float32)
    original = copy.deepcopy(model)
    ids = token_ids(96)
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


def test_shared_rotary_patch_is_safe_for_other_models(monkeypatch, spy):
    """kernelize replaces the module-level apply_rotary_pos_emb, which every Llama in the process calls: a
    float64 model, or a CPU model when Triton cannot run there, must keep working on the reference formula."""
    ids = token_ids(96)
    other = tiny_model("llama", torch.float64)
    with torch.no_grad():
        before = other(input_ids=ids).logits
    model = tnn.kernelize(tiny_model("llama", torch.float32), mode=tnn.Mode.INFERENCE)
    with torch.no_grad():
        spy.clear()
        after = other(input_ids=ids).logits  # fp64: the Triton ops do not take it
        assert "rope" not in spy
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        no_interpreter(monkeypatch)  # as if on a CPU without the interpreter
        ref32 = tiny_model("llama", torch.float32)
        spy.clear()
        torch.testing.assert_close(model(input_ids=ids).logits, ref32(input_ids=ids).logits)
        assert spy == {}
    tnn.revert(model)


def test_kernelized_model_copies_pickles_and_collects_cleanly(spy):
    """A deep copy of a kernelized model runs our kernels and reverts on its own; pickling one is a clear error;
    the module-level apply_rotary_pos_emb patch lasts exactly as long as a model holding it."""
    import gc
    import io
    from transformers.models.llama import modeling_llama

    stock = modeling_llama.apply_rotary_pos_emb
    ids = token_ids(96)
    model = tnn.kernelize(tiny_model("llama", torch.float32), mode=tnn.Mode.INFERENCE)
    assert modeling_llama.apply_rotary_pos_emb is not stock
    twin = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        spy.clear()
        torch.testing.assert_close(twin(input_ids=ids).logits, ref, rtol=0, atol=0)
    assert {"rms_norm", "rope"} <= set(spy)
    with pytest.raises(TypeError, match="cannot pickle a model changed by tritonspec"):
        torch.save(model, io.BytesIO())
    assert tnn.report(twin) == tnn.report(model)
    tnn.revert(twin)
    assert tnn.report(twin) == [] and all("forward" not in vars(m) for m in twin.modules())
    assert len(tnn.report(model)) > 0 and modeling_llama.apply_rotary_pos_emb is not stock  # the original's stay
    del model
    gc.collect()  # dropped without revert: nothing of it may stay patched
    assert modeling_llama.apply_rotary_pos_emb is stock


def _example_plugin():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "transformers_tests" / "kernelize_plugin.py"
    spec = importlib.util.spec_from_file_location("kernelize_plugin", path)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return plugin


def test_the_example_plugin_kernelizes_each_model_on_its_first_call(monkeypatch, spy):
    """examples/transformers_tests' pytest plugin: a model's first call kernelizes it, our attention included
    where it ran SDPA, and trains as the original does; a second call does not kernelize it again."""
    from transformers import PreTrainedModel

    plugin = _example_plugin()
    monkeypatch.setattr(PreTrainedModel, "__call__", PreTrainedModel.__call__)  # put back after the test
    kernelized, real = [], tnn.kernelize

    def kernelize(model, **kwargs):
        kernelized.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(tnn, "kernelize", kernelize)
    ids = token_ids(96)
    ref = run_model(tiny_model("llama", torch.float64), ids)
    base = run_model(tiny_model("llama", torch.float32), ids)
    plugin.pytest_configure(None)
    model = tiny_model("llama", torch.float32)
    spy.clear()
    got = run_model(model, ids)
    got = run_model(model, ids)  # a model called again is not kernelized again
    assert kernelized == [model] and model.config._attn_implementation == "tritonspec"
    assert {"rms_norm", "add_rms_norm", "swiglu", "rope", "attention"} <= set(spy)
    compare_to_original("llama", got, base, ref, torch.float32)


def test_the_example_plugin_leaves_a_model_it_fails_on_as_it_was(monkeypatch):
    """Our attention failing to go in after kernelize: the call raises, and the model is the one the test
    built (nothing replaced, attention as it was, every weight bit-identical)."""
    from transformers import PreTrainedModel

    plugin = _example_plugin()
    monkeypatch.setattr(PreTrainedModel, "__call__", PreTrainedModel.__call__)  # put back after the test

    def broken(model, **kwargs):
        raise RuntimeError("attention refused")

    monkeypatch.setattr(tnn, "use_tritonspec_attention", broken)
    plugin.pytest_configure(None)
    model = tiny_model("llama", torch.float32)
    weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="attention refused"):
        model(input_ids=token_ids(96))
    assert tnn.report(model) == [] and model.config._attn_implementation == "sdpa"
    assert all("forward" not in vars(m) for m in model.modules())
    state = model.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[n], w) for n, w in weights.items())
