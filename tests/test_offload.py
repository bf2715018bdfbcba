"""Offloaded experts (``tritonspec.nn.offload``) on the CPU: the CPU stands in for the GPU, its slots are host memory.

What must hold whatever the hardware: the policies against independent definitions (an OrderedDict LRU, the
offline optimum bounding every policy), the prefetch's bookkeeping against the guesses recomputed here, the disk
tier reading only the experts used (byte-accounted), a model with offloaded experts giving the logits of the
model it came from (float64 reference, as every kernel of the project is judged), through the API and a
KTransformers-style YAML rule, in waves when few slots exist, on the CPU when asked, with ``generate()`` and
``torch.compile``; and bad configurations failing with the argument named and the model untouched.
"""

import collections
import pathlib
import random

import pytest
from helpers import assert_like_reference, build_model, py_random, token_ids
import torch

import tritonspec.nn as tnn
from tritonspec.nn.offload import OffloadedExperts, offload_experts, offload_handle, parse_bytes
from tritonspec.nn.offload.cache import POLICIES, SlotCache, belady, simulate
from tritonspec.nn.offload.host_compute import Costs, choose_cpu

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

SIZES = dict(
    hidden_size=32,
    intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    num_hidden_layers=3,
)
EXPERTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, layer_types=["full_attention"] * 3),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1),
}


def _model(name, dtype=torch.float32, seed=4321):
    attn = "eager" if name == "gpt_oss" else "sdpa"
    model = build_model(name, dtype, attn, seed=seed, moe=EXPERTS[name], **SIZES)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _experts(model):
    return [m for m in model.modules() if isinstance(m, OffloadedExperts)]


def _assert_unchanged(model, before):
    assert not tnn.report(model), "the model kept a change"
    assert not _experts(model)
    for n, p in model.named_parameters():
        assert p.device == before[n].device and torch.equal(p, before[n]), n


# --------------------------------------------------------------------------------------------------
# policies: bookkeeping only, against independent definitions
# --------------------------------------------------------------------------------------------------
def _trace(rng, steps, experts, k, skew):
    weights = [1.0 / (i + 1) ** skew for i in range(experts)]
    return [set(rng.choices(range(experts), weights=weights, k=k)) for _ in range(steps)]


def _lru_reference(trace, slots):
    """LRU in its textbook form: an OrderedDict, the front least recent (batches that fit in the slots)."""
    od, hits, misses = collections.OrderedDict(), 0, 0
    for needed in trace:
        for e in sorted(needed):
            if e in od:
                hits += 1
                od.move_to_end(e)
        for e in sorted(needed):
            if e in od:
                continue
            misses += 1
            victims = [r for r in od if r not in needed]
            if len(od) >= slots:
                if not victims:
                    continue
                del od[victims[0]]
            od[e] = True
    return hits, misses


@pytest.mark.parametrize("slots", [1, 3, 6])
def test_lru_matches_its_textbook_definition(slots):
    rng = py_random()
    trace = _trace(rng, 200, 12, min(3, slots), 1.0)
    got = simulate(trace, slots, 12, "lru")
    assert (got["hits"], got["misses"]) == _lru_reference(trace, slots)


@pytest.mark.parametrize("slots", [2, 4, 8])
def test_belady_bounds_every_policy_and_all_see_every_request(slots):
    rng = py_random()
    for skew in (0.0, 1.2):
        trace = _trace(rng, 150, 16, 4, skew)
        requests = sum(len(t) for t in trace)
        best = belady(trace, slots)
        assert best["hits"] + best["misses"] == requests
        for policy in POLICIES:
            got = simulate(trace, slots, 16, policy)
            assert got["hits"] + got["misses"] == requests
            assert got["hits"] <= best["hits"], (policy, skew)


