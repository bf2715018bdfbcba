"""transformers MoE models (random weights, tiny configs) with tritonspec's MoE layers, on the Triton interpreter.

The experts (``MoEExperts``) and the routers (``MoERouter``) go in through each front end (kernelize, the
registry, YAML rules), and the experts also through transformers' own switch (``experts_implementation=
"tritonspec"``), which the front ends set themselves when they choose every experts module: the user's
``set_experts_implementation`` then switches away and back, and where it cannot (some experts chosen only) a
forward run after switching raises. Logits, loss (with the auxiliary load-balancing loss:
``output_router_logits=True``), the auxiliary loss itself, the router logits transformers records with its
forward hook, and every gradient (router included) must be as close to a float64 run of the model's own eager
experts as the original model is (helpers.compare_to_original's tolerance model). One layer, so every router
sees the same input in every model and picks the same experts.
"""

import copy
import functools

import pytest
from helpers import (
    MOE_ARCHITECTURES,
    assert_like_reference,
    available_models,
    build_model,
    compare_to_original,
    token_ids,
)
import torch
import torch.nn.functional as F

import tritonspec.nn as tnn
from tritonspec.nn import engine
from tritonspec.nn.experts import EXPERTS_NAME
from tritonspec.nn.hub.layers import MoEExperts, MoERouter
from tritonspec.nn.detectors import is_fused_experts, is_topk_router, router_kind

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

MODELS = available_models(MOE_ARCHITECTURES)
SIZES = dict(
    hidden_size=32,
    intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    num_hidden_layers=1,
    output_router_logits=True,
)
FRONT_ENDS = ("kernelize", "registry", "rules")
NO_AUX_LOSS = {"deepseek_v3"}  # its causal LM has no load-balancing loss


def _model(name, dtype, experts=None, **sizes):
    attn = "eager" if name == "gpt_oss" else "sdpa"  # GPT-OSS's attention sinks: eager only
    model = build_model(name, dtype, attn, seed=4321, **dict(SIZES, **sizes))
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def _step(model, ids):
    """helpers.run_model's (logits, loss, grads), the auxiliary loss, and the router logits the model recorded."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    aux, routers = getattr(out, "aux_loss", None), getattr(out, "router_logits", None)
    logits = out.logits
    if logits is None:  # the LM head and loss fused (kernel moe_linear_cross_entropy): no logits in training
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    return (
        (logits.detach(), out.loss.detach(), grads),
        None if aux is None else aux.detach(),
        None if routers is None else [r.detach() for r in routers],
    )


@functools.cache
def _originals(name):
    """(float64 eager reference, float32 original) steps of ``name``, shared by the tests of this file."""
    ids = token_ids(96)
    return _step(_model(name, torch.float64, "eager"), ids), _step(_model(name, torch.float32), ids)


def _compare(name, got):
    ref, base = _originals(name)
    compare_to_original(name, got[0], base[0], ref[0], torch.float32)
    assert (got[1] is None) == (base[1] is None) and (base[1] is not None or name in NO_AUX_LOSS)
    if base[1] is not None:
        assert_like_reference(f"{name} aux loss", got[1], base[1], ref[1], torch.float32)
    assert (got[2] is None) == (base[2] is None)
    if base[2] is not None:  # recorded by transformers' OutputRecorder hook on each router
        assert len(got[2]) == len(base[2]) == SIZES["num_hidden_layers"]
        for i, (g, b, r) in enumerate(zip(got[2], base[2], ref[2])):
            assert_like_reference(f"{name} router logits {i}", g, b, r, torch.float32)


def _modules(model, suffix):
    """The model's modules whose class name ends with ``suffix`` (``Experts``, ``Router``), found without
    tritonspec's detectors."""
    found = [(p, m) for p, m in model.named_modules() if type(m).__name__.endswith(suffix)]
    assert found, f"no *{suffix} module"
    return found


