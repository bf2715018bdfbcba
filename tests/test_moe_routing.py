"""moe_route against the Hugging Face routers it stands for (built from tiny configs, random weights): the same
experts in the same order, the same weights and the same gradients with respect to the router logits."""

import pytest
from helpers import leaf
import torch
import transformers

from tritonspec.ops.moe_routing import SCORINGS, moe_route

HIDDEN = 32


ROUTERS = {
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "olmoe": "OlmoeTopKRouter",
    "mixtral": "MixtralTopKRouter",
    "gpt_oss": "GptOssTopKRouter",
    "deepseek_v3": "DeepseekV3TopkRouter",
}


def _router_class(family):
    """The router module the family's sparse MoE block calls (its ``gate``, GPT-OSS's ``router``)."""
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), ROUTERS[family])


def _config(family, n_experts, top_k, hidden, *, norm=None, groups=None):
    """The family's config class with only the router's sizes set (every other field is its default)."""
    k = dict(hidden_size=hidden, num_experts_per_tok=top_k)
    if norm is not None:
        k["norm_topk_prob"] = norm
    if family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        name = {"qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig"}[family]
        return getattr(transformers, name)(num_experts=n_experts, **k)
    if family in ("mixtral", "gpt_oss"):
        return getattr(transformers, {"mixtral": "MixtralConfig", "gpt_oss": "GptOssConfig"}[family])(
            num_local_experts=n_experts, **k
        )
    n_group, topk_group = groups
    return transformers.DeepseekV3Config(
        n_routed_experts=n_experts, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5, **k
    )


def _route_kwargs(family, router):
    """moe_route's arguments for the family's router: the mapping the module docstring documents."""
    if family in ("qwen2_moe", "qwen3_moe", "olmoe"):
        return dict(scoring="softmax", renormalize=router.norm_topk_prob)
    if family == "mixtral":
        return dict(scoring="softmax", renormalize=True)
    if family == "gpt_oss":
        return dict(scoring="topk_softmax")
    return dict(
        scoring="sigmoid",
        renormalize=router.norm_topk_prob,
        correction_bias=router.e_score_correction_bias,
        n_group=router.num_group,
        topk_group=router.topk_group,
        scaling_factor=router.routed_scaling_factor,
    )


def _router(family, n_experts, top_k, gen, *, hidden=HIDDEN, norm=None, groups=None, weight=None, bias=None):
    """The family's router with random weights drawn from ``gen`` (or ``weight``; DeepSeek-V3 with ``bias``
    as its correction bias, random when not given)."""
    router = _router_class(family)(_config(family, n_experts, top_k, hidden, norm=norm, groups=groups))
    with torch.no_grad():
        router.weight.copy_(torch.randn(n_experts, hidden, generator=gen) * 0.3 if weight is None else weight)
        if family == "gpt_oss":  # zero with a given weight: the hidden states' own logits
            router.bias.copy_(torch.randn(n_experts, generator=gen) * 0.3 if weight is None else torch.zeros(n_experts))
        if family == "deepseek_v3":
            router.e_score_correction_bias.copy_(torch.randn(n_experts, generator=gen) * 0.3 if bias is None else bias)
    return router


