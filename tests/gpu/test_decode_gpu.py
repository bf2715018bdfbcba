"""Decode in CUDA graphs on the GPU: kernelized models (every MoE family and Llama, all three front ends) generate
under transformers' static cache and compile path, with their steps captured as CUDA graphs, and give the
original model's greedy tokens (teacher-forced: each generated token is the original's greedy choice within
its own bf16 rounding), replaying the same tokens, our attention taking the prompt's calls.

bf16, random weights (the LM head drawn 10x wider than the rest: larger margins between candidate tokens).
Free-running tokens of two correct bf16 implementations part at the first near-tie, hence the teacher-forced
check. The compile path is transformers' default one (Inductor, ``mode="reduce-overhead"``: CUDA-graph trees)
with ``fullgraph=True``. Every family through ``kernelize``; Llama and Qwen3-MoE through all three front ends.
"""

import copy

import pytest
from helpers import KERNEL_RULES, MOE_ARCHITECTURES, apply_front_end, available_models, build_model
import torch

import tritonspec.nn as tnn
from tritonspec.nn import attention as nn_attention

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

FAMILIES = ["llama"] + available_models(MOE_ARCHITECTURES)
SIZES = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=1024,
    num_hidden_layers=2,
)
# the MoE families' own fields at these sizes (the rest of MOE_ARCHITECTURES' tiny settings stay)
MOE = {
    "qwen3_moe": dict(moe_intermediate_size=256, head_dim=64),
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=512),
    "gpt_oss": dict(head_dim=64, layer_types=["full_attention"] * SIZES["num_hidden_layers"]),
    "deepseek_v3": dict(moe_intermediate_size=256, num_key_value_heads=SIZES["num_attention_heads"]),  # MLA
}
NEW = 24


def _model(name):
    attn = "eager" if name == "gpt_oss" else "sdpa"  # GPT-OSS's sinks have no SDPA path
    model = build_model(name, torch.bfloat16, attn, seed=1234, device="cuda", moe=MOE.get(name), **SIZES).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _inputs(batch=2, prompt=40):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, SIZES["vocab_size"], (batch, prompt), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    return ids, mask


CASES = [(name, "kernelize") for name in FAMILIES] + [
    (name, front) for name in ("llama", "qwen3_moe") if name in FAMILIES for front in ("registry", "rules")
]


def _greedy_misses(model, tokens, mask, prompt):
    """Generated positions whose token is not the original model's greedy choice within its own bf16 rounding.

    Teacher-forced: the original model (bf16, and a float32 copy as the reference) reads the generated sequence
    once; a choice counts as greedy if its float32 logit is within twice the bf16 model's own largest logit error
    of the float32 maximum (free-running tokens of two correct bf16 implementations part at the first near-tie)."""
    full = torch.cat([mask, mask.new_ones(mask.shape[0], tokens.shape[1] - mask.shape[1])], dim=1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)
    logits16 = model(tokens, attention_mask=full, position_ids=positions).logits.float()
    logits32 = copy.deepcopy(model).float()(tokens, attention_mask=full, position_ids=positions).logits
    noise = (logits16 - logits32).abs().amax().item()
    scores, chosen = logits32[:, prompt - 1 : -1], tokens[:, prompt:]
    gap = scores.amax(-1) - scores.gather(-1, chosen[..., None])[..., 0]
    return int((gap > 2 * noise + 1e-3).sum()), noise


@pytest.mark.parametrize("name, front", CASES)
def test_graph_decode_gives_the_original_greedy_tokens(name, front):
    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model(name)
    with torch.no_grad():
        apply_front_end(front, model, KERNEL_RULES, inference=True)
        config = transformers.CompileConfig(fullgraph=True)  # Inductor, reduce-overhead
        kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache_implementation="static")
        nn_attention.fallbacks.clear()
        first = model.generate(ids, compile_config=config, **kw)  # records the graphs
        again = model.generate(ids, compile_config=config, **kw)  # replays them
        tnn.revert(model)
        misses, noise = _greedy_misses(model, first, mask, ids.shape[1])
    assert torch.equal(again, first)
    assert misses == 0, (
        f"{name}/{front}: {misses} of {first[:, ids.shape[1] :].numel()} tokens not greedy (noise {noise})"
    )
    if front != "rules" and name != "deepseek_v3":  # MLA's value head differs from its query head: SDPA
        # no eager call (the prompt's) fell back; tests/test_nn_decode.py reads the compiled step's ops
        assert not nn_attention.fallbacks, dict(nn_attention.fallbacks)


