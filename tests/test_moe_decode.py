"""Decode-sized MoE experts without gradients (``moe_experts`` under ``torch.no_grad``): the sort-free GEMMs of
:mod:`tritonspec.ops.moe_decode` up to 16 tokens, the sorted path without saved activations beyond, both
against the float64 reference (tolerance as in test_moe.py: a few ``u`` of the sum of the terms' magnitudes).
"""

import pytest
import torch

from numerics import assert_close, poisoned_allocations
from tritonspec.ops import moe_decode
from tritonspec.ops._library import recording
from tritonspec.ops.moe import moe_experts, moe_experts_ref

KINDS = {"silu": dict(activation="silu"), "gpt_oss": dict(activation="gpt_oss", clamp=7.0)}


def _problem(T, H, I, E, k, layout, kind, dtype, device, gen, bias=False):
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    shape_gu, shape_d = ((E, 2 * I, H), (E, H, I)) if layout == "concatenated" else ((E, H, 2 * I), (E, I, H))
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(device)
    weights = torch.rand(T, k, generator=gen).softmax(-1).to(device)
    kw = dict(KINDS[kind], layout=layout)
    if bias:
        kw.update(gate_up_bias=r(E, 2 * I) * 0.5, down_bias=r(E, H) * 0.5)
    return (r(T, H), ids, weights, r(*shape_gu) * H**-0.5, r(*shape_d) * I**-0.5), kw