def _compare(family, router, hidden_states, gen, device, dtype=torch.float32):
    """Route ``hidden_states`` through the HF router and through moe_route on its logits (on ``device``);
    compare ids (exactly), weights and the gradients of the weights with respect to the logits."""
    router = router.to(device=device, dtype=dtype)
    h = leaf(hidden_states.to(device=device, dtype=dtype))
    logits, w_hf, ids_hf = router(h)
    logits.retain_grad()
    dw = torch.randn(w_hf.shape, generator=gen).to(device)
    w_hf.backward(dw.to(w_hf.dtype))

    x = leaf(logits)
    w, ids = moe_route(x, router.top_k, **_route_kwargs(family, router))
    w.backward(dw.to(w_hf.dtype).float())

    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert ids.shape == w.shape == (hidden_states.shape[0], router.top_k)
    assert torch.equal(ids, ids_hf), f"{family}: ids\n{ids}\nvs HF\n{ids_hf}"
    assert x.grad.dtype == logits.dtype
    if family == "gpt_oss" and dtype != torch.float32:
        # GPT-OSS runs its softmax in the logits' dtype, ours in float32: close to theirs within their rounding.
        torch.testing.assert_close(w, w_hf.float(), rtol=2**-7, atol=2**-9)
        torch.testing.assert_close(x.grad.float(), logits.grad.float(), rtol=2**-6, atol=2**-8)
    else:
        # The same float32 ops: equal within rounding (in practice bit for bit). Where HF casts the weights
        # back to the logits' dtype (Qwen-MoE, OLMoE), the cast of ours is theirs.
        torch.testing.assert_close(w.to(w_hf.dtype), w_hf, rtol=1e-6, atol=0)
        torch.testing.assert_close(x.grad, logits.grad, rtol=1e-6, atol=0)
    return w, ids


SOFTMAX_FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe"]
CASES = [(1, 8, 2), (3, 16, 4), (17, 8, 3), (17, 16, 2)]  # tokens, experts, top_k


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("family", SOFTMAX_FAMILIES)
@pytest.mark.parametrize("tokens,n_experts,top_k", CASES)
def test_softmax_routers_with_and_without_norm_topk_prob(family, norm, tokens, n_experts, top_k, gen, device):
    router = _router(family, n_experts, top_k, gen, norm=norm)
    _compare(family, router, torch.randn(tokens, HIDDEN, generator=gen), gen, device)


@pytest.mark.parametrize("tokens,n_experts,top_k", CASES)
def test_mixtral_router(tokens, n_experts, top_k, gen, device):
    router = _router("mixtral", n_experts, top_k, gen)
    _compare("mixtral", router, torch.randn(tokens, HIDDEN, generator=gen), gen, device)


@pytest.mark.parametrize("tokens,n_experts,top_k", CASES)
def test_gpt_oss_router(tokens, n_experts, top_k, gen, device):
    router = _router("gpt_oss", n_experts, top_k, gen)
    _compare("gpt_oss", router, torch.randn(tokens, HIDDEN, generator=gen), gen, device)


DEEPSEEK_CASES = [
    (1, 8, 2, (4, 2)),
    (3, 16, 4, (4, 2)),
    (17, 16, 3, (8, 3)),
    (17, 16, 4, (2, 1)),
    (17, 8, 4, (2, 2)),
    (3, 16, 2, (1, 1)),
]  # tokens, experts, top_k, (n_group, topk_group)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens,n_experts,top_k,groups", DEEPSEEK_CASES)
def test_deepseek_v3_router(tokens, n_experts, top_k, groups, norm, gen, device):
    router = _router("deepseek_v3", n_experts, top_k, gen, norm=norm, groups=groups)
    _compare("deepseek_v3", router, torch.randn(tokens, HIDDEN, generator=gen), gen, device)


ALL_FAMILIES = SOFTMAX_FAMILIES + ["mixtral", "gpt_oss", "deepseek_v3"]


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_bfloat16_routers(family, gen, device):
    """bf16 logits: the same experts (the math is float32 on both sides); the weights as HF's within its rounding."""
    router = _router(family, 16, 4, gen, norm=True, groups=(4, 2))
    _compare(family, router, torch.randn(17, HIDDEN, generator=gen), gen, device, dtype=torch.bfloat16)