def test_lfu_evicts_the_least_used_and_frequency_pins_the_most_used():
    cache = SlotCache(3, 6, "lfu")
    for e, uses in ((0, 5), (1, 1), (2, 3)):
        cache.count([e] * uses)
        cache.admit(e, cache.victim())
    assert cache.expert_in[cache.victim()] == 1  # fewest uses, although most recently admitted but one
    assert cache.expert_in[cache.victim(keep={cache.lookup(1)})] == 2
    freq = SlotCache(4, 8, "frequency", spill=1)
    freq.count([5] * 9 + [2] * 7 + [6] * 4 + [1])
    loads = freq.place(freq.placement())
    assert sorted(e for e, _ in loads) == [2, 5, 6]  # the three most used, one slot left to spill through
    for _ in range(3):  # misses never push a pinned expert out
        freq.admit(7, freq.victim())
        freq.admit(0, freq.victim())
    assert {freq.expert_in[s] for s in freq.pinned} == {2, 5, 6}


def test_cost_model_balances_cpu_time_against_what_is_left_to_copy():
    rng = py_random()
    nbytes, flops = 1000, 10.0
    for _ in range(50):
        costs = Costs(host_link=rng.uniform(100, 1000), cpu_stream=rng.uniform(50, 5000), cpu_flops=rng.uniform(1, 1e4))
        tokens = {e: rng.randint(1, 64) for e in rng.sample(range(32), rng.randint(1, 10))}
        on_cpu = choose_cpu(tokens, nbytes, flops, costs)
        cpu = sum(costs.cpu_s(nbytes, tokens[e], flops) for e in on_cpu)
        copy = costs.copy_s(nbytes)
        left = copy * (len(tokens) - len(on_cpu))
        assert on_cpu <= set(tokens) and max(cpu, left) <= copy * len(tokens)  # never slower than copying all
        for e in set(tokens) - on_cpu:  # and no further move would shorten the batch
            assert max(cpu + costs.cpu_s(nbytes, tokens[e], flops), left - copy) >= max(cpu, left) - 1e-12
    assert choose_cpu({0: 1, 1: 1}, nbytes, flops, Costs(1.0, 1e-9, 1.0)) == set()  # a hopeless CPU gets nothing
    assert choose_cpu({0: 1, 1: 1, 2: 1}, nbytes, flops, Costs(1.0, 1e12, 1e12)) == {0, 1, 2}


# --------------------------------------------------------------------------------------------------
# one model against its float64 self
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,options",
    [
        ("qwen3_moe", dict(experts_per_layer=3, cpu_compute=False, policy="lru")),  # waves: 2 tokens x 8 need > 3 slots
        (
            "qwen3_moe",
            dict(gpu_budget=2 * 3 * (2 * 16 * 32 + 32 * 16) * 4, cpu_compute=True, policy="lfu"),
        ),  # 2 a layer
        ("gpt_oss", dict(experts_per_layer=2, cpu_compute=True, policy="frequency")),
        ("deepseek_v3", dict(experts_per_layer=8, cpu_compute="auto")),
    ],
)
def test_offloaded_model_matches_the_original(name, options):
    ids = token_ids(96, batch=2, seq=6)
    ref, base = _logits(_model(name, torch.float64), ids), _logits(_model(name), ids)
    model = _model(name)
    handle = offload_experts(model, **options)
    assert len(handle.layers) == 3 and all(isinstance(m, OffloadedExperts) for _, m in handle.layers)
    got = _logits(model, ids)
    assert_like_reference(f"{name} offloaded logits", got, base, ref, torch.float32)
    again = _logits(model, ids)  # the second batch finds the cache filled: same answer
    assert_like_reference(f"{name} offloaded logits, cached", again, base, ref, torch.float32)
    stats = handle.stats()
    served = stats["hits"] + stats["misses"] + stats["cpu_experts"]
    assert stats["batches"] == 6 and served > 0
    assert (stats["cpu_experts"] > 0) == (options["cpu_compute"] is True)
    if options["cpu_compute"] is False:
        assert stats["bytes_to_device"] >= stats["misses"] * handle.layers[0][1].layout.nbytes


def test_revert_restores_the_weights_and_the_forward():
    model = _model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = token_ids(96, batch=1, seq=5)
    base = _logits(model, ids)
    handle = offload_experts(model, experts_per_layer=2, cpu_compute=False)
    _logits(model, ids)
    handle.revert()
    assert not _experts(model)
    for n, p in model.named_parameters():
        assert p.device == before[n].device and torch.equal(p, before[n]), n
    assert torch.equal(_logits(model, ids), base)


