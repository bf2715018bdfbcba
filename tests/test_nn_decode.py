"""Kernelized models generate under transformers' static cache and compile path, as a single graph per step.

Every family (dense and MoE), through each front end, on the Triton interpreter: ``generate`` with
``cache_implementation="static"`` and a ``CompileConfig(fullgraph=True)`` (so any graph break is an error) must
give the greedy tokens of the original model's eager generate, with our decode kernels traced into the step.
A batch with left padding makes the step's mask a real one. Also ``torch.compile(model.forward, fullgraph=True)``
around a decode step on a ``StaticCache``, as users write it.
"""

import pytest
from helpers import KERNEL_RULES, MOE_ARCHITECTURES, apply_front_end, available_models, build_model
import torch

import tritonspec.nn as tnn

transformers = pytest.importorskip("transformers")

FAMILIES = available_models() + available_models(MOE_ARCHITECTURES)
SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    num_hidden_layers=2,
)
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