def _tied_logits(tokens, n_experts, gen):
    """Logits with many exact duplicates (small integers), a row of all-equal logits among them."""
    x = torch.randint(-2, 3, (tokens, n_experts), generator=gen).float() * 0.5
    x[0] = 0.25
    return x


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("tokens,n_experts,top_k", [(3, 8, 3), (17, 16, 4)])
def test_ties_pick_what_hf_picks(family, tokens, n_experts, top_k, gen, device):
    """Duplicate logits (a router weight of identity makes the hidden states the logits, exactly): ids in
    torch.topk's order of ties, as HF's routers pick them."""
    logits = _tied_logits(tokens, n_experts, gen)
    tied_bias = torch.randint(0, 2, (n_experts,), generator=gen).float() * 0.5
    router = _router(
        family,
        n_experts,
        top_k,
        gen,
        hidden=n_experts,
        norm=True,
        groups=(4, 2),
        weight=torch.eye(n_experts),
        bias=tied_bias,
    )
    _compare(family, router, logits, gen, device)


def test_deepseek_bias_and_groups_choose_but_do_not_weigh():
    """The correction bias moves the choice and the group limit cuts it; the weights stay unbiased scores."""
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.0, 0.0, 0.1, 1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0])
    w, ids = moe_route(logits, 2, scoring="sigmoid", renormalize=False)
    assert sorted(ids[0].tolist()) == [0, 1]
    w, ids = moe_route(logits, 2, scoring="sigmoid", renormalize=False, correction_bias=bias)
    assert sorted(ids[0].tolist()) == [0, 4]
    torch.testing.assert_close(w[0].sort().values, logits[0, [4, 0]].sigmoid().sort().values)
    # Groups of 2; group {4, 5} is the best (5.5 + 0.52), then {0, 1} (0.88 + 0.87) over {6, 7} (0.73 + 0.73).
    w, ids = moe_route(logits, 2, scoring="sigmoid", correction_bias=bias, n_group=4, topk_group=1, scaling_factor=2.0)
    assert sorted(ids[0].tolist()) == [4, 5]
    s = logits[0, ids[0]].sigmoid()
    torch.testing.assert_close(w[0], 2.0 * s / s.sum())