@pytest.mark.parametrize("name", [n for n in ("llama", "qwen3_moe", "mixtral", "gpt_oss") if n in FAMILIES])
def test_graph_decoder_replays_one_captured_step_with_the_original_greedy_tokens(name):
    """tritonspec.nn.GraphDecoder: Inductor-compiled step captured in one CUDA graph, replayed for every token;
    greedy tokens teacher-forced against the original model; a second prompt replays the same graph."""
    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model(name)
    with torch.no_grad():
        apply_front_end("kernelize", model, KERNEL_RULES, inference=True)
        decoder = tnn.GraphDecoder(model, max_cache_len=ids.shape[1] + NEW, batch_size=2)
        first = decoder.generate(ids, mask, max_new_tokens=NEW)
        graph = decoder._graph
        shorter = decoder.generate(ids[:, 5:], mask[:, 5:], max_new_tokens=NEW)
        again = decoder.generate(ids, mask, max_new_tokens=NEW)
        tnn.revert(model)
        misses, noise = _greedy_misses(model, first, mask, ids.shape[1])
        misses_shorter, _ = _greedy_misses(model, shorter, mask[:, 5:], ids.shape[1] - 5)
    assert graph is not None and decoder._graph is graph  # captured once, replayed by the later prompts
    assert torch.equal(again, first)
    assert misses == 0 and misses_shorter == 0, f"{name}: {misses} + {misses_shorter} tokens not greedy ({noise})"


def test_graph_decoder_captures_again_after_the_model_changed():
    """Replaying a graph captured before revert would run the replaced kernels: the decoder captures again, and
    its tokens are the reverted model's greedy ones."""
    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model("qwen3_moe")
    with torch.no_grad():
        tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
        decoder = tnn.GraphDecoder(model, max_cache_len=ids.shape[1] + NEW, batch_size=2)
        decoder.generate(ids, mask, max_new_tokens=NEW)
        kernelized_graph = decoder._graph
        tnn.revert(model)
        got = decoder.generate(ids, mask, max_new_tokens=NEW)
        misses, noise = _greedy_misses(model, got, mask, ids.shape[1])
    assert kernelized_graph is not None and decoder._graph is not None and decoder._graph is not kernelized_graph
    assert misses == 0, f"{misses} tokens not greedy ({noise})"


@pytest.mark.parametrize("name", [n for n in ("qwen3_moe", "mixtral", "gpt_oss") if n in FAMILIES])
def test_offloaded_graph_decode_gives_the_original_greedy_tokens(name):
    """Offloaded experts in the captured step: resident experts from their slots, the others read in place from
    page-locked host memory, and promotions between steps (evicting and refilling slots under the captured
    graph, every 4 tokens). Greedy tokens teacher-forced against the original model, as above (the step's kernels
    give one store's bits exactly, tests/test_moe_decode.py; the eager prompt's waves of slots add in float32);
    the graph is captured once and replayed across the promotions; revert gives the weights back."""
    from tritonspec.nn.offload import offload_experts

    torch._dynamo.reset()
    ids, mask = _inputs()
    model = _model(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
        handle = offload_experts(model, experts_per_layer=3, cpu_compute=False)
        decoder = tnn.GraphDecoder(model, max_cache_len=ids.shape[1] + NEW, batch_size=2, check_every=4)
        first = decoder.generate(ids, mask, max_new_tokens=NEW)
        graph = decoder._graph
        again = decoder.generate(ids, mask, max_new_tokens=NEW)
        stats = handle.stats()
        handle.revert()
        tnn.revert(model)
        misses = [_greedy_misses(model, tokens, mask, ids.shape[1]) for tokens in (first, again)]
    assert graph is not None and decoder._graph is graph
    assert stats["mapped"] > 0 and stats["promoted"] > 0 and stats["hits"] > 0, stats
    assert [m for m, _ in misses] == [0, 0], f"{name}: tokens not greedy {misses}"
    for n, p in model.named_parameters():
        assert p.device == before[n].device and torch.equal(p, before[n]), n
