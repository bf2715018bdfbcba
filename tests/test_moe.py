"""MoE experts (moe_experts) against the float64 loop-over-experts reference: output and the gradients of
x, the routing weights, both expert weights and the biases, for both Hugging Face weight layouts.

Tolerance: the kernels accumulate in float32 and round the output (and, in half precision, the
intermediate h) to the input dtype, so each element is off by a few ``u`` relative to the sum of its
terms' magnitudes. That magnitude is the same reference run on absolute values (``|x|``, ``|W|``,
``|w|``): it bounds every term of every sum, activation included.
"""

import pytest
from helpers import leaf, make_spec
import torch
import torch.nn.functional as F

import tritonspec
from tritonspec.ops import _library
from tritonspec.ops import moe as moe_mod
from numerics import assert_close, poisoned_allocations
from tritonspec.ops.moe import MOE_EXPERTS, moe_experts, moe_experts_ref

LAYOUTS = ["concatenated", "interleaved_transposed"]
KINDS = {"silu": dict(activation="silu"), "gpt_oss": dict(activation="gpt_oss", clamp=7.0, bias=True)}


def _weights(E, H, I, layout, dtype, device, gen, bias=False):
    shape_gu, shape_d = ((E, 2 * I, H), (E, H, I)) if layout == "concatenated" else ((E, H, 2 * I), (E, I, H))
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    gu, dn = r(*shape_gu) * H**-0.5, r(*shape_d) * I**-0.5
    gb, db = (r(E, 2 * I) * 0.5, r(E, H) * 0.5) if bias else (None, None)
    return gu, dn, gb, db


def _router_output(T, E, k, device, gen, dtype=torch.int64):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.empty(0, k)
    w = torch.rand(T, k, generator=gen).softmax(-1)
    return ids.to(device=device, dtype=dtype), w.to(device)


def _problem(T, H, I, E, k, layout, kind, dtype, device, gen, ids_dtype=torch.int64):
    opts = dict(KINDS[kind])
    bias = opts.pop("bias", False)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    ids, w = _router_output(T, E, k, device, gen, ids_dtype)
    gu, dn, gb, db = _weights(E, H, I, layout, dtype, device, gen, bias)
    return (x, ids, w, gu, dn), dict(gate_up_bias=gb, down_bias=db, layout=layout, **opts)


NAMES = ("x", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def _run(fn, args, kw, dout):
    x, ids, w, gu, dn = args
    leaves = {"x": leaf(x), "top_k_weights": leaf(w), "gate_up_proj": leaf(gu), "down_proj": leaf(dn)}
    if kw["gate_up_bias"] is not None:
        leaves["gate_up_bias"], leaves["down_bias"] = leaf(kw["gate_up_bias"]), leaf(kw["down_bias"])
    kwargs = dict(kw, gate_up_bias=leaves.get("gate_up_bias"), down_bias=leaves.get("down_bias"))
    out = fn(leaves["x"], ids, leaves["top_k_weights"], leaves["gate_up_proj"], leaves["down_proj"], **kwargs)
    out.backward(dout.to(out.dtype))
    return out.detach(), {n: t.grad for n, t in leaves.items()}


def _reference(args, kw, dout, magnitude=False):
    """float64 output and grads; ``magnitude``: the same on absolute values (the tolerance's scale)."""
    f = (
        (lambda t: None if t is None else t.double().abs())
        if magnitude
        else (lambda t: None if t is None else t.double())
    )
    x, ids, w, gu, dn = args
    args64 = (f(x), ids, f(w), f(gu), f(dn))
    kw64 = dict(kw, gate_up_bias=f(kw["gate_up_bias"]), down_bias=f(kw["down_bias"]))
    return _run(moe_experts_ref, args64, kw64, f(dout))


def _check(args, kw, *, dout=None, gen=None):
    x = args[0]
    dout = dout if dout is not None else torch.randn(x.shape, generator=gen).to(x.device)
    with poisoned_allocations():
        out, grads = _run(moe_experts, args, kw, dout)
    ref, ref_grads = _reference(args, kw, dout)
    mag, mag_grads = _reference(args, kw, dout, magnitude=True)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, ref, "out", scale=mag.abs().max().item())
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert grads[name].dtype == args[0].dtype if name != "top_k_weights" else args[2].dtype
        assert_close(grads[name], ref_grads[name], f"d{name}", dtype=x.dtype, scale=mag_grads[name].abs().max().item())
    return out, grads