def test_generate_and_compile_match_the_original():
    ids = token_ids(96, batch=1, seq=4)
    model = _model("mixtral")
    want = model.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    handle = offload_experts(model, experts_per_layer=2, cpu_compute="auto", policy="lru")
    got = model.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    assert torch.equal(got, want)
    compiled = torch.compile(model, backend="eager")
    base = _logits(model, ids)
    with torch.no_grad():
        out = compiled(input_ids=ids).logits
    assert torch.allclose(out, base, rtol=1e-5, atol=1e-6)
    assert handle.stats()["batches"] >= 3 * (4 + 2)


# --------------------------------------------------------------------------------------------------
# prefetch: the next layer's router on this layer's input, copies ahead, recall counted
# --------------------------------------------------------------------------------------------------
def test_prefetch_loads_the_next_routers_guess_and_counts_recall():
    model = _model("qwen3_moe")
    handle = offload_experts(model, experts_per_layer=4, cpu_compute=False, prefetch=True)
    layers = [m for _, m in handle.layers]
    routers = [blk.mlp.gate for blk in model.model.layers]
    gen = torch.Generator().manual_seed(py_random().randrange(2**31))
    predicted = needed_total = 0
    with torch.no_grad():
        for step in range(12):
            x = torch.randn(1, 32, generator=gen)
            guesses = []
            for i, layer in enumerate(layers):
                ids = torch.randint(0, 8, (1, 2), generator=gen)
                while ids[0, 0] == ids[0, 1]:
                    ids = torch.randint(0, 8, (1, 2), generator=gen)
                if guesses and step > 0:  # the module learned the layer order in step 0
                    predicted += len(guesses[-1] & set(ids.flatten().tolist()))
                    needed_total += 2
                nxt = routers[(i + 1) % len(routers)]
                guesses.append(set((x @ nxt.weight.T).topk(2).indices.flatten().tolist()))
                before = dict(zip(range(8), (layers[(i + 1) % 3].cache.lookup(e) for e in range(8))))
                layer(x, ids, torch.rand(1, 2, generator=gen))
                if step > 0:  # the guess is resident in the next layer right after this one ran
                    assert all(layers[(i + 1) % 3].cache.lookup(e) >= 0 for e in guesses[-1]), before
            guesses.clear()
    stats = handle.stats()
    assert stats["prefetched"] > 0
    # Every batch after the first has a guess except the first layer's of step 1 (the last layer of step 0
    # learned its successor only then); count those the test did not score out of the module's totals.
    assert stats["predicted"] >= predicted and stats["needed_after_guess"] >= needed_total
    assert stats["prefetch_recall"] == pytest.approx(stats["predicted"] / stats["needed_after_guess"])


# --------------------------------------------------------------------------------------------------
# the disk tier: a save_pretrained checkpoint read through mmap, only the experts used
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_disk_tier_reads_only_the_experts_used(name, tmp_path):
    model = _model(name)
    model.save_pretrained(tmp_path)
    ids = token_ids(96, batch=1, seq=5)
    used = collections.defaultdict(set)
    hooks = [
        blk.mlp.experts.register_forward_pre_hook(lambda mod, args, i=i: used[i].update(args[1].flatten().tolist()))
        for i, blk in enumerate(model.model.layers)
    ]
    base = _logits(model, ids)
    for h in hooks:
        h.remove()
    empty = _model(name)
    for blk in empty.model.layers:  # the experts never exist in host memory: they come from the file
        for n, p in list(blk.mlp.experts.named_parameters()):
            blk.mlp.experts._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="meta"))
    handle = offload_experts(empty, experts_per_layer=8, storage="disk", checkpoint=tmp_path, cpu_compute=False)
    got = _logits(empty, ids)
    assert torch.allclose(got, base, rtol=1e-5, atol=1e-6)
    per_expert = handle.layers[0][1].layout.nbytes  # float32 file, float32 model
    assert handle.stats()["bytes_read"] == per_expert * sum(len(s) for s in used.values())
    _logits(empty, ids)
    assert handle.stats()["bytes_read"] == per_expert * sum(len(s) for s in used.values()), "a hit read the file"


