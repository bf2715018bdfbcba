"""transformers models on our attention with padded, packed and sliding-window batches (CPU interpreter).

The mask function hands the layers key intervals instead of a 4-D mask; these tests check that what the
model computes is what transformers' own attention computes on the same batch (logits of real tokens,
the loss, every parameter's gradient), that our kernel ran for every layer and nothing fell back, and that
masks which are not intervals, and transformers' own switch, still take transformers' paths.
"""

import pytest
from helpers import TINY, build_model, token_ids
import torch

import tritonspec.nn as tnn
from tritonspec.nn import attention as nn_attention

transformers = pytest.importorskip("transformers")

S = 40
WINDOW = 6  # below the sequences' lengths, so the windows cut

# name -> (extra config sizes, MoE overrides, the reference attention)
MODELS = {
    "llama": ({}, None, "sdpa"),
    "mistral": ({"sliding_window": WINDOW}, None, "sdpa"),
    "gpt_oss": ({"sliding_window": WINDOW}, {"layer_types": ["sliding_attention", "full_attention"]}, "eager"),
}


def _model(name, attn):
    sizes, moe, _ = MODELS[name]
    return build_model(name, torch.float32, attn, seed=99, moe=moe, **dict(TINY, num_hidden_layers=2, **sizes))


def _batch(kind):
    ids = token_ids(96, batch=2, seq=S)
    if kind == "packed":  # sequences of 13, 0... restarting positions, as packing collators write them
        cuts = [(0, 13, 31, 40), (0, 25, 40)]
        pos = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(c[:-1], c[1:])]) for c in cuts])
        # transformers masks packed sequences only without a cache, as training frameworks run
        return dict(input_ids=ids, position_ids=pos, use_cache=False), torch.ones_like(ids, dtype=torch.bool)
    mask = torch.ones_like(ids)
    if kind == "left":
        mask[0, :11] = 0
    else:
        mask[1, 29:] = 0
    return dict(input_ids=ids, attention_mask=mask), mask.bool()


def _step(model, inputs, real):
    model.zero_grad(set_to_none=True)
    labels = inputs["input_ids"].masked_fill(~real, -100)
    out = model(**inputs, labels=labels)
    out.loss.backward()
    return out.logits.detach()[real], out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["left", "right", "packed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_masked_batches_match_transformers(name, kind, spy):
    tnn.register_attention()
    inputs, real = _batch(kind)
    want = _step(_model(name, MODELS[name][2]), inputs, real)
    nn_attention.fallbacks.clear()
    spy.clear()
    got = _step(_model(name, "tritonspec"), inputs, real)
    assert spy.get("attention") == 2, f"our attention ran {spy.get('attention')} times for 2 layers"
    assert not nn_attention.fallbacks, dict(nn_attention.fallbacks)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for n, g in got[2].items():
        scale = max(1.0, want[2][n].abs().max().item())
        torch.testing.assert_close(g, want[2][n], rtol=0, atol=2e-5 * scale, msg=lambda m, n=n: f"grad of {n}: {m}")


def test_windows_and_packing_change_the_result(spy):
    """Guards the test above: the window and the packing must matter at these sizes, or it proves nothing."""
    tnn.register_attention()
    model = _model("mistral", "tritonspec")
    inputs, real = _batch("packed")
    with torch.no_grad():
        packed = model(**inputs).logits
        across = model(**dict(inputs, use_cache=True)).logits  # a cache: transformers does not mask the packing
        plain = model(input_ids=inputs["input_ids"]).logits
        model.config.sliding_window = None
        unwindowed = model(input_ids=inputs["input_ids"]).logits
    assert (packed - across).abs().max() > 1e-3
    assert (plain - unwindowed).abs().max() > 1e-3


def test_a_mask_that_is_not_intervals_takes_sdpa(spy):
    """A 4-D mask with holes (a user's own) reaches the layers as it is: SDPA runs it, and the fallback is counted
    (more queries than a decode step has: the decode kernel, which reads dense masks, is not asked)."""
    tnn.register_attention()
    ids = token_ids(96, batch=1, seq=20)
    keep = torch.ones(20, 20, dtype=torch.bool).tril()
    keep[8:, 3] = False  # a hole in the middle of rows 8..19
    mask = keep[None, None]
    ours, ref = _model("llama", "sdpa"), _model("llama", "sdpa")
    nn_attention.use_tritonspec_attention(ours)
    (before,) = [c.detail for c in tnn.report(ours) if c.what == "attn_implementation"]
    nn_attention.fallbacks.clear()
    spy.clear()
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
    assert "attention" not in spy
    assert nn_attention.fallbacks["a mask whose rows are not key intervals"] == 2
    torch.testing.assert_close(got, want)
    (after,) = [c.detail for c in tnn.report(ours) if c.what == "attn_implementation"]  # the report says so
    assert "SDPA" not in before and after.endswith("2 call(s) for a mask whose rows are not key intervals")
    tnn.revert(ours)


def test_a_decode_step_reads_a_mask_with_holes_as_it_is(spy):
    """A few queries without gradients: the decode kernel takes a dense mask exactly, holes included."""
    tnn.register_attention()
    ids = token_ids(96, batch=1, seq=12)
    keep = torch.ones(12, 12, dtype=torch.bool).tril()
    keep[8:, 3] = False
    ours, ref = _model("llama", "sdpa"), _model("llama", "sdpa")
    nn_attention.use_tritonspec_attention(ours)
    nn_attention.fallbacks.clear()
    spy.clear()
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=keep[None, None]).logits
        want = ref(input_ids=ids, attention_mask=keep[None, None]).logits
    assert spy.get("attention_decode") == 2 and not nn_attention.fallbacks
    torch.testing.assert_close(got, want)
    tnn.revert(ours)


def test_set_attn_implementation_switches_away_and_back(spy):
    tnn.register_attention()
    model = _model("llama", "sdpa")
    change = nn_attention.use_tritonspec_attention(model)
    assert change is not None and model.config._attn_implementation == "tritonspec"
    inputs, _ = _batch("left")
    for impl, ours in (("sdpa", False), ("tritonspec", True), ("eager", False)):
        model.set_attn_implementation(impl)
        spy.clear()
        with torch.no_grad():
            model(**inputs)
        assert ("attention" in spy) == ours, impl
    tnn.revert(model)
    assert model.config._attn_implementation == "sdpa"


def test_generation_with_a_padded_cache_and_a_window(spy):
    """Decoding: left padding and a window shorter than the cache; greedy tokens equal SDPA's, with no fallback."""
    tnn.register_attention()
    ids = token_ids(96, batch=2, seq=10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    nn_attention.fallbacks.clear()
    spy.clear()
    got = (
        _model("mistral", "tritonspec")
        .eval()
        .generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    )
    want = (
        _model("mistral", "sdpa").eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    )
    # the prompt (10 queries, no gradients) and every step: the decode kernel, reading transformers' dense masks
    assert spy.get("attention_decode", 0) >= 2 * 8 and not nn_attention.fallbacks, dict(nn_attention.fallbacks)
    assert torch.equal(got, want)