def _dtypes(device):
    return [torch.float32, torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_moe_matches_reference(T, layout, kind, device, gen):
    for dtype in _dtypes(device):
        args, kw = _problem(T, 32, 24, 6, 2, layout, kind, dtype, device, gen)
        _check(args, kw, gen=gen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_oss_activation_without_a_clamp_clips_nothing(layout, device, gen):
    """clamp=None: GPT-OSS's activation unclamped, forward and backward (the kernels' stand-in for "no clamp"
    once was 0, which clipped every positive gate)."""
    args, kw = _problem(17, 32, 24, 6, 2, layout, "gpt_oss", _dtypes(device)[0], device, gen)
    _check(args, dict(kw, clamp=None), gen=gen)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_tokens_per_expert_fill_several_blocks(layout, device, gen):
    """160 tokens x top-4 over 4 experts: ~160 rows per expert, several of the large problems' 128-row blocks."""
    args, kw = _problem(160, 48, 40, 4, 4, layout, "silu", _dtypes(device)[0], device, gen)
    _check(args, kw, gen=gen)


def test_grouped_tile_order_covers_every_tile(monkeypatch, device, gen):
    """16-wide tiles in groups of 3 M blocks: several groups, a ragged last one, and several N blocks in each
    GEMM (8 row blocks, 3 column blocks; weight gradients 5 x 3). Every output element is written (poisoned
    allocations) and right."""
    from tritonspec.ops import moe

    small = {
        "moe_up": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=3),
        "moe_rows": dict(BLOCK_N=16, BLOCK_K=16, GROUP_M=3),
        "moe_weight_grad": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=3),
    }
    launch_config = moe.launch_config
    monkeypatch.setattr(
        moe,
        "launch_config",
        lambda config, device, default, **problem: launch_config(config, device, default, **problem).override(
            small.get(config.kernel, {})
        ),
    )
    args, kw = _problem(37, 40, 40, 3, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)
    _check(args, kw, gen=gen)


def test_idle_experts_get_zero_weight_gradients(device, gen):
    """Experts no token chose: their weight gradients are written, and are exactly zero."""
    dtype = _dtypes(device)[0]
    args, kw = _problem(5, 32, 16, 8, 1, "interleaved_transposed", "gpt_oss", dtype, device, gen)
    ids = args[1].clone()
    ids[:] = torch.tensor([1, 3, 1, 3, 1], device=device)[:, None]
    args = (args[0], ids, *args[2:])
    _, grads = _check(args, kw, gen=gen)
    idle = [e for e in range(8) if e not in (1, 3)]
    for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
        assert torch.count_nonzero(grads[name][idle]) == 0, name
        assert torch.count_nonzero(grads[name][[1, 3]]) > 0, name


def test_every_token_on_one_expert(device, gen):
    dtype = _dtypes(device)[0]
    args, kw = _problem(9, 32, 16, 4, 1, "concatenated", "silu", dtype, device, gen)
    args = (args[0], torch.full_like(args[1], 2), *args[2:])
    _check(args, kw, gen=gen)


def test_out_of_range_ids_contribute_nothing(device, gen):
    """transformers' expert-parallel sentinels (ids >= E) and negative ids are dropped, gradients included."""
    dtype = _dtypes(device)[0]
    args, kw = _problem(7, 32, 16, 4, 2, "concatenated", "silu", dtype, device, gen)
    x, ids, w, gu, dn = args
    ids = ids.clone()
    ids[1, 0], ids[4, 1], ids[6, 0] = 4, -1, 10
    dout = torch.randn(x.shape, generator=gen).to(device)
    out, grads = _run(moe_experts, (x, ids, w, gu, dn), kw, dout)
    # the reference of the same problem without the dropped pairs: their routing weight set to zero
    kept = (ids >= 0) & (ids < 4)
    w0 = torch.where(kept, w, torch.zeros_like(w))
    ref, ref_grads = _reference((x, ids.clamp(0, 3), w0, gu, dn), kw, dout)
    assert_close(out, ref, "out")
    assert_close(grads["x"], ref_grads["x"], "dx", dtype=dtype)
    assert torch.count_nonzero(grads["top_k_weights"][~kept]) == 0
    assert_close(grads["top_k_weights"][kept], ref_grads["top_k_weights"][kept], "dw", dtype=dtype)