# --------------------------------------------------------------------------------------------------
# the YAML rule, KTransformers' shape
# --------------------------------------------------------------------------------------------------
RULES = r"""
- match:
    name: "^model\\.layers\\.\\d+\\.mlp\\.experts$"
  replace:
    class: tritonspec.nn.offload.OffloadedExperts
    kwargs:
      experts_per_layer: 3
      generate_device: cpu
      prefill_device: cuda
      policy: lfu
  recursive: false
"""


def test_the_example_rule_file_is_valid():
    path = pathlib.Path(__file__).parents[1] / "examples" / "offload" / "experts_offload.yaml"
    (rule,) = tnn.load_rules(path)
    assert rule.replace_class == "tritonspec.nn.offload.OffloadedExperts" and rule.match_kernel == "moe"
    model = _model("qwen3_moe")
    made = tnn.apply_rules(model, path)  # 16 slots on 8 experts: capped at 8
    assert len(made) == 3 and all(m.cache.num_slots == 8 and m.cpu_compute == "auto" for m in _experts(model))
    tnn.revert(model)


def test_yaml_rule_offloads_and_reverts():
    ids = token_ids(96, batch=1, seq=5)
    model = _model("qwen3_moe")
    base = _logits(model, ids)
    made = tnn.apply_rules(model, RULES)
    assert len(made) == 3
    layers = _experts(model)
    assert len(layers) == 3 and all(m.cpu_compute == "auto" and m.cache.num_slots == 3 for m in layers)
    assert all(m.router is blk.mlp.gate for m, blk in zip(layers, model.model.layers))
    assert torch.allclose(_logits(model, ids), base, rtol=1e-5, atol=1e-6)
    assert offload_handle(model).stats()["batches"] == 3
    tnn.revert(model)
    assert not _experts(model) and torch.equal(_logits(model, ids), base)


# --------------------------------------------------------------------------------------------------
# bad configurations: a clear error naming the argument, the model as it was
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(gpu_budget="1KiB"), "gpu_budget: .* less than one expert"),
        (dict(gpu_budget="lots"), "gpu_budget: expected a positive byte count"),
        (dict(experts_per_layer=2, policy="mru"), "policy: expected one of lru, lfu, frequency"),
        (dict(experts_per_layer=2, storage="tape"), "storage: expected one of cpu, disk"),
        (dict(experts_per_layer=2, cpu_compute="sometimes"), "cpu_compute: expected"),
        (dict(experts_per_layer=2, storage="disk"), "checkpoint: storage='disk'"),
        (dict(experts_per_layer=2, storage="disk", checkpoint="/nonexistent/ckpt"), "checkpoint: .* does not exist"),
        (dict(experts_per_layer=0), "experts_per_layer: expected a positive int"),
        (dict(), "gpu_budget / experts_per_layer: give exactly one"),
    ],
)
def test_bad_configuration_is_named_and_leaves_the_model(kwargs, match):
    model = _model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises((ValueError, FileNotFoundError, tnn.RuleError), match=match):
        offload_experts(model, **kwargs)
    _assert_unchanged(model, before)


def test_checkpoint_without_the_experts_fails_before_anything_changes(tmp_path):
    other = _model("qwen3_moe")
    other.model.layers = other.model.layers[:1]  # a checkpoint of a shallower model: layers 1 and 2 are missing
    other.save_pretrained(tmp_path)
    model = _model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no tensors for expert 0 of model.layers.1.mlp.experts"):
        offload_experts(model, experts_per_layer=2, storage="disk", checkpoint=tmp_path)
    _assert_unchanged(model, before)


def test_parse_bytes():
    rng = random.Random(py_random().random())
    n = rng.randint(1, 999)
    assert parse_bytes(f"{n}GiB") == n * 2**30 and parse_bytes(f"{n} MB") == n * 10**6 and parse_bytes(n) == n
    for bad in (0, -5, True, "5 parsecs", None):
        with pytest.raises(ValueError, match="gpu_budget"):
            parse_bytes(bad)