def _check(args, kw, out=None):
    """``out`` (default: moe_experts' own) against the float64 reference."""
    if out is None:
        with torch.no_grad(), poisoned_allocations():
            out = moe_experts(*args, **kw)

    def f64(t, f=torch.Tensor.double):
        return f(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    mag = lambda t: f64(t, lambda u: u.double().abs())  # noqa: E731
    ref = moe_experts_ref(*map(f64, args), **{n: f64(v) for n, v in kw.items()})
    scale = moe_experts_ref(*map(mag, args), **{n: mag(v) for n, v in kw.items()}).abs().max().item()
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert_close(out, ref, "out", scale=scale)
    return out


@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
def test_gpt_oss_activation_without_a_clamp_clips_nothing(layout, device, gen):
    """clamp=None in the decode kernels: unclamped (their stand-in for "no clamp" once was 0)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    args, kw = _problem(5, 32, 24, 6, 3, layout, "gpt_oss", dtype, device, gen, bias=True)
    _check(args, dict(kw, clamp=None))


def _count_decode_launches(monkeypatch):
    calls = []
    real = moe_decode.moe_decode
    monkeypatch.setattr("tritonspec.ops.moe.moe_decode", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_decode_matches_reference(T, layout, kind, device, gen, monkeypatch):
    calls = _count_decode_launches(monkeypatch)
    dtypes = [torch.float32, torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16]
    for dtype in dtypes:
        args, kw = _problem(T, 32, 24, 6, 3, layout, kind, dtype, device, gen, bias=kind == "gpt_oss")
        _check(args, kw)
    assert len(calls) == len(dtypes)


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def test_beyond_decode_tokens_runs_the_sorted_path_without_saving(device, gen, monkeypatch):
    calls = _count_decode_launches(monkeypatch)
    args, kw = _problem(moe_decode.MAX_TOKENS + 1, 32, 16, 4, 2, "concatenated", "silu", _dtype(device), device, gen)
    _check(args, kw)
    assert calls == []


def test_experts_shared_by_tokens_and_dropped_pairs(device, gen):
    """Every token on the same two experts (each expert's weights serve all its tokens in one program), and
    expert-parallel sentinels (ids outside [0, E)) that contribute nothing."""
    args, kw = _problem(7, 32, 16, 4, 2, "concatenated", "silu", _dtype(device), device, gen)
    x, ids, w, gu, dn = args
    ids = torch.tensor([[2, 0]] * 7, device=device)
    ids[1, 0], ids[4, 1], ids[6] = -1, 4, torch.tensor([9, 1])
    out = _check((x, ids, w, gu, dn), kw)
    assert torch.all(out[6] != 0)  # expert 1 alone still contributes to token 6


def _repeated_ids(pattern, T, k, E, device, gen):
    """(T, k) ids with repeats within tokens: "one" (each token names one expert in two of its slots), "mixed"
    (every other token does, the rest are distinct), "all" (each token names one expert in all k slots)."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    for t in range(T):
        a, b = torch.randperm(k, generator=gen)[:2].tolist()
        if pattern == "all":
            ids[t] = ids[t, a]
        elif pattern == "one" or t % 2 == 0:
            ids[t, b] = ids[t, a]
    return ids.to(device)


@pytest.mark.parametrize("pattern", ["one", "mixed", "all"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
@pytest.mark.parametrize("T", [1, 2, 7, 16])
def test_decode_repeated_expert_within_a_token(T, layout, kind, pattern, device, gen, monkeypatch):
    """A token that names an expert in several slots gets that expert's output once per slot, each with its
    slot's weight (as the sorted path and the reference give it), every output element written."""
    calls = _count_decode_launches(monkeypatch)
    k = 3
    args, kw = _problem(T, 32, 24, 6, k, layout, kind, _dtype(device), device, gen, bias=True)
    ids = _repeated_ids(pattern, T, k, 6, device, gen)
    assert any(len(set(row)) < k for row in ids.tolist())
    _check((args[0], ids, *args[2:]), kw)
    assert len(calls) == 1


def test_decode_is_bitwise_deterministic(device, gen):
    args, kw = _problem(9, 32, 16, 8, 4, "interleaved_transposed", "gpt_oss", _dtype(device), device, gen)
    with torch.no_grad():
        first = moe_experts(*args, **kw)
        assert torch.equal(first, moe_experts(*args, **kw))


def test_decode_replays_in_a_cuda_graph(device, gen):
    """Three layers captured in one graph (on sm90 their launches chain by programmatic dependent launch), replayed
    on new tokens, ids and weights: equal to the eager step bit for bit, so the counters start at zero each time."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    layers = [_problem(4, 64, 32, 8, 2, "concatenated", "silu", torch.bfloat16, device, gen)[0] for _ in range(3)]
    x, ids, w = (t.clone() for t in layers[0][:3])

    def step():
        h = x
        for *_, gu, dn in layers:
            h = moe_experts(h, ids, w, gu, dn)
        return h

    with torch.no_grad():
        step()  # compiles, and makes the launch plans the capture records
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for new in layers[1:]:
            x.copy_(new[0])
            ids.copy_(new[1])
            w.copy_(new[2])
            graph.replay()
            assert torch.equal(out, step())


def test_decode_is_two_launches(gen):
    """The gate/up GEMM, then the down GEMM whose last program per column block sums the tokens' rows."""
    args, kw = _problem(3, 32, 16, 8, 4, "concatenated", "silu", torch.bfloat16, "meta", gen)
    with torch.no_grad(), recording() as launches:
        moe_experts(*args, **kw)
    assert [(l.kernel.fn.__name__, l.kwargs["GATED"]) for l in launches] == [("_moe_decode_kernel", True)] + [
        ("_moe_decode_kernel", False)
    ]


def test_grad_wanted_keeps_the_autograd_path(device, gen, monkeypatch):
    calls = _count_decode_launches(monkeypatch)
    args, kw = _problem(2, 32, 16, 4, 2, "concatenated", "silu", _dtype(device), device, gen)
    x = args[0].requires_grad_()
    out = moe_experts(x, *args[1:], **kw)
    out.sum().backward()
    assert calls == [] and x.grad is not None and torch.all(torch.isfinite(x.grad))


@pytest.mark.parametrize("arch, pdl", [(90, True), (80, False)])
def test_programmatic_dependent_launch_on_sm90_only(arch, pdl, gen):
    """The nvidia table asks for PDL where it was measured (sm90); the kernel's wait and Triton's launch option
    come together, or neither."""
    from tritonspec.launch import for_arch
    from tritonspec.specialization.resolve import use_backend

    args, kw = _problem(3, 64, 32, 8, 4, "concatenated", "silu", torch.bfloat16, "meta", gen)
    with use_backend("nvidia"), for_arch(arch), torch.no_grad(), recording() as launches:
        moe_experts(*args, **kw)
    assert [(l.kwargs["PDL"], l.kwargs.get("launch_pdl", False)) for l in launches] == [(pdl, pdl)] * 2


def test_direct_call_refuses_too_many_tokens(device, gen):
    args, _ = _problem(moe_decode.MAX_TOKENS + 1, 32, 16, 4, 2, "concatenated", "silu", _dtype(device), device, gen)
    x, ids, w, gu, dn = args
    with pytest.raises(ValueError, match="at most 16 tokens"):
        moe_decode.moe_decode(x, ids, w, gu.transpose(1, 2), dn.transpose(1, 2), None, None, False, "silu", 0.0)


# Experts in two stores (offloaded experts in a graph step: GPU slots near, host memory far)
def _split(args, kw, near_ids, gen):
    """(near, far, ids) for moe_experts_tiered: ``near_ids`` copied into a near store in that order, every expert
    in the far store; each routed id renumbered to its near slot or E_near + its far index."""
    x, ids, weights, gate_up, down = args
    pick = torch.tensor(near_ids, device=ids.device)
    names = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
    full = dict(zip(names, (gate_up, down, kw.get("gate_up_bias"), kw.get("down_bias"))))
    far = {n: t for n, t in full.items() if t is not None}
    near = {n: t[pick].clone() for n, t in far.items()}
    table = torch.arange(gate_up.shape[0], device=ids.device) + len(near_ids)
    table[pick] = torch.arange(len(near_ids), device=ids.device)
    valid = (ids >= 0) & (ids < gate_up.shape[0])
    sentinel = torch.where(ids < 0, ids, ids + len(near_ids))  # -1 stays, E becomes E_near + E
    tiered = torch.where(valid, table[ids.clamp(0, gate_up.shape[0] - 1)], sentinel)
    return near, far, tiered


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", ["concatenated", "interleaved_transposed"])
@pytest.mark.parametrize("T", [1, 7, moe_decode.MAX_TOKENS + 3])
def test_two_stores_give_one_store_s_result(T, layout, kind, device, gen):
    """Each expert is read from its store by the decode kernels: the one-store decode kernels' result bit for bit
    (past 16 tokens, group by group); sentinel ids (-1, E) contribute nothing; against float64 too."""
    from tritonspec.ops.moe import moe_experts_tiered

    args, kw = _problem(T, 32, 24, 6, 3, layout, kind, _dtype(device), device, gen, bias=kind == "gpt_oss")
    args[1][0, 0] = -1
    args[1][-1, -1] = 6
    near, far, tiered = _split(args, kw, torch.randperm(6, generator=gen)[:3].tolist(), gen)
    opts = {n: kw[n] for n in ("layout", "activation", "clamp") if n in kw}
    with torch.no_grad(), poisoned_allocations():
        two = moe_experts_tiered(args[0], tiered, args[2], near, far, **opts)
        groups = [(args[0][t : t + 16], args[1][t : t + 16], args[2][t : t + 16]) for t in range(0, T, 16)]
        one = torch.cat([moe_experts(*g, *args[3:], **kw) for g in groups])
    _check(args, kw, two)
    assert torch.equal(two, one)


def test_two_stores_refuse_bad_input(device, gen):
    from tritonspec.ops.moe import moe_experts_tiered

    args, kw = _problem(2, 32, 24, 6, 2, "concatenated", "silu", _dtype(device), device, gen)
    near, far, tiered = _split(args, kw, [4, 1], gen)
    x, _, w = args[:3]
    with torch.no_grad():
        with pytest.raises(ValueError, match="argument 'far' must be a dict of gate_up_proj, down_proj"):
            moe_experts_tiered(x, tiered, w, near, {"gate_up_proj": far["gate_up_proj"]})
        with pytest.raises(ValueError, match="argument 'near' must be a dict"):
            moe_experts_tiered(x, tiered, w, [near], far)
        bad = dict(far, down_proj=far["down_proj"].transpose(1, 2).contiguous().transpose(1, 2))
        with pytest.raises(ValueError, match="far down has shape .* strides"):
            moe_experts_tiered(x, tiered, w, near, bad)
    with pytest.raises(ValueError, match="inference only"):
        moe_experts_tiered(x.requires_grad_(), tiered, w, near, far)