def _dotted(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _install(front_end, model):
    if front_end == "kernelize":
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    elif front_end == "registry":
        tnn.apply_available_kernels(model)
    else:
        experts = _dotted(type(_modules(model, "Experts")[0][1]))
        tnn.apply_rules(
            model,
            f"""
- match: {{class: {experts}, kernel: moe}}
  replace: {{kernel: moe}}
- match: {{name: "\\\\.mlp\\\\.(gate|router)$", kernel: moe_router}}
  replace: {{kernel: moe_router}}
""",
        )


def _forward_of(module):
    fwd = vars(module).get("forward")
    return getattr(fwd, "__func__", fwd)


def _layer_of(module):
    """The layer forward a front end installed in ``module``, through the pin on experts transformers dispatches."""
    fwd = _forward_of(module)
    return getattr(fwd, "layer_forward", fwd)


def _assert_switched(model, experts=None):
    """Every experts module runs ours through transformers' switch: no forward of its own, the switch recorded."""
    assert model.config._experts_implementation == EXPERTS_NAME
    for path, module in experts or _modules(model, "Experts"):
        assert _forward_of(module) is None and module.config._experts_implementation == EXPERTS_NAME, path
    (switch,) = [c for c in tnn.report(model) if c.what == "experts_implementation"]
    assert switch.kernel == engine.qualname(MoEExperts.forward), switch


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("model_name", MODELS)
def test_front_ends_install_router_and_experts_and_match_original(model_name, front_end, spy):
    model = _model(model_name, torch.float32)
    before = model.config._experts_implementation
    _install(front_end, model)
    _assert_switched(model)
    for path, module in _modules(model, "Router"):
        assert _forward_of(module) is MoERouter.forward, path
    shared = [(p, m) for p, m in model.named_modules() if "shared_expert" in p]
    assert shared or model_name not in ("qwen2_moe", "deepseek_v3")
    assert model_name != "qwen2_moe" or any(p.endswith("shared_expert_gate") for p, _ in shared)
    for path, module in shared:  # shared experts: a dense MLP (SwiGLUMLP at most); Qwen2-MoE's sigmoid gate: nothing
        assert _forward_of(module) not in (MoEExperts.forward, MoERouter.forward), path
        if front_end == "rules" or path.endswith("shared_expert_gate"):
            assert _forward_of(module) is None, path
    spy.clear()
    got = _step(model, token_ids(96))
    assert spy.get("moe_experts", 0) >= 1 and spy.get("moe_route", 0) >= 1, spy
    _compare(model_name, got)
    tnn.revert(model)
    assert tnn.report(model) == [] and all("forward" not in vars(m) for m in model.modules())
    assert model.config._experts_implementation == before


@pytest.mark.parametrize("model_name", MODELS)
def test_experts_implementation_switch_matches_original(model_name, spy):
    """transformers' own route: experts_implementation="tritonspec", registered by importing tritonspec.nn;
    routers stay theirs."""
    model = _model(model_name, torch.float32)
    model.set_experts_implementation(EXPERTS_NAME)
    spy.clear()
    got = _step(model, token_ids(96))
    assert spy.get("moe_experts", 0) >= 1 and "moe_route" not in spy
    _compare(model_name, got)


def _count_experts_functions(monkeypatch):
    """Calls of the experts functions transformers dispatches to, counted in its global mapping as its own
    test_eager_matches_batched_and_grouped_inference does (``eager`` is the class's own forward)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    calls = {}
    mapping = ALL_EXPERTS_FUNCTIONS._global_mapping

    def counted(name, fn, *args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    for name in ("batched_mm", "grouped_mm", EXPERTS_NAME):
        monkeypatch.setitem(mapping, name, functools.partial(counted, name, mapping[name]))
    return calls


def _install_experts(front_end, model):
    """The experts only, by ``front_end`` (every other layer stays the model's: no interpreter time there)."""
    from tritonspec.nn import registry_kernels

    if front_end == "kernelize":
        only_experts = {"MoEExperts": {"cpu": tnn.TritonspecRepository("MoEExperts")}}
        with tnn.use_kernel_mapping(only_experts, inherit_mapping=False):
            tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    elif front_end == "registry":
        tnn.apply_kernel(model, registry_kernels.CpuTritonMoEExpertsKernel)
    else:
        tnn.apply_rules(model, "- {match: {kernel: moe}, replace: {kernel: moe}}")


# every family through the registry, every front end on one family: the switch is the same code for all
SWITCH_CASES = [(name, "registry") for name in MODELS] + [
    ("qwen3_moe", front) for front in ("kernelize", "rules") if "qwen3_moe" in MODELS
]


@pytest.mark.parametrize(("model_name", "front_end"), SWITCH_CASES)
def test_front_ends_leave_the_experts_switch_to_the_user(model_name, front_end, monkeypatch, spy):
    """transformers' test_eager_matches_batched_and_grouped_inference after a front end: each implementation set
    is the one that runs (ours only under "tritonspec", again after switching back, bit for bit), and all agree
    within float32 tolerance."""
    model = _model(model_name, torch.float32)
    _install_experts(front_end, model)
    _assert_switched(model)
    calls = _count_experts_functions(monkeypatch)
    ids = token_ids(96, batch=1, seq=5)  # 5 tokens: the interpreter's time is the experts'
    outs = {}
    for impl in (EXPERTS_NAME, "eager", "batched_mm", "grouped_mm", EXPERTS_NAME):
        model.set_experts_implementation(impl)
        assert model.config._experts_implementation == impl
        calls.clear()
        spy.pop("moe_experts", None)
        with torch.no_grad():
            out = model(input_ids=ids).logits
        assert set(calls) == ({impl} - {"eager"}), (impl, calls)
        assert ("moe_experts" in spy) == (impl == EXPERTS_NAME), (impl, spy)
        assert impl not in outs or torch.equal(out, outs[impl]), impl
        outs[impl] = out
    for impl, out in outs.items():
        torch.testing.assert_close(out, outs["eager"], rtol=1e-4, atol=1e-4, msg=lambda m, impl=impl: f"{impl}: {m}")


def _switches(model):
    return {c.what: c for c in tnn.report(model) if c.what in engine.SWITCHES}


def test_report_shows_what_the_switches_select_now():
    """After the user switches attention and experts away, report() names what runs (not ours), a deep copy's
    report its own config's; revert restores what was there before tritonspec, switched away or not."""
    model = _model("qwen3_moe", torch.float32)
    before = (model.config._attn_implementation, model.config._experts_implementation)
    tnn.apply_available_kernels(model)  # the attention (FLASH_ATTENTION) and experts (MOE) kernels: both switches
    ours = _switches(model)
    assert ours["attn_implementation"].kernel == engine.qualname(tnn.tritonspec_attention_forward)
    assert ours["experts_implementation"].kernel == engine.qualname(MoEExperts.forward)
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("eager")
    now = _switches(model)
    assert {w: c.kernel for w, c in now.items()} == {"attn_implementation": "sdpa", "experts_implementation": "eager"}
    assert "switched to 'eager' since registry set 'tritonspec'" in str(tnn.report(model))
    twin = copy.deepcopy(model)
    twin.set_experts_implementation(EXPERTS_NAME)
    assert _switches(twin)["experts_implementation"] == ours["experts_implementation"]
    assert _switches(model) == now
    tnn.revert(model)
    tnn.revert(twin)
    for m in (model, twin):
        assert (m.config._attn_implementation, m.config._experts_implementation) == before
        assert tnn.report(m) == []


def _experts_rule(layer, replace="kernel: moe"):
    return f"- {{match: {{name: 'layers\\.{layer}\\.mlp\\.experts$'}}, replace: {{{replace}}}}}"


@pytest.mark.parametrize("front_end", ["registry", "rules"])
def test_some_experts_only_get_a_pinned_forward_that_refuses_another_implementation(front_end, spy):
    """One config value cannot say "ours in layer 0 only": that layer's forward is replaced, pinned to the
    implementation the config names; after a switch it raises, naming what to do, instead of running ours."""
    from tritonspec.nn import registry_kernels

    model = _model("qwen3_moe", torch.float32, num_hidden_layers=2)
    before = model.config._experts_implementation
    ids = token_ids(96, batch=1, seq=5)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    if front_end == "registry":
        tnn.apply_kernel(model, registry_kernels.CpuTritonMoEExpertsKernel, exclude=[r"layers\.1\."])
    else:
        tnn.apply_rules(model, _experts_rule(0))
    (_, first), (_, second) = _modules(model, "Experts")
    assert _layer_of(first) is MoEExperts.forward and _forward_of(second) is None
    assert model.config._experts_implementation == before and not _switches(model)
    spy.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert spy.get("moe_experts") == 1
    model.set_experts_implementation("eager")
    with pytest.raises(RuntimeError, match=rf"is 'eager'.*set_experts_implementation\('{before}'\).*revert\(model\)"):
        model(input_ids=ids)
    model.set_experts_implementation(before)
    with torch.no_grad():
        model(input_ids=ids)
    tnn.revert(model)
    model.set_experts_implementation("eager")
    spy.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert "moe_experts" not in spy and tnn.report(model) == []


class GroupedExperts(torch.nn.Module):
    """Someone else's experts layer (hub-style): transformers' grouped_mm, which the switch has no name for."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor

    has_backward = True

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def test_choices_of_several_calls_become_the_switch_and_split_again(spy):
    """Layer 0's experts by one rule file and layer 1's by another are every experts module: the switch. Another
    layer for layer 0 is not ours: the switch goes, each layer gets a pinned forward. revert undoes all of it."""
    model = _model("qwen3_moe", torch.float32, num_hidden_layers=2)
    before = model.config._experts_implementation
    ids = token_ids(96, batch=1, seq=5)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    (first_path, first), (second_path, second) = experts = _modules(model, "Experts")
    tnn.apply_rules(model, _experts_rule(0))
    assert _layer_of(first) is MoEExperts.forward and model.config._experts_implementation == before
    made = tnn.apply_rules(model, _experts_rule(1))
    _assert_switched(model, experts)
    assert made.paths() == [""] and tnn.report(model).paths() == [""]
    tnn.apply_rules(model, _experts_rule(0, f"class: {__name__}.GroupedExperts"), allowed_modules=[__name__])
    assert model.config._experts_implementation == before and not _switches(model)
    assert _layer_of(first) is GroupedExperts.forward and _layer_of(second) is MoEExperts.forward
    assert sorted(tnn.report(model).paths("forward")) == [first_path, second_path]
    spy.clear()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert spy.get("moe_experts") == 1
    tnn.revert(model)
    assert model.config._experts_implementation == before and tnn.report(model) == []
    assert _forward_of(first) is None and _forward_of(second) is None


def test_kernelize_without_a_kernel_for_the_mode_takes_the_switch_back():
    """kernelize again in a mode no MoEExperts kernel serves: the experts keep their own forward, so the switch
    goes back to the implementation from before."""
    model = _model("qwen3_moe", torch.float32)
    before = model.config._experts_implementation
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    _assert_switched(model)
    inference_only = {"MoEExperts": {"cpu": {tnn.Mode.INFERENCE: tnn.TritonspecRepository("MoEExperts")}}}
    with tnn.use_kernel_mapping(inference_only):
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    assert model.config._experts_implementation == before and not _switches(model)
    assert all(_forward_of(m) is None for _, m in _modules(model, "Experts"))


def test_a_failing_kernelize_leaves_the_experts_as_they_were():
    """All-or-nothing: kernelize failing after it chose the experts (at the rotary function, the last thing it
    looks at) sets no switch on a fresh model and takes none back on a kernelized one."""
    model = _model("qwen3_moe", torch.float32)
    before = model.config._experts_implementation
    no_training_rotary = {"rotary_pos_emb": {"cpu": {tnn.Mode.INFERENCE: tnn.TritonspecRepository("RotaryPosEmb")}}}
    with tnn.use_kernel_mapping(no_training_rotary), pytest.raises(ValueError, match="apply_rotary_pos_emb"):
        tnn.kernelize(model, mode=tnn.Mode.TRAINING, use_fallback=False)
    assert model.config._experts_implementation == before and tnn.report(model) == []
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    report = tnn.report(model)
    with tnn.use_kernel_mapping(no_training_rotary), pytest.raises(ValueError, match="apply_rotary_pos_emb"):
        tnn.kernelize(model, mode=tnn.Mode.TRAINING, use_fallback=False)
    _assert_switched(model)
    assert tnn.report(model) == report


@pytest.mark.parametrize("model_name", MODELS)
def test_router_layer_returns_what_the_family_router_returns(model_name, gen):
    """bfloat16, where the families differ: the same logits and ids, weights within rounding, every dtype alike."""
    model = _model(model_name, torch.bfloat16)
    x = torch.randn(24, SIZES["hidden_size"], generator=gen).bfloat16()
    routers = _modules(model, "Router")
    want = [r(x) for _, r in routers]
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    for (path, router), (w_logits, w_weights, w_ids) in zip(routers, want):
        assert _forward_of(router) is MoERouter.forward, path
        logits, weights, ids = router(x)
        assert (logits.dtype, weights.dtype, ids.dtype) == (w_logits.dtype, w_weights.dtype, w_ids.dtype), path
        assert torch.equal(logits, w_logits) and torch.equal(ids, w_ids), path
        torch.testing.assert_close(weights, w_weights)


@pytest.mark.parametrize("model_name", ["qwen3_moe", "mixtral"])
def test_bf16_through_kernelize(model_name, spy):
    """Qwen3-MoE's router casts its weights to bfloat16, Mixtral's keeps them float32 for bfloat16 experts."""
    ids = token_ids(96)
    ref = _step(_model(model_name, torch.float64, "eager"), ids)[0]
    base = _step(_model(model_name, torch.bfloat16), ids)[0]
    model = _model(model_name, torch.bfloat16)
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    spy.clear()
    got = _step(model, ids)[0]
    assert spy.get("moe_experts", 0) >= 1 and spy.get("moe_route", 0) >= 1
    compare_to_original(f"{model_name} bf16", got, base, ref, torch.bfloat16)


def test_router_kind_of_each_family():
    """What the probe settles for each family, including what the attributes alone cannot say."""
    expected = {  # (scoring, renormalize, float32 logits, float32 weights, bias, correction bias)
        "qwen3_moe": ("softmax", False, False, False, False, False),
        "qwen2_moe": ("softmax", False, False, False, False, False),
        "olmoe": ("softmax", False, False, False, False, False),
        "mixtral": ("softmax", True, False, True, False, False),  # no norm_topk_prob: always renormalizes
        "gpt_oss": ("topk_softmax", False, False, False, True, False),  # not softmax-then-renormalize
        "deepseek_v3": ("sigmoid", True, True, False, False, True),
    }
    for name in MODELS:
        ((_, router),) = _modules(_model(name, torch.float32), "Router")
        kind = router_kind(router)
        assert kind is not None, name
        assert (
            kind.scoring,
            kind.renormalize,
            kind.float32_logits,
            kind.float32_weights,
            kind.bias,
            kind.correction_bias,
        ) == expected[name], (name, kind)
        assert kind.top_k == 2
    ((_, deepseek),) = _modules(_model("deepseek_v3", torch.float32), "Router")
    kind = router_kind(deepseek)
    assert (kind.n_group, kind.topk_group, kind.scaling_factor) == (2, 1, deepseek.routed_scaling_factor)


def _qwen3_router():
    ((_, router),) = _modules(_model("qwen3_moe", torch.float32), "Router")
    return router


class TemperedRouter(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter):
    """Qwen3-MoE's router at temperature 2: the same attributes, other weights and choices."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        probs = torch.softmax(logits / 2, dtype=torch.float, dim=-1)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        return logits, top.to(logits.dtype), ids


class NeverRenormalizes(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter):
    """Qwen3-MoE's router that says ``norm_topk_prob`` but never renormalizes."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, ids = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, top.to(logits.dtype), ids


class UnnormalizedMixtralRouter(transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter):
    """Mixtral's router (no ``norm_topk_prob``) without its renormalization."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, ids = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        return logits, top, ids


@pytest.mark.parametrize("cls", [TemperedRouter, NeverRenormalizes])
def test_a_router_whose_math_differs_is_left_alone(cls):
    model = _model("qwen3_moe", torch.float32, norm_topk_prob=True)
    ((path, router),) = _modules(model, "Router")
    router.__class__ = cls
    assert router_kind(router) is None and not is_topk_router(router)
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    assert _forward_of(router) is None
    _assert_switched(model)
    with pytest.raises(tnn.RuleError, match="rule 0: match: matched no module"):
        tnn.apply_rules(model, "- {match: {kernel: moe_router}, replace: {kernel: moe_router}}")


def test_the_probe_overrules_the_attributes(gen):
    """Without norm_topk_prob, renormalizing (Mixtral) is the first candidate; the probe rejects it here."""
    model = _model("mixtral", torch.float32)
    ((_, router),) = _modules(model, "Router")
    router.__class__ = UnnormalizedMixtralRouter
    kind = router_kind(router)
    assert kind is not None and kind.renormalize is False and kind.float32_weights
    x = torch.randn(16, SIZES["hidden_size"], generator=gen)
    want = router(x)
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE)
    assert _forward_of(router) is MoERouter.forward
    for got, w in zip(router(x), want):
        assert got.dtype == w.dtype and torch.equal(got, w)


def test_router_kind_follows_the_attributes_and_leaves_the_router_alone(gen):
    """A changed attribute is probed again (not served stale); probing neither calls the router's hooks (where
    transformers records its logits) nor touches its tensors."""
    router = _qwen3_router()
    calls = []
    router.register_forward_hook(lambda *a: calls.append(a))
    weight = router.weight.detach().clone()
    assert router_kind(router).renormalize is False
    router.norm_topk_prob = True
    assert router_kind(router).renormalize is True
    router.top_k = 3
    assert router_kind(router).top_k == 3
    assert calls == [] and torch.equal(router.weight, weight)
    x = torch.randn(8, SIZES["hidden_size"], generator=gen)
    want = router(x)
    tnn.kernelize(router, mode=tnn.Mode.INFERENCE, device="cpu")
    assert _forward_of(router) is MoERouter.forward
    got = router(x)
    assert len(calls) == 2  # the hook fires around the replaced forward too
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_experts_keep_expert_parallel_sentinels(gen):
    """Ids >= num_experts (transformers' expert-parallel sentinels, with zero weights) add nothing, as in
    transformers' grouped_mm under ``_is_expert_parallel``."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = _modules(_model("qwen3_moe", torch.float32), "Experts")[0][1]
    experts._is_expert_parallel = True
    x = torch.randn(6, SIZES["hidden_size"], generator=gen)
    ids = torch.randint(0, experts.num_experts, (6, 2), generator=gen)
    ids[::2, 1] = experts.num_experts
    weights = torch.rand(6, 2, generator=gen).masked_fill(ids >= experts.num_experts, 0.0)
    want = grouped_mm_experts_forward(experts, x, ids, weights)
    tnn.kernelize(experts, mode=tnn.Mode.INFERENCE, device="cpu")  # no model around it: no switch, a pinned forward
    assert _layer_of(experts) is MoEExperts.forward
    torch.testing.assert_close(experts(x, ids, weights), want, rtol=1e-5, atol=1e-6)


def test_unsupported_activation_is_left_to_transformers(spy):
    """A GELU expert is not the kernel's: the front ends leave it alone (its router is still replaced), and
    transformers' switch runs its grouped_mm, the very same code as the original."""
    model = _model("mixtral", torch.float32, hidden_act="gelu")
    experts = _modules(model, "Experts")[0][1]
    assert not is_fused_experts(experts)
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    assert _forward_of(experts) is None and _forward_of(_modules(model, "Router")[0][1]) is MoERouter.forward
    tnn.revert(model)
    ids = token_ids(96)
    base = _step(_model("mixtral", torch.float32, hidden_act="gelu"), ids)[0]
    tnn.register_experts()
    model.set_experts_implementation(EXPERTS_NAME)
    spy.clear()
    got = _step(model, ids)[0]
    assert "moe_experts" not in spy
    torch.testing.assert_close(got[0], base[0], rtol=0, atol=0)


@pytest.mark.parametrize("whole", [True, False], ids=["switch", "pinned"])
def test_moe_block_compiles_fullgraph(whole, spy):
    """can_torch_compile: the replaced router and experts trace into one graph (aot_eager on CPU), the experts
    through transformers' switch (the model kernelized) or a pinned forward (the block alone: no switch)."""
    model = _model("qwen3_moe", torch.float32)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 5, SIZES["hidden_size"], generator=torch.Generator().manual_seed(0))
    want = block(x)
    tnn.kernelize(model if whole else block, mode=tnn.Mode.TRAINING | tnn.Mode.TORCH_COMPILE)
    assert _forward_of(block.gate) is MoERouter.forward
    if whole:
        _assert_switched(model)
    else:
        assert _layer_of(block.experts) is MoEExperts.forward
    block(x)  # the hub layers import tritonspec's functions on their first call, which Dynamo does not trace
    spy.clear()
    try:
        got = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
        assert spy.get("moe_experts", 0) >= 1 and spy.get("moe_route", 0) >= 1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


