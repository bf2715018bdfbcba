"""Kernelized models generate under transformers' static cache and compile path, as a single graph per step.

Every family (dense and MoE), through each front end, on the Triton interpreter: ``generate`` with
``cache_implementation="static"`` and a ``CompileConfig(fullgraph=True)`` (so any graph break is an error) must
give the greedy tokens of the original model's eager generate, with our decode kernels traced into the step.
A batch with left padding makes the step's mask a real one. Also ``torch.compile(model.forward, fullgraph=True)``
around a decode step on a ``StaticCache``, as users write it.
"""

import pytest
from helpers import KERNEL_RULES, MOE_ARCHITECTURES, TINY, apply_front_end, available_models, build_model
import torch

import tritonspec.nn as tnn

transformers = pytest.importorskip("transformers")

FAMILIES = available_models() + available_models(MOE_ARCHITECTURES)
SIZES = dict(TINY, num_hidden_layers=2)
NEW = 4


def _model(name):
    extra = dict(layer_types=["full_attention"] * SIZES["num_hidden_layers"]) if name == "gpt_oss" else None
    attn = "eager" if name == "gpt_oss" else "sdpa"  # GPT-OSS's sinks have no SDPA path
    model = build_model(name, torch.float32, attn, seed=1234, moe=extra, **SIZES).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _inputs():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 96, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the step's mask is not all ones
    return ids, mask


class Recorder:
    """A torch.compile backend that runs each graph as traced and keeps the ops it calls: proof that our ops are
    in the compiled step (a spy's count would be traced into the graph, a guard on it a recompile every step)."""

    def __init__(self):
        self.ops = set()
        self.graphs = 0

    def __deepcopy__(self, memo):  # transformers copies its CompileConfig: the copy must record here
        return self

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward


def _compiled_generate(model, ids, mask, backend):
    config = transformers.CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles on accelerators only unless asked
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        cache_implementation="static",
        compile_config=config,
    )


CASES = [(name, "kernelize") for name in FAMILIES] + [
    (name, front) for name in ("llama", "qwen3_moe") if name in FAMILIES for front in ("registry", "rules")
]