@pytest.mark.parametrize("slice_pairs", [None, 16], ids=["one-slice", "many-slices"])
@pytest.mark.parametrize("T, E, k, block_m", [(1, 8, 2, 16), (37, 6, 3, 4), (300, 4, 2, 16)])
def test_sort_by_expert_is_a_stable_padded_sort(T, E, k, block_m, slice_pairs, device, gen, monkeypatch):
    """The expert sort against its definition, written in plain Python: each expert's pairs in token
    order from its first row, rows padded to block_m with -1, each block's expert, each pair's row; with
    the pairs scanned in one slice per expert, or in many (token order must hold across slices)."""
    from tritonspec.ops import moe_sort

    if slice_pairs is not None:
        monkeypatch.setattr(moe_sort, "_SLICE_PAIRS", slice_pairs)
    ids = torch.randint(-1, E + 2, (T, k), generator=gen)  # with dropped ids on both sides
    row_pair, block_expert, pair_pos, expert_start, expert_rows = (
        t.cpu().tolist() for t in moe_sort.sort_by_expert(ids.to(device), E, block_m)
    )
    flat = ids.reshape(-1).tolist()
    want_rows, want_pos, want_blocks, starts, counts = [], [-1] * len(flat), [], [], []
    for e in range(E):
        mine = [p for p, key in enumerate(flat) if key == e]
        starts.append(len(want_rows))
        counts.append(len(mine))
        for p in mine:
            want_pos[p] = len(want_rows)
            want_rows.append(p)
        want_rows += [-1] * (-len(mine) % block_m)
        want_blocks += [e] * ((len(want_rows) - starts[-1]) // block_m)
    R = len(row_pair)
    assert R % block_m == 0 and R >= len(flat) + E * (block_m - 1)
    assert row_pair == want_rows + [-1] * (R - len(want_rows))
    assert block_expert == want_blocks + [-1] * (R // block_m - len(want_blocks))
    assert pair_pos == want_pos and expert_start == starts and expert_rows == counts


def test_int32_and_int64_ids_agree_bitwise(device, gen):
    args, kw = _problem(11, 32, 16, 5, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)
    dout = torch.randn(args[0].shape, generator=gen).to(device)
    a = _run(moe_experts, args, kw, dout)
    b = _run(moe_experts, (args[0], args[1].int(), *args[2:]), kw, dout)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def test_runs_are_bitwise_deterministic(device, gen):
    """No atomics: two runs give the very same output and gradients."""
    args, kw = _problem(23, 32, 24, 4, 3, "interleaved_transposed", "gpt_oss", _dtypes(device)[-1], device, gen)
    dout = torch.randn(args[0].shape, generator=gen).to(device)
    a, b = _run(moe_experts, args, kw, dout), _run(moe_experts, args, kw, dout)
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def _own_gemm_spec(calls, run):
    """A spec whose ``moe_experts_gemm`` records each question and, when ``run``, computes in float64 exactly
    what the hook promises from the sorted rows it is handed (HF's rounding of gate and up before the
    activation); otherwise it declines."""

    def moe_experts_gemm(b, c, block_expert, *, gate_up, gu):
        calls.append(("gate_up" if gate_up else "rows", tuple(b.shape), tuple(c.shape), gu is not None))
        if not run:
            return None

        def gemm(a):
            calls.append(("ran", tuple(a.shape)))
            expert = block_expert.long().repeat_interleave(c.shape[0] // block_expert.numel())
            out = torch.zeros(c.shape[0], b.shape[2], dtype=torch.float64, device=c.device)
            some = expert >= 0
            out[some] = (a[some].double().unsqueeze(1) @ b.double()[expert[some]]).squeeze(1)
            if gate_up:
                gate, up = out[:, : c.shape[1]].to(c.dtype), out[:, c.shape[1] :].to(c.dtype)
                if gu is not None:
                    gu.copy_(torch.cat([gate, up], 1))
                out = F.silu(gate.double()).to(c.dtype).double() * up.double()
            c.copy_(out)

        return gemm

    return make_spec("own_gemm_spec", moe_experts_gemm=moe_experts_gemm)


@pytest.mark.parametrize("run", [True, False], ids=["runs", "declines"])
@pytest.mark.parametrize("layout, kind", [("concatenated", "silu"), ("interleaved_transposed", "gpt_oss")])
def test_a_backend_may_run_its_own_grouped_gemm(layout, kind, run, registry, device, gen):
    """The op asks the backend for each grouped GEMM over sorted rows without a bias (the forward's gate/up,
    which saves gate and up for the backward, only for the concatenated layout and silu; its down projection;
    the backward's dx) and hands a runner those rows: what it writes is the result; a decline leaves the
    portable kernels."""
    calls = []
    tritonspec.register_spec("own-gemm-test", _own_gemm_spec(calls, run))
    T, H, I, E, k = 40, 32, 24, 4, 2
    args, kw = _problem(T, H, I, E, k, layout, kind, _dtypes(device)[0], device, gen)
    with tritonspec.use_backend("own-gemm-test"):
        _check(args, kw, gen=gen)
    asked = [c for c in calls if c[0] != "ran"]
    R = asked[0][2][0]
    dx = ("rows", (E, 2 * I, H), (R, H), False)
    expected = [("gate_up", (E, H, 2 * I), (R, I), True), ("rows", (E, I, H), (R, H), False), dx]
    assert asked == (expected if kind == "silu" else [dx])  # GPT-OSS: interleaved gate/up and biases
    ran = [("ran", (R, H)), ("ran", (R, I)), ("ran", (R, 2 * I))] if kind == "silu" else [("ran", (R, 2 * I))]
    assert [c for c in calls if c[0] == "ran"] == (ran if run else [])  # each runner is handed its rows


@pytest.mark.parametrize("result", [True, 1, "run"])
def test_a_grouped_gemm_hook_returning_neither_a_runner_nor_a_decline_is_an_error(result, registry, device, gen):
    tritonspec.register_spec(
        "bad-gemm-test", make_spec("bad_gemm_spec", moe_experts_gemm=lambda b, c, block_expert, **kw: result)
    )
    args, kw = _problem(40, 32, 24, 4, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)  # sorted path
    with (
        tritonspec.use_backend("bad-gemm-test"),
        pytest.raises(
            tritonspec.SpecContractError,
            match=r"backend 'bad-gemm-test' hook 'moe_experts_gemm' returned the wrong thing: expected False or None "
            r"\(decline\) or a function to run, got",
        ),
    ):
        moe_experts(*args, **kw)


def _own_weight_grad_spec(calls, run):
    """A spec whose ``moe_weight_grad`` records each question and, when ``run``, writes in float64 exactly what
    the hook promises: each expert's sum over its sort rows of lhs_row^T rhs_row, a gathered operand's rows being
    the rows' tokens' (zeros in padding rows)."""

    def moe_weight_grad(lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m, *, gather_l, gather_r, top_k):
        calls.append((tuple(dw.shape), gather_l, gather_r, row_pair.numel() % block_m))
        if not run:
            return False
        pairs = row_pair.long()
        used = (pairs >= 0)[:, None]

        def rows(t, gather):
            return (
                torch.where(used, t[torch.where(pairs >= 0, pairs // top_k, 0)], 0).double() if gather else t.double()
            )

        lhs, rhs = rows(lhs, gather_l), rows(rhs, gather_r)
        for e, (start, count) in enumerate(zip(expert_start.tolist(), expert_rows.tolist())):
            dw[e] = (lhs[start : start + count].T @ rhs[start : start + count]).to(dw.dtype)
        return True

    return make_spec("own_weight_grad_spec", moe_weight_grad=moe_weight_grad)


@pytest.mark.parametrize("run", [True, False], ids=["runs", "declines"])
@pytest.mark.parametrize("layout, kind", [("concatenated", "silu"), ("interleaved_transposed", "gpt_oss")])
def test_a_backend_may_run_its_own_weight_gradients(layout, kind, run, registry, device, gen, monkeypatch):
    """The op asks the backend for each weight gradient without a bias gradient (d down_proj over dout's gathered
    rows, then d gate_up_proj over x's), in the weight's (E, M, N) orientation: what it writes is the
    gradient and the portable kernel does not run; a decline runs the portable kernel."""
    calls, launched = [], []
    launch = moe_mod.launch
    monkeypatch.setattr(moe_mod, "launch", lambda kernel, *a, **k: launched.append(kernel) or launch(kernel, *a, **k))
    tritonspec.register_spec("own-weight-grad-test", _own_weight_grad_spec(calls, run))
    T, H, I, E, k = 40, 32, 24, 4, 2
    args, kw = _problem(T, H, I, E, k, layout, kind, _dtypes(device)[0], device, gen)
    with tritonspec.use_backend("own-weight-grad-test"):
        _check(args, kw, gen=gen)
    expected = [((E, H, I), True, False, 0), ((E, 2 * I, H), False, True, 0)]
    assert calls == (expected if kind == "silu" else [])  # GPT-OSS: its biases' gradients come with the weights'
    portable = launched.count(moe_mod._moe_weight_grad_kernel)
    assert portable == (0 if run and kind == "silu" else 2)


@pytest.mark.parametrize("result", [None, 1, "ran"])
def test_a_weight_gradient_hook_returning_no_bool_is_an_error(result, registry, device, gen):
    tritonspec.register_spec("bad-wg-test", make_spec("bad_wg_spec", moe_weight_grad=lambda *a, **kw: result))
    args, kw = _problem(40, 32, 24, 4, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)
    with (
        tritonspec.use_backend("bad-wg-test"),
        pytest.raises(
            tritonspec.SpecContractError,
            match=r"backend 'bad-wg-test' hook 'moe_weight_grad' returned the wrong thing: expected bool, got",
        ),
    ):
        _run(moe_experts, args, kw, torch.randn(40, 32, generator=gen).to(device))


def test_no_tokens(device, gen):
    args, kw = _problem(0, 32, 16, 4, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)
    out, grads = _run(moe_experts, args, kw, torch.zeros(0, 32, device=device))
    assert out.shape == (0, 32)
    assert grads["gate_up_proj"].shape == args[3].shape and torch.count_nonzero(grads["gate_up_proj"]) == 0


def test_library_op_path_in_eager(monkeypatch, device, gen):
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    args, kw = _problem(6, 32, 16, 4, 2, "interleaved_transposed", "gpt_oss", _dtypes(device)[0], device, gen)
    _check(args, kw, gen=gen)


def test_torch_compile_fullgraph(device, gen):
    """No graph break: the expert sort has static shapes and the kernels run as custom ops."""
    args, kw = _problem(6, 32, 16, 4, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)
    x, ids, w, gu, dn = args
    xl, wl, gul, dnl = leaf(x), leaf(w), leaf(gu), leaf(dn)
    f = torch.compile(lambda x, w, gu, dn: moe_experts(x * 2.0, ids, w, gu, dn, **kw), fullgraph=True)
    out = f(xl, wl, gul, dnl)
    dout = torch.randn(out.shape, generator=gen).to(device)
    out.backward(dout)
    x64, w64, gu64, dn64 = (leaf(t.double()) for t in (x, w, gu, dn))
    ref = moe_experts_ref(x64 * 2.0, ids, w64, gu64, dn64, **kw)
    ref.backward(dout.double())
    scale = lambda t: t.abs().max().item() * x.shape[1] ** 0.5  # noqa: E731
    assert_close(out, ref, "out", scale=scale(ref))
    for name, got, want in (("dx", xl, x64), ("dw", wl, w64), ("dgate_up", gul, gu64), ("ddown", dnl, dn64)):
        assert_close(got.grad, want.grad, name, dtype=x.dtype, scale=scale(want.grad))


def test_opcheck(device, gen):
    args, kw = _problem(5, 32, 16, 4, 2, "interleaved_transposed", "gpt_oss", _dtypes(device)[0], device, gen)
    x, ids, w, gu, dn = args
    torch.library.opcheck(
        MOE_EXPERTS.forward_op,
        (x, ids, w, gu, dn, kw["gate_up_bias"], kw["down_bias"], kw["layout"], kw["activation"], kw["clamp"]),
    )


def _bad(**changes):
    """A call of moe_experts on ``device`` with ``changes`` applied to a valid problem's arguments."""

    def call(device):
        gen = torch.Generator().manual_seed(0)
        args, kw = _problem(4, 32, 24, 4, 2, "concatenated", "silu", _dtypes(device)[0], device, gen)
        named = dict(zip(("x", "top_k_ids", "top_k_weights", "gate_up_proj", "down_proj"), args), **kw)
        for key, change in changes.items():  # a change to an absent argument gets x (for its device)
            named[key] = change(named[key] if named[key] is not None else named["x"]) if callable(change) else change
        return moe_experts(**named)

    return call


@pytest.mark.parametrize(
    "call, match",
    [
        (_bad(x=lambda t: t[None]), "'x' must have 2"),
        (_bad(top_k_ids=lambda t: t.float()), "'top_k_ids' must be a 2-D int32 or int64"),
        (_bad(x=lambda t: t[:3]), "'top_k_ids' has 4 rows but 'x' has 3"),
        (_bad(top_k_weights=lambda t: t[:, :1]), "'top_k_weights' has shape"),
        (_bad(gate_up_proj=lambda t: t[:, :, :16]), "'gate_up_proj' has shape"),
        (_bad(gate_up_proj=lambda t: t.transpose(1, 2)), "'gate_up_proj' has shape"),
        (_bad(down_proj=lambda t: t[:, :, :8]), "'down_proj' has shape"),
        (_bad(down_proj=lambda t: t.double()), "'down_proj' has dtype"),
        (_bad(layout="transposed"), "'layout' must be one of"),
        (_bad(activation="gelu"), "'activation' must be one of"),
        (_bad(clamp=7.0), "'clamp' applies to activation 'gpt_oss' only"),
        (_bad(activation="gpt_oss", clamp=-1.0), "'clamp' must be a positive number"),
        (_bad(down_bias=lambda x: x.new_zeros(4, 31)), "'down_bias' has shape"),
        (_bad(down_bias=lambda x: torch.zeros(4, 32, device="meta")), "'down_bias' is on meta"),
        (_bad(gate_up_proj=lambda t: t.to("meta")), "is on meta"),
        (
            _bad(gate_up_proj=lambda t: t[:0], down_proj=lambda t: t[:0], top_k_ids=lambda t: t * 0),
            "'gate_up_proj' has no experts",
        ),
        (_bad(gate_up_proj=lambda t: t[:, :0], down_proj=lambda t: t[:, :, :0]), "'gate_up_proj' has shape"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        call(device)


# -- the backward's memory: eager autograd writes d(gate, up) over the saved pre-activations -----------


def _leaves(args, kw):
    """``(x, ids, w, gate_up, down)`` and ``kw`` with every differentiable input a fresh leaf, and those leaves."""
    x, ids, w, gu, dn = args
    named = {"x": leaf(x), "top_k_weights": leaf(w), "gate_up_proj": leaf(gu), "down_proj": leaf(dn)}
    if kw["gate_up_bias"] is not None:
        named["gate_up_bias"], named["down_bias"] = leaf(kw["gate_up_bias"]), leaf(kw["down_bias"])
    call_kw = dict(kw, gate_up_bias=named.get("gate_up_bias"), down_bias=named.get("down_bias"))
    call_args = (named["x"], ids, named["top_k_weights"], named["gate_up_proj"], named["down_proj"])
    return call_args, call_kw, named


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_in_place_backward_equals_library_op_backward(layout, kind, monkeypatch, device, gen):
    """The eager backward (d(gate, up) written over the saved pre-activations, in either layout's column
    order) matches the reference and is bitwise the library op's (a separate d(gate, up) buffer). I = 136:
    two column chunks of the activation's backward (the second ragged), three column blocks of the up GEMM."""
    args, kw = _problem(5, 32, 136, 4, 2, layout, kind, _dtypes(device)[0], device, gen)
    dout = torch.randn(args[0].shape, generator=gen).to(device)
    out, grads = _check(args, kw, dout=dout)
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    traced_out, traced_grads = _run(moe_experts, args, kw, dout)
    assert torch.equal(out, traced_out)
    assert grads.keys() == traced_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], traced_grads[name]), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_second_backward_through_the_graph_fails_loudly(layout, device, gen):
    """The first backward overwrote the saved pre-activations: a second one (retain_graph) raises autograd's
    in-place error instead of reading gradients as pre-activations. The first one's gradients are right."""
    kind = "silu" if layout == "concatenated" else "gpt_oss"
    args, kw = _problem(4, 32, 16, 4, 2, layout, kind, _dtypes(device)[0], device, gen)
    dout = torch.randn(args[0].shape, generator=gen).to(device)
    call_args, call_kw, named = _leaves(args, kw)
    out = moe_experts(*call_args, **call_kw)
    out.backward(dout, retain_graph=True)
    _, want = _run(moe_experts, args, kw, dout)
    for name, t in named.items():
        assert torch.equal(t.grad, want[name]), name
    with pytest.raises(RuntimeError, match="inplace"):
        out.backward(dout)


def test_library_op_backward_leaves_its_inputs_alone(monkeypatch, device, gen):
    """The library op (torch.compile's path) mutates nothing: a second backward through the same graph runs
    and adds the very same gradients again."""
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    args, kw = _problem(4, 32, 16, 4, 2, "interleaved_transposed", "gpt_oss", _dtypes(device)[0], device, gen)
    dout = torch.randn(args[0].shape, generator=gen).to(device)
    call_args, call_kw, named = _leaves(args, kw)
    out = moe_experts(*call_args, **call_kw)
    out.backward(dout, retain_graph=True)
    first = {name: t.grad.clone() for name, t in named.items()}
    out.backward(dout)
    for name, t in named.items():
        assert torch.count_nonzero(first[name]) > 0, name
        assert torch.equal(t.grad, first[name] * 2), name


def test_eager_gradients_are_adopted_not_copied(monkeypatch, device, gen):
    """The backward's gradients are fresh tensors nothing else holds: the leaves' .grad are those very
    tensors (AccumulateGrad copies a gradient something else still references)."""
    from tritonspec.ops import moe

    made = {}
    backward = moe.moe_experts_backward

    def recording_backward(*a, **k):
        results = backward(*a, **k)
        made.update(x=results[0].data_ptr(), gate_up_proj=results[2].data_ptr(), down_proj=results[3].data_ptr())
        made.update(gate_up_bias=results[4].data_ptr(), down_bias=results[5].data_ptr())
        return results

    monkeypatch.setattr(moe, "moe_experts_backward", recording_backward)
    args, kw = _problem(4, 32, 16, 4, 2, "interleaved_transposed", "gpt_oss", _dtypes(device)[0], device, gen)
    call_args, call_kw, named = _leaves(args, kw)
    moe_experts(*call_args, **call_kw).backward(torch.randn(args[0].shape, generator=gen).to(device))
    assert made.keys() == {"x", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias"}
    for name, ptr in made.items():
        assert named[name].grad.data_ptr() == ptr, name


def _with_descriptors(monkeypatch):
    """The launch configs with TMA on (as the sm90 table sets it), whatever the device's backend says."""
    real = moe_mod.launch_config

    def launch_config(config, device, default, **problem):
        cfg = real(config, device, default, **problem)
        return cfg.override({"TMA": True}) if "TMA" in config.keys() else cfg

    monkeypatch.setattr(moe_mod, "launch_config", launch_config)


@pytest.mark.parametrize(
    "layout, kind, chunked",
    [("concatenated", "silu", False), ("interleaved_transposed", "gpt_oss", False), ("concatenated", "gpt_oss", True)],
)
def test_descriptor_paths_equal_the_pointer_paths_bitwise(layout, kind, chunked, device, gen, monkeypatch):
    """Weight tiles and the weight gradients' sorted rows read through TMA descriptors give the reference's
    results, and the pointer paths' bit for bit. ``chunked``: x's sorted rows a block of columns at a time
    (three blocks); the interpreter's numpy matmul may then round a narrower tile's sums in another order, so
    on the CPU that case is checked against the reference only."""
    args, kw = _problem(40, 64, 64, 4, 2, layout, kind, _dtypes(device)[-1], device, gen)  # K: whole 64-deep steps
    dout = torch.randn(args[0].shape, generator=gen).to(device)
    out, grads = _run(moe_experts, args, kw, dout)
    _with_descriptors(monkeypatch)
    if chunked:
        monkeypatch.setattr(moe_mod, "_x_columns", lambda H, T, R: [slice(0, 16), slice(16, 32), slice(32, H)])
    tma_out, tma_grads = _check(args, kw, dout=dout)
    assert torch.equal(tma_out, out)
    if chunked and device == "cpu":
        return
    for name in grads:
        assert torch.equal(tma_grads[name], grads[name]), name


def test_x_columns_cover_x_in_blocks_no_larger_than_x():
    for H, T, R in [(4096, 4096, 9208), (2048, 32768, 278400), (2048, 8192, 81792), (64, 3, 40), (7168, 4096, 65280)]:
        blocks = moe_mod._x_columns(H, T, R)
        assert [c for b in blocks for c in range(b.start, b.stop)] == list(range(H))
        width = blocks[0].stop
        assert all(b.stop - b.start == width for b in blocks[:-1])
        assert width == H or (width % 256 == 0 and (width == 512 or width * R <= 2 * T * H))
