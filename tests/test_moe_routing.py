"""moe_route against the Hugging Face routers it stands for (built from tiny configs, random weights): the same
experts in the same order, the same weights and the same gradients with respect to the router logits. Then its
fused path (no gradient, no group limit: one Triton kernel) against a float64 reference of the same math."""

import pytest
from helpers import leaf
import torch
import transformers

from tritonspec.ops import moe_routing
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
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_cuda_graph_capture(scoring, grouped, gen):
    """Captured once, replayed on new logits: the same result as eager (a host sync would fail the capture).
    Without groups (no gradient here) the fused kernel is what is captured."""
    kw = _grouped_kwargs(scoring, gen, "cuda")
    if not grouped:
        del kw["n_group"], kw["topk_group"]
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


# ----------------------------------------------------------------------------------------------
# the fused path: calls without gradient or group limit
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def fused(monkeypatch):
    """The fused path's calls (their logits' shapes), counted; CPU tensors take it too (the interpreter)."""
    monkeypatch.setattr(moe_routing, "FUSED_ON_CPU", True)
    calls = []
    route_fused = moe_routing._route_fused

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return route_fused(*args, **kwargs)

    monkeypatch.setattr(moe_routing, "_route_fused", counted)
    return calls


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty filled with NaN (floats) or -1 (ints): an output element the kernel does not write shows."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def _reference(x, top_k, scoring, renormalize=True, bias=None, scaling_factor=1.0, ids=None):
    """(weights, ids, choice) in float64 from the float32 logits (and bias); with ``ids``, the weights of those."""
    x = x.float().double()
    scores = torch.softmax(x, -1) if scoring == "softmax" else x.sigmoid() if scoring == "sigmoid" else x
    choice = scores if bias is None else scores + bias.float().double()
    if ids is None:
        ids = choice.topk(top_k, dim=-1).indices  # descending, the fused kernel's order for every scoring
    w = scores.gather(1, ids)
    if scoring == "topk_softmax":
        w = torch.softmax(w, -1)
    elif renormalize:
        w = w / (w.sum(-1, keepdim=True) + (moe_routing._SIGMOID_RENORM_EPS if scoring == "sigmoid" else 0.0))
    return w * scaling_factor, ids, choice


def _assert_same_choice(ids, want, choice):
    """``ids`` are ``want`` (the float64 reference's), except in a row holding a near-tie (top-k+1 choice values
    within float32 rounding), where each rank's choice value must still be the reference's; always distinct
    experts in range."""
    n_experts, k = choice.shape[1], ids.shape[1]
    assert ids.dtype == torch.int64 and ids.shape == want.shape
    assert bool(((ids >= 0) & (ids < n_experts)).all()), ids
    assert all(len(set(row)) == k for row in ids.tolist()), ids
    top = choice.topk(min(k + 1, n_experts), dim=-1).values
    near = ((top[:, :-1] - top[:, 1:]) <= 1e-6 * top[:, :-1].abs() + 1e-9).any(-1)
    assert torch.equal(ids[~near], want[~near]), (ids, want)
    torch.testing.assert_close(choice.gather(1, ids), choice.gather(1, want), rtol=1e-6, atol=1e-9)


# (correction bias, renormalize, scaling factor): each on and off, DeepSeek-V3's 2.5
OPTIONS = [(False, True, 1.0), (False, False, 2.5), (True, True, 2.5), (True, False, 1.0)]