def test_gpt_oss_keeps_its_attention_and_rotary():
    """GPT-OSS's sinks need its eager attention unless ours takes them (tritonspec.nn.attention decides), and its
    apply_rotary_pos_emb takes half-width cos/sin: the registry replaces its router and experts, leaves the
    rotary be, and switches the attention only with the switch recorded."""
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama

    from tritonspec.nn.detectors import is_rotate_half_rope

    rotary = modeling_gpt_oss.apply_rotary_pos_emb
    assert not is_rotate_half_rope(rotary) and is_rotate_half_rope(modeling_llama.apply_rotary_pos_emb)
    model = _model("gpt_oss", torch.float32)
    tnn.apply_available_kernels(model)
    switched = [c for c in tnn.report(model) if c.what == "attn_implementation"]
    assert model.config._attn_implementation == (tnn.ATTENTION_NAME if switched else "eager")
    _assert_switched(model)
    assert _forward_of(model.model.layers[0].mlp.router) is MoERouter.forward
    assert modeling_gpt_oss.apply_rotary_pos_emb is rotary
    tnn.revert(model)


def test_dense_models_are_left_alone():
    model = build_model("llama", torch.float32, seed=1, **SIZES)
    assert not any(is_fused_experts(m) or is_topk_router(m) for m in model.modules())
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    tnn.apply_available_kernels(model)
    assert not any("MoE" in c.kernel for c in tnn.report(model))
    tnn.revert(model)