# --------------------------------------------------------------------------------------------------
# graph-captured steps: the table on the device, experts read in place, promotions between steps
# --------------------------------------------------------------------------------------------------
def _graph_decode(model, ids, new, **decoder):
    """The model's greedy tokens from GraphDecoder (its compiled step: one fullgraph trace, no host decision)."""
    model.generation_config.pad_token_id = 0
    dec = tnn.GraphDecoder(model, max_cache_len=ids.shape[1] + new, batch_size=ids.shape[0], **decoder)
    with torch.no_grad():
        return dec, dec.generate(ids, max_new_tokens=new, eos_token_id=[])


def _table_agrees(layer):
    """The device table maps every expert as the host says it does, and only to a slot that holds it."""
    S = layer.cache.num_slots
    table = layer._tier.tolist()
    assert table[-1] == S + layer.num_experts
    for e, shown in enumerate(layer._shown):
        assert table[e] == (shown if shown >= 0 else S + e), (e, table, layer._shown)
        assert shown < 0 or layer.cache.expert_in[shown] == e


@pytest.mark.parametrize("name,batch", [("qwen3_moe", 1), ("gpt_oss", 2)])
def test_graph_decode_of_an_offloaded_model_gives_the_original_tokens(name, batch):
    """Steps compiled whole (fullgraph) serve resident experts from slots and the others in place from host
    memory; between steps the most used are promoted. Tokens: the original model's, through two prompts."""
    ids = token_ids(96, batch=batch, seq=5)
    model = _model(name)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10)
        want_short = model.generate(ids[:, 2:], do_sample=False, max_new_tokens=10, min_new_tokens=10)
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    handle = offload_experts(model, experts_per_layer=3, cpu_compute=False)
    dec, got = _graph_decode(model, ids, 10, compile_backend="eager", check_every=2)
    with torch.no_grad():
        short = dec.generate(ids[:, 2:], max_new_tokens=10, eos_token_id=[])
    assert torch.equal(got, want) and torch.equal(short, want_short)
    stats = handle.stats()
    assert stats["mapped"] > 0 and stats["hits"] > 0 and stats["promoted"] > 0
    assert stats["bytes_mapped"] == stats["mapped"] * handle.layers[0][1].layout.nbytes
    assert stats["tokens"] >= 3 * batch * (9 + 9)  # every graph step of every layer counted
    for _, layer in handle.layers:
        _table_agrees(layer)
    handle.revert()
    tnn.revert(model)


def test_promotions_evict_and_refill_slots_between_steps_and_the_step_stays_right():
    """A step run again after its slots were evicted and refilled (the promotions between steps) reads each expert
    where the table says: bit for bit the decode kernel over all experts in one store."""
    from tritonspec.ops.moe import moe_experts

    model = _model("qwen3_moe")
    handle = offload_experts(model, experts_per_layer=2, cpu_compute=False, prefetch=False)
    layer = handle.layers[0][1]
    gen = torch.Generator().manual_seed(py_random().randrange(2**31))
    x = torch.randn(1, 32, generator=gen)
    parts, kw = layer.store.parts, dict(zip(("layout", "activation", "clamp"), layer.kind))
    with torch.no_grad():
        layer(x, torch.tensor([[0, 1]]), torch.rand(1, 2, generator=gen))  # eager: binds, 0 and 1 resident
        step = torch.compile(layer._forward_in_graph, backend="eager", fullgraph=True)
        history = []
        for i in range(8):  # 5 and 6 are hot, then 2 and 3: read in place, then promoted over the others
            ids = torch.tensor([[5, 6]]) if i < 4 else torch.tensor([[2, 3]])
            w = torch.rand(1, 2, generator=gen)
            want = moe_experts(x, ids, w, parts["gate_up_proj"], parts["down_proj"], **kw)
            assert torch.equal(step(x, ids, w), want), i
            layer.between_steps()
            _table_agrees(layer)
            history.append(sorted(layer._shown[e] >= 0 for e in ids[0].tolist()))
    # one promotion a call (an eighth of 2 slots, at least one), each over a colder expert: the first hot pair
    # over the never-used 0 and 1, the second over the first once its uses have aged
    assert history[:2] == [[False, True], [True, True]] and history[4:6] == [[False, True], [True, True]]
    assert layer.stats.promoted == 4 and layer.stats.mapped == 6 and layer.stats.hits == 10