@pytest.mark.parametrize("bias,renormalize,scaling", OPTIONS)
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("n_experts", [8, 60, 128, 256])
def test_fused_matches_float64_reference(
    n_experts, top_k, scoring, bias, renormalize, scaling, fused, poisoned, gen, device
):
    """Fresh logits, 1, 5 and 33 tokens (rows past a program's block); every element written (torch.empty is
    poisoned); ids in descending choice order, weights within float32 rounding of float64's."""
    corr = (torch.randn(n_experts, generator=gen) * 0.3).to(device) if bias else None
    for tokens in (1, 5, 33):
        x = (torch.randn(tokens, n_experts, generator=gen) * 2).to(device)
        kw = dict(scoring=scoring, renormalize=renormalize, correction_bias=corr, scaling_factor=scaling)
        with torch.no_grad():
            w, ids = moe_route(x, top_k, **kw)
        assert fused and fused[-1] == (tokens, n_experts)
        _, want_ids, choice = _reference(x.cpu(), top_k, scoring, renormalize, None if corr is None else corr.cpu())
        _assert_same_choice(ids.cpu(), want_ids, choice)
        want_w, _, _ = _reference(
            x.cpu(), top_k, scoring, renormalize, None if corr is None else corr.cpu(), scaling, ids=ids.cpu()
        )
        assert w.dtype == torch.float32 and w.shape == (tokens, top_k)
        torch.testing.assert_close(w.cpu().double(), want_w, rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_fused_equals_torch_path_within_rounding(scoring, fused, gen, device):
    """The torch path (what the gradient calls run) and the fused one choose the same experts: sigmoid's in
    torch.topk(sorted=False)'s order there, descending here (a MoE layer's output does not depend on it)."""
    x = (torch.randn(33, 128, generator=gen) * 2).to(device)
    kw = dict(scoring=scoring, correction_bias=(torch.randn(128, generator=gen) * 0.3).to(device), scaling_factor=2.5)
    w_t, ids_t = moe_route(leaf(x), 8, **kw)
    assert not fused
    with torch.no_grad():
        w_f, ids_f = moe_route(x, 8, **kw)
    assert len(fused) == 1
    if scoring == "sigmoid":
        order = ids_t.argsort(-1)
        ids_t, w_t = ids_t.gather(1, order), w_t.gather(1, order)
        order = ids_f.argsort(-1)
        ids_f, w_f = ids_f.gather(1, order), w_f.gather(1, order)
    assert torch.equal(ids_f, ids_t)
    torch.testing.assert_close(w_f, w_t.detach(), rtol=4e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_fused_loads_any_dtype_as_float32(dtype, fused, gen, device):
    """Logits and bias in another dtype: the float32 route of their float32 values (the torch path's
    ``.float()``), strided logits (a column slice) too. The same experts; the weights up to the order of the
    float32 sums, which on a GPU follows the loads' layout, so the input's dtype (H100: last-bit differences)."""
    x = (torch.randn(5, 70, generator=gen) * 2).to(device=device, dtype=dtype)[:, 3:67]
    corr = (torch.randn(64, generator=gen) * 0.3).to(device=device, dtype=dtype)
    for scoring in SCORINGS:
        with torch.no_grad():
            w, ids = moe_route(x, 4, scoring=scoring, correction_bias=corr)
            w32, ids32 = moe_route(x.float().contiguous(), 4, scoring=scoring, correction_bias=corr.float())
        assert torch.equal(ids, ids32), scoring
        torch.testing.assert_close(w, w32, rtol=1e-6, atol=1e-7, msg=scoring)
    assert len(fused) == 6


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the -inf row: NaN weights
def test_fused_ties_go_to_the_lowest_index(fused, device):
    """Exact ties: the lowest expert index first (the kernel's documented order). A row of -inf logits and a
    NaN logit still give distinct experts below the count (the experts' kernels index by them): NaN first,
    as torch.topk ranks it."""
    x = torch.tensor(
        [
            [0.5, 1.0, 1.0, 0.5, 1.0, 0.0, 0.5, 1.0],
            [0.0] * 8,
            [float("-inf")] * 8,
            [0.0, 1.0, float("nan"), 2.0, 0.0, 0.0, 0.0, 0.0],
        ],
        device=device,
    )
    with torch.no_grad():
        _, ids = moe_route(x, 5, scoring="topk_softmax")
        _, ids_softmax = moe_route(x[:2], 5, scoring="softmax")
    assert ids[:3].tolist() == [[1, 2, 4, 7, 0], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert ids[3].tolist() == [2, 3, 1, 0, 4]
    assert torch.equal(ids_softmax, ids[:2])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], device=device)
    with torch.no_grad():
        _, ids_biased = moe_route(x[1:2], 3, scoring="sigmoid", correction_bias=bias)
    assert ids_biased.tolist() == [[7, 0, 1]]


def test_fused_only_without_gradient_and_groups(fused, gen, device):
    """The fused path takes calls whose weights need no gradient (grad off, or logits that do not require it)
    and no group limit (topk_group == n_group limits nothing); the rest, the CPU by default and more experts
    than the kernel holds run torch's ops."""
    x = torch.randn(5, 16, generator=gen).to(device)
    corr = torch.randn(16, generator=gen).to(device)
    grouped = dict(scoring="sigmoid", correction_bias=corr, n_group=4, topk_group=2)
    moe_route(leaf(x), 4)
    with torch.no_grad():
        moe_route(x, 4, **grouped)
        moe_route(torch.randn(2, moe_routing.MAX_FUSED_EXPERTS + 1, generator=gen).to(device), 4)
    assert fused == []
    moe_route(x, 4)  # grad on, logits not requiring it
    with torch.no_grad():
        moe_route(leaf(x), 4)
        w_all, ids_all = moe_route(x, 4, **dict(grouped, topk_group=4))
        w_none, ids_none = moe_route(x, 4, scoring="sigmoid", correction_bias=corr)
    with torch.inference_mode():
        w0, ids0 = moe_route(x[:0], 4, scoring="topk_softmax")
    assert len(fused) == 5 and w0.shape == ids0.shape == (0, 4)
    assert torch.equal(ids_all, ids_none) and torch.equal(w_all, w_none)
    if device == "cpu":
        moe_routing.FUSED_ON_CPU = False  # restored by the fixture's monkeypatch
        with torch.no_grad():
            moe_route(x, 4)
        assert len(fused) == 5


@pytest.mark.parametrize("scoring", SCORINGS)
def test_fused_torch_compile_fullgraph(scoring, fused, gen, device):
    """Traced, the fused path is one tritonspec::moe_route op in the graph (no graph break, no host sync); its
    fake gives the shapes and dtypes, and the compiled call returns what the eager one does."""
    x = torch.randn(17, 60, generator=gen).to(device)
    kw = dict(scoring=scoring, correction_bias=(torch.randn(60, generator=gen) * 0.3).to(device), scaling_factor=2.5)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        w, ids = moe_route(x, 4, **kw)
        wc, idsc = torch.compile(lambda t: moe_route(t, 4, **kw), fullgraph=True, backend=backend)(x)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.tritonspec.moe_route.default in targets, targets
    # the eager call took the fused path; tracing calls it again (a triton_op's body is traced on a GPU)
    assert fused and fused[0] == tuple(x.shape)
    assert wc.dtype == torch.float32 and idsc.dtype == torch.int64
    assert torch.equal(idsc, ids)
    torch.testing.assert_close(wc, w, rtol=1e-6, atol=1e-7)  # traced launches may specialize the kernel anew