def test_softmax_renormalized_is_not_topk_softmax_bitwise(gen):
    """Mixtral (softmax, top-k, renormalize) and GPT-OSS (top-k, softmax of the k) are the same math but round
    differently, so each family needs its own scoring to match bit for bit."""
    x = torch.randn(256, 8, generator=gen) * 2
    w1, i1 = moe_route(x, 2, scoring="softmax")
    w2, i2 = moe_route(x, 2, scoring="topk_softmax")
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)
    assert not torch.equal(w1, w2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_is_routed_in_float32(dtype, gen):
    x = torch.randn(5, 8, generator=gen).to(dtype)
    xl = leaf(x)
    w, ids = moe_route(xl, 3)
    w.sum().backward()
    ref_w, ref_ids = moe_route(x.float(), 3)
    assert w.dtype == torch.float32 and xl.grad.dtype == dtype
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


def test_no_tokens():
    w, ids = moe_route(
        torch.zeros(0, 16), 4, scoring="sigmoid", correction_bias=torch.zeros(16), n_group=4, topk_group=2
    )
    assert w.shape == ids.shape == (0, 4)


def _grouped_kwargs(scoring, gen, device):
    """Every option at once: a random correction bias, 4 groups keeping 2, a scaling factor."""
    return dict(
        scoring=scoring,
        correction_bias=(torch.randn(16, generator=gen) * 0.3).to(device),
        n_group=4,
        topk_group=2,
        scaling_factor=2.5,
    )


@pytest.mark.parametrize("scoring", SCORINGS)
def test_torch_compile_fullgraph(scoring, gen, device):
    """No graph break (no host synchronization, no data-dependent shape): compiled equals eager, backward too."""
    x = torch.randn(17, 16, generator=gen).to(device)
    kw = _grouped_kwargs(scoring, gen, device)
    xl, xc = leaf(x), leaf(x)
    w, ids = moe_route(xl, 4, **kw)
    wc, idsc = torch.compile(lambda t: moe_route(t, 4, **kw), fullgraph=True)(xc)
    dw = torch.randn(w.shape, generator=gen).to(device)
    w.backward(dw)
    wc.backward(dw)
    assert torch.equal(idsc, ids)
    # Inductor fuses the softmax and its backward its own way: the same values within float32 rounding (the
    # gradient's cancellations, p * (dw - sum(p * dw)), make the rounding absolute rather than relative).
    torch.testing.assert_close(wc, w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(xc.grad, xl.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scoring", SCORINGS)
def test_cuda_graph_capture(scoring, gen):
    """Captured once, replayed on new logits: the same result as eager (a host sync would fail the capture)."""
    kw = _grouped_kwargs(scoring, gen, "cuda")
    static = torch.randn(17, 16, generator=gen).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capturing stream, as torch.cuda.graph asks
        moe_route(static, 4, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = moe_route(static, 4, **kw)
    new = torch.randn(17, 16, generator=gen).cuda()
    static.copy_(new)
    graph.replay()
    want_w, want_ids = moe_route(new, 4, **kw)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


LOGITS = torch.zeros(3, 8)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((LOGITS.long(), 2), {}, TypeError, "'router_logits' has dtype torch.int64"),
        ((LOGITS[0], 2), {}, ValueError, "'router_logits' must have 2 dimensions"),
        ((LOGITS[None], 2), {}, ValueError, "'router_logits' must have 2 dimensions"),
        (([[0.0, 1.0]], 1), {}, TypeError, "'router_logits' must be a torch.Tensor"),
        ((LOGITS, 0), {}, ValueError, r"'top_k' must be in 1\.\.8"),
        ((LOGITS, 9), {}, ValueError, r"'top_k' must be in 1\.\.8"),
        ((LOGITS, 2.0), {}, TypeError, "'top_k' must be an int"),
        ((LOGITS, True), {}, TypeError, "'top_k' must be an int"),
        ((LOGITS, 2), dict(scoring="softmax_topk"), ValueError, "'scoring' must be one of 'softmax', 'sigmoid'"),
        ((LOGITS, 2), dict(correction_bias=torch.zeros(7)), ValueError, r"'correction_bias' must have shape \(8,\)"),
        ((LOGITS, 2), dict(correction_bias=torch.zeros(1, 8)), ValueError, "'correction_bias' must have shape"),
        ((LOGITS, 2), dict(correction_bias=torch.zeros(8, dtype=torch.long)), TypeError, "'correction_bias' has dtype"),
        ((LOGITS, 2), dict(correction_bias=[0.0] * 8), TypeError, "'correction_bias' must be a torch.Tensor"),
        ((LOGITS, 2), dict(n_group=3, topk_group=1), ValueError, r"'n_group' must divide the number of experts \(8\)"),
        ((LOGITS, 2), dict(n_group=0, topk_group=1), ValueError, "'n_group' must divide"),
        ((LOGITS, 2), dict(n_group=8, topk_group=1), ValueError, "'n_group' leaves 1 expert per group"),
        ((LOGITS, 2), dict(n_group=2.0, topk_group=1), TypeError, "'n_group' must be an int"),
        ((LOGITS, 2), dict(n_group=4, topk_group=5), ValueError, r"'topk_group' must be in 1\.\.4"),
        ((LOGITS, 2), dict(n_group=4, topk_group=0), ValueError, r"'topk_group' must be in 1\.\.4"),
        ((LOGITS, 2), dict(n_group=4), ValueError, "'topk_group' .* is needed with 'n_group'"),
        ((LOGITS, 2), dict(topk_group=2), ValueError, "'topk_group' needs 'n_group'"),
        (
            (LOGITS, 3),
            dict(n_group=4, topk_group=1),
            ValueError,
            "'topk_group'=1 keeps 2 experts .* fewer than top_k=3",
        ),
        ((LOGITS, 2), dict(scaling_factor="2"), TypeError, "'scaling_factor' must be a float"),
    ],
)
def test_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match="^moe_route: argument " + match):
        moe_route(*args, **kwargs)