def test_a_compiled_step_refuses_what_it_cannot_serve(tmp_path):
    """The disk tier keeps no expert where a step could read it in place; an unbound layer has no slots yet."""
    ids = token_ids(96, batch=1, seq=4)
    model = _model("mixtral")
    model.save_pretrained(tmp_path)
    offload_experts(model, experts_per_layer=2, storage="disk", checkpoint=tmp_path)
    with pytest.raises(RuntimeError, match="storage='disk' keeps no expert where the GPU can read it"):
        _graph_decode(model, ids, 3, compile_backend="eager")
    offload_handle(model).revert()
    handle = offload_experts(model, experts_per_layer=2)
    layer = handle.layers[0][1]
    with pytest.raises(RuntimeError, match="run eagerly once on cpu .* before a compiled or graph-captured step"):
        layer._forward_in_graph(torch.randn(1, 32), torch.tensor([[0, 1]]), torch.rand(1, 2))
    handle.revert()


def test_a_decoder_captures_again_once_the_offloaded_layers_lost_their_device_state():
    """load_state_dict drops the slots and tables a captured step reads: their addresses are part of what the
    decoder checks, so it would capture again rather than replay a graph over freed memory."""
    ids = token_ids(96, batch=1, seq=4)
    model = _model("qwen3_moe")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, max_new_tokens=3, min_new_tokens=3)
    handle = offload_experts(model, experts_per_layer=3, cpu_compute=False)
    dec, got = _graph_decode(model, ids, 3, compile_backend=None)
    keys = [m.graph_key() for _, m in handle.layers]
    state = dec._model_state
    model.load_state_dict(model.state_dict())
    assert all(m.graph_key() == () for _, m in handle.layers)
    with torch.no_grad():
        again = dec.generate(ids, max_new_tokens=3, eos_token_id=[])
    assert dec._model_state != state and all(keys)
    assert torch.equal(got, want) and torch.equal(again, want)
    handle.revert()


def _vm_flags(address: int) -> list[str] | None:
    """The kernel's flags of the mapping holding ``address`` (smaps' VmFlags; "hg": advised for huge pages)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        span = line.split(" ", 1)[0].split("-")
        if len(span) == 2 and all(c in "0123456789abcdef" for c in "".join(span)):
            inside = int(span[0], 16) <= address < int(span[1], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_host_memory_the_tier_allocates_is_advised_for_huge_pages():
    """The GPU reads missing experts in place over its mapping of host memory, a quarter slower over 4 KB pages
    (H100: 38-41 against 50-51 GB/s): experts the host tier copies (here views into larger storages) land in
    memory advised for 2 MB pages, hold the original bits, and go back bit for bit on revert."""
    mmap = pytest.importorskip("mmap")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no madvise(MADV_HUGEPAGE) on this platform")
    control = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        control.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    probe = torch.frombuffer(control, dtype=torch.uint8)
    if "hg" not in (_vm_flags(probe.data_ptr()) or []):
        pytest.skip("this host does not show its mappings' advice (/proc/self/smaps VmFlags)")
    model = _model("qwen3_moe")
    before = {}
    for name, p in model.named_parameters():
        if "experts" in name:
            before[name] = p.detach().clone()
            wider = torch.empty((2 * p.shape[0], *p.shape[1:]), dtype=p.dtype)
            wider[: p.shape[0]].copy_(p.detach())
            p.data = wider[: p.shape[0]]  # a view of a larger storage: the host tier copies it
    assert before
    handle = offload_experts(model, experts_per_layer=2)
    for _, layer in handle.layers:
        for n, t in layer.store.parts.items():
            assert "hg" in _vm_flags(t.data_ptr()), n
    handle.revert()
    after = dict(model.named_parameters())
    for name, w in before.items():
        assert torch.equal(after[name].view(torch.int32), w.view(torch.int32)), name
    del probe
