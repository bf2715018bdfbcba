"""Offloaded experts on a CUDA GPU: the real side stream, events, pinned rows and CPU compute.

A bf16 Qwen3-MoE and Mixtral of moderate size (hidden 1024, 4 layers, real expert counts) with their
experts offloaded must give the logits of the same model with everything on the GPU (bf16 tolerance
against a float64 run), in every mode that moves data differently: copies in waves through few slots,
prefetch, CPU compute, the disk tier; and ``generate()`` must produce the same tokens.
"""

import pytest
from helpers import assert_like_reference, build_model, token_ids
import torch

from tritonspec.nn.offload import offload_experts

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

SIZES = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=512,
)
MOE = {
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=384, head_dim=128),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=3584),
}
MODES = [
    dict(experts_per_layer=4, cpu_compute=False, policy="lru"),
    dict(experts_per_layer=16, cpu_compute="auto", policy="lfu"),
    dict(experts_per_layer=6, cpu_compute=True, policy="frequency"),
    dict(experts_per_layer=8, cpu_compute=False, storage="disk"),
]


def _model(name, dtype):
    model = build_model(name, dtype, seed=0, init_dtype=torch.float32, moe=MOE[name], **SIZES).eval()
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("name", list(MOE))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_offloaded_matches_all_on_gpu(name, mode, tmp_path):
    ids = token_ids(SIZES["vocab_size"], batch=2, seq=64).cuda()
    with torch.no_grad():
        ref = _model(name, torch.float64).cuda()(input_ids=ids).logits
        torch.cuda.empty_cache()
        base_model = _model(name, torch.bfloat16).cuda()
        base = base_model(input_ids=ids).logits
    model = _model(name, torch.bfloat16)  # on the CPU: the experts never go to the GPU whole
    if mode.get("storage") == "disk":
        model.save_pretrained(tmp_path)
        mode = dict(mode, checkpoint=tmp_path)
    handle = offload_experts(model, device="cuda", **mode)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
        tokens = model.generate(ids[:1, :8], do_sample=False, max_new_tokens=8, min_new_tokens=8)
        # Each generated token must be the all-on-GPU model's choice, or lose to it by no more than the
        # offloaded model's own rounding difference (random bf16 models have near-ties).
        chosen = base_model(input_ids=tokens).logits[0, 7:-1].float()
    torch.cuda.synchronize()
    assert_like_reference(f"{name} {mode}", got, base, ref, torch.bfloat16, factor=3.0)
    assert_like_reference(f"{name} {mode} again", again, base, ref, torch.bfloat16, factor=3.0)
    gap = chosen.max(dim=-1).values - chosen.gather(1, tokens[0, 8:, None]).squeeze(1)
    assert gap.max() <= 2 * (got.float() - base.float()).abs().max(), f"generated tokens lose by {gap.tolist()}"
    stats = handle.stats()
    print(name, mode, {k: stats[k] for k in ("hits", "misses", "cpu_experts", "prefetched", "prefetch_recall")})
    if mode["cpu_compute"] != "auto":
        assert (stats["cpu_experts"] > 0) == mode["cpu_compute"]
    handle.revert()