@pytest.mark.parametrize("name, front", CASES)
def test_static_cache_generate_compiles_to_one_graph_with_the_original_tokens(name, front):
    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model(name)
    backend = Recorder()
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        apply_front_end(front, model, KERNEL_RULES, inference=True)
        got = _compiled_generate(model, ids, mask, backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # every decode step replays the first step's graph; transformers' sliding-window cache layers (Mistral) make
    # Dynamo compile once more, with or without our kernels (a guard on the layer's int length, then dynamic)
    types = getattr(model.config, "layer_types", None)
    sliding = "sliding_attention" in types if types else getattr(model.config, "sliding_window", None) is not None
    assert backend.graphs == (2 if sliding else 1)
    assert ("tritonspec.moe_experts_inference.default" in backend.ops) == (name in MOE_ARCHITECTURES)
    if front != "rules" and name != "deepseek_v3":  # MLA's value head differs from its query head: SDPA
        assert "tritonspec.attention_decode.default" in backend.ops
    tnn.revert(model)


@pytest.mark.parametrize("name", [n for n in ("llama", "qwen3_moe") if n in FAMILIES])
def test_a_compiled_decode_step_on_a_static_cache_is_one_graph(name):
    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model(name)
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    tnn.use_tritonspec_attention(model, source="test")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    backend = Recorder()
    step = torch.compile(model.forward, fullgraph=True, backend=backend)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: as generate numbers them
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        full = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
        nxt = torch.tensor([[5], [9]])
        got = step(nxt, attention_mask=full, past_key_values=cache, position_ids=positions[:, -1:] + 1).logits
        everything = torch.cat([ids, nxt], dim=1)
        want = model(everything, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits[:, -1:]
    assert "tritonspec.attention_decode.default" in backend.ops and backend.graphs == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tnn.revert(model)


def test_key_bounds_pass_through_transformers_as_a_prepared_mask():
    """generate hands a static cache's masks back to the model: ours must look like a prepared 4-D mask there
    and come back as the same bounds."""
    from transformers.masking_utils import _preprocess_mask_arguments

    from tritonspec.nn.attention import bounds_mask, mask_bounds

    bounds = torch.tensor([[[0, 0, 2]], [[1, 2, 5]]], dtype=torch.int32).expand(2, 3, 3)  # (2, batch, q)
    mask = bounds_mask(bounds)
    model = _model("llama")
    early_exit, passed, *_ = _preprocess_mask_arguments(model.config, torch.empty(3, 3, 32), mask, None, None, 0)
    assert early_exit and passed is mask
    assert torch.equal(mask_bounds(mask), bounds)
    assert mask_bounds(mask) is mask_bounds(mask)  # every layer reads one view: what the kernels derive is kept
    assert mask_bounds(torch.ones(3, 1, 3, 2, dtype=torch.bool)) is None  # transformers' own masks are not bounds


def test_a_router_s_verified_kind_is_forgotten_with_it():
    """Under compile the routers' kinds come from a record of their eager runs, kept only while they live."""
    import gc

    from tritonspec.nn import detectors

    model = _model("qwen3_moe")
    router = model.model.layers[0].mlp.gate
    kind = detectors.router_kind(router)
    assert kind is not None and detectors._VERIFIED_ROUTERS[id(router)] is kind
    key = id(router)
    del model, router
    gc.collect()
    assert key not in detectors._VERIFIED_ROUTERS


# GraphDecoder: our greedy loop over one compiled step (captured in a CUDA graph on a GPU; here it runs as traced)
DECODER_FAMILIES = [n for n in ("llama", "qwen3_moe", "mistral", "gpt_oss") if n in FAMILIES]


@pytest.mark.parametrize("name", DECODER_FAMILIES)
def test_graph_decoder_gives_generate_s_greedy_tokens_from_one_compiled_step(name):
    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model(name)
    backend = Recorder()
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW + 2, do_sample=False)
        tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
        if name != "gpt_oss":
            tnn.use_tritonspec_attention(model, source="test")
        decoder = tnn.GraphDecoder(model, max_cache_len=16, batch_size=2, compile_backend=backend)
        got = decoder.generate(ids, mask, max_new_tokens=NEW + 2)
        again = decoder.generate(ids[:, 2:], mask[:, 2:], max_new_tokens=3)  # a shorter prompt, the same step
        want_again = model.generate(ids[:, 2:], attention_mask=mask[:, 2:], max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want_again, rtol=0, atol=0)
    types = getattr(model.config, "layer_types", None)
    sliding = "sliding_attention" in types if types else getattr(model.config, "sliding_window", None) is not None
    assert backend.graphs == (2 if sliding else 1)
    if name in MOE_ARCHITECTURES:
        assert "tritonspec.moe_experts_inference.default" in backend.ops
    if name != "gpt_oss":
        assert "tritonspec.attention_decode.default" in backend.ops
    tnn.revert(model)


def test_graph_decoder_stops_and_pads_as_generate_does():
    ids, mask = _inputs()
    model = _model("llama")
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        eos = int(free[0, ids.shape[1] + 1])  # the first row's second new token: it ends there
        kwargs = dict(max_new_tokens=8, eos_token_id=eos, pad_token_id=3)
        want = model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)
        decoder = tnn.GraphDecoder(model, max_cache_len=16, batch_size=2, compile_backend=None, check_every=2)
        got = decoder.generate(ids, mask, **kwargs)
        never = decoder.generate(ids, mask, max_new_tokens=8, eos_token_id=[])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got[0, ids.shape[1] + 2 :] == 3).all()
    torch.testing.assert_close(never, free, rtol=0, atol=0)


def test_graph_decoder_follows_a_reverted_model():
    """A decoder made for the kernelized model decodes the original one after revert (on a GPU its captured
    graph would run the replaced forwards: it captures again)."""
    ids, mask = _inputs()
    model = _model("qwen3_moe") if "qwen3_moe" in FAMILIES else _model("llama")
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    decoder = tnn.GraphDecoder(model, max_cache_len=16, batch_size=2, compile_backend=None)
    with torch.no_grad():
        decoder.generate(ids, mask, max_new_tokens=3)
        before = decoder._model_state
        tnn.revert(model)
        got = decoder.generate(ids, mask, max_new_tokens=3)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert decoder._model_state != before
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_graph_decoder_rejects_bad_input():
    ids, mask = _inputs()
    model = _model("llama")
    decoder = tnn.GraphDecoder(model, max_cache_len=12, batch_size=2, compile_backend=None)
    bad = [
        (dict(input_ids=ids[:1], max_new_tokens=2), "input_ids: expected batch 2"),
        (dict(input_ids=ids.int(), max_new_tokens=2), "input_ids: expected a 2-D int64"),
        (dict(input_ids=ids, max_new_tokens=6), "exceed the decoder's max_cache_len=12"),
        (dict(input_ids=ids, max_new_tokens=0), "max_new_tokens: expected a positive int"),
        (dict(input_ids=ids, attention_mask=mask.flip(1), max_new_tokens=2), "padding on the left"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:], max_new_tokens=2), "attention_mask: expected the shape"),
        (dict(input_ids=ids, max_new_tokens=2, eos_token_id=list(range(9))), "eos_token_id: expected at most 8"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            decoder.generate(**kwargs)
    with pytest.raises(ValueError, match="max_cache_len: expected a positive int"):
        tnn.GraphDecoder(model, max_cache_len=0)
    with pytest.raises(TypeError, match="model: expected a transformers causal LM"):
        tnn.GraphDecoder(torch.nn.Linear(2, 2), max_cache_len=8)
