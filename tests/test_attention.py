"""Attention forward/backward against a float64 reference, through the CPU interpreter.

Shapes are tiny (the interpreter runs every program in numpy) but odd: sequence lengths that are not
block multiples, seq_q != seq_k, GQA/MQA, padded head dims. A test spec shrinks tiles to 16 so
every path runs several blocks: the unmasked/masked loop split, the GQA loop in dK/dV, TMA
descriptors (interpreted) and the atomic dQ variant.
"""

import math
import sys

import pytest
from helpers import leaf, make_spec, no_interpreter
import torch
import torch.nn.functional as F

import tritonspec
from tritonspec.devices import interpreting
from numerics import poisoned_allocations
from tritonspec.ops.attention import attention, attention_ref

pytestmark = pytest.mark.skipif(not interpreting(), reason="interpreter tests: CPU tensors need TRITON_INTERPRET=1")

# eps of each dtype; fp16 adds P and dS rounded to fp16 before the second and fourth matmuls
_TOL = {torch.float32: 2e-5, torch.float16: 6e-3, torch.bfloat16: 3e-2}

_SMALL = dict(BLOCK_M=16, BLOCK_N=16)
CONFIGS = {
    "default": None,  # the op's own portable defaults
    "small": {"attention_fwd": _SMALL, "attention_bwd_dkdv": _SMALL, "attention_bwd_dq": _SMALL},
    "small_tma": {
        "attention_fwd": dict(_SMALL, TMA=True),
        "attention_bwd_dkdv": dict(_SMALL, TMA=True),
        "attention_bwd_dq": dict(_SMALL, TMA=True),
    },
    "mixed_atomic": {
        "attention_fwd": dict(BLOCK_M=32, BLOCK_N=16),
        "attention_bwd_dkdv": dict(BLOCK_M=16, BLOCK_N=32, DQ_ATOMIC=True),
        "attention_bwd_preprocess": dict(BLOCK_M=16),
    },
    "wide_n_tma_atomic": {
        "attention_fwd": dict(BLOCK_M=16, BLOCK_N=32, TMA=True),
        "attention_bwd_dkdv": dict(BLOCK_M=32, BLOCK_N=16, TMA=True, DQ_ATOMIC=True),
    },
}


def _spec(table, seen=None):
    def kernel_config(kernel, device, **problem):
        if seen is not None:
            seen.append((kernel, problem))
        return None if table is None else table.get(kernel)

    return make_spec("attention_test_spec", kernel_config=kernel_config)


@pytest.fixture
def use_configs(registry):
    """Run under a throwaway backend whose spec returns the given attention configs."""
    name = "attention-test"

    class _Ctx:
        def __call__(self, table, seen=None):
            tritonspec.register_spec(name, _spec(table, seen))
            return tritonspec.use_backend(name)

    return _Ctx()


def _inputs(B, HQ, HKV, SQ, SK, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, SQ, D, generator=g).to(dtype)
    k = torch.randn(B, HKV, SK, D, generator=g).to(dtype)
    v = torch.randn(B, HKV, SK, D, generator=g).to(dtype)
    do = torch.randn(B, HQ, SQ, D, generator=g).to(dtype)
    return q, k, v, do


def _reference(q, k, v, do, causal, scale=None):
    q64, k64, v64 = (leaf(t.double()) for t in (q, k, v))
    out = attention_ref(q64, k64, v64, causal=causal, scale=scale)
    out.backward(do.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _ours(q, k, v, do, causal, scale=None):
    q, k, v = (leaf(t) for t in (q, k, v))
    out = attention(q, k, v, causal=causal, scale=scale)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_close(name, got, ref, tol):
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    got = got.double()
    assert torch.isfinite(got).all(), f"{name}: {(~torch.isfinite(got)).sum().item()} non-finite values"
    # scale the tolerance by the reference's magnitude: gradients grow with seq_k and head_dim
    bound = tol * max(1.0, ref.abs().max().item())
    err = (got - ref).abs()
    assert err.max().item() <= bound, (
        f"{name}: max error {err.max().item():.3e} > {bound:.3e} at "
        f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])}"
    )


def _check_against_reference(got, q, k, v, do, causal, scale=None):
    """``got`` = (out, dq, dk, dv) within the dtype's tolerance of the float64 reference."""
    ref = _reference(q, k, v, do, causal, scale)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == q.dtype, f"{name}: dtype {g.dtype} != {q.dtype}"
        _assert_close(name, g, r, _TOL[q.dtype])


CASES = [
    # B, HQ, HKV, SQ, SK, D, causal
    (1, 1, 1, 1, 1, 16, False),
    (1, 2, 2, 17, 17, 32, True),
    (2, 2, 1, 33, 33, 64, True),  # GQA, 3 blocks of 16 with a ragged tail
    (1, 4, 1, 17, 33, 32, False),  # MQA, seq_q < seq_k
    (1, 2, 2, 33, 17, 16, True),  # causal with seq_q > seq_k: rows past seq_k see every key
    (1, 2, 1, 17, 33, 16, True),  # causal with seq_q < seq_k: top-left aligned like SDPA
    (1, 1, 1, 20, 20, 24, False),  # head_dim padded to 32
]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else ""))
def test_matches_float64_reference(case, config, use_configs):
    B, HQ, HKV, SQ, SK, D, causal = case
    dtype = torch.float32
    q, k, v, do = _inputs(B, HQ, HKV, SQ, SK, D, dtype)
    with use_configs(CONFIGS[config]):
        got = _ours(q, k, v, do, causal)
    _check_against_reference(got, q, k, v, do, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", ["small", "small_tma", "mixed_atomic"])
def test_half_precision(dtype, config, use_configs):
    q, k, v, do = _inputs(1, 4, 2, 33, 33, 64, dtype, seed=1)
    with use_configs(CONFIGS[config]):
        got = _ours(q, k, v, do, True)
    _check_against_reference(got, q, k, v, do, True)


def test_head_dim_128_and_custom_scale(use_configs):
    q, k, v, do = _inputs(1, 2, 1, 9, 12, 128, torch.float32, seed=2)
    with use_configs(CONFIGS["small"]):
        got = _ours(q, k, v, do, False, scale=0.3)
    _check_against_reference(got, q, k, v, do, False, scale=0.3)


def test_head_dim_256_the_largest_supported(use_configs):
    q, k, v, do = _inputs(1, 2, 1, 7, 5, 256, torch.float32, seed=9)
    with use_configs(CONFIGS["small"]):
        got = _ours(q, k, v, do, True)
    _check_against_reference(got, q, k, v, do, True)


def test_negative_scale_takes_the_exact_max_path(use_configs):
    # with scale < 0, max(qk) * scale is not max(qk * scale): the kernel must not use the shortcut
    q, k, v, do = _inputs(1, 1, 1, 33, 33, 32, torch.float32, seed=3)
    with use_configs(CONFIGS["small"]):
        got = _ours(q, k, v, do, False, scale=-0.7)
    _check_against_reference(got, q, k, v, do, False, scale=-0.7)


@pytest.mark.parametrize("config", ["small", "small_tma"])
def test_strided_hf_layout(config, use_configs):
    """(batch, seq, heads, dim).transpose(1, 2), the layout Hugging Face models hand over."""
    B, S, HQ, HKV, D = 2, 19, 4, 2, 32
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, S, HQ, D, generator=g).transpose(1, 2)
    k = torch.randn(B, S, HKV, D, generator=g).transpose(1, 2)
    v = torch.randn(B, S, HKV, D, generator=g).transpose(1, 2)
    do = torch.randn(B, S, HQ, D, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    with use_configs(CONFIGS[config]):
        got = _ours(q, k, v, do, True)
    _check_against_reference(got, q, k, v, do, True)


def _hf_inputs(B, S, HQ, HKV, D, seed):
    """q, k, v, dO as Hugging Face hands them over: (batch, seq, heads, dim) projections, transposed."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, S, h, D, generator=g).transpose(1, 2) for h in (HQ, HKV, HKV, HQ))
    return q, k, v, do


@pytest.mark.parametrize("config", ["default", "small_tma", "mixed_atomic"])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2), (16, 2), (8, 1)], ids=["ratio1", "ratio4", "ratio8", "mqa"])
def test_gqa_ratios_forward_and_all_gradients(heads, config, use_configs):
    """Grouped-query attention at the ratios models use, in their layout: the dK/dV programs sum a
    group's q heads in registers, so every kv head's gradient gathers all of its group's rows."""
    HQ, HKV = heads
    q, k, v, do = _hf_inputs(2, 37, HQ, HKV, 32, seed=HQ * 10 + HKV)
    with use_configs(CONFIGS[config]):
        got = _ours(q, k, v, do, True)
    _check_against_reference(got, q, k, v, do, True)


def test_layouts_need_no_copies_around_the_op(use_configs):
    """The output is a (b, h, s, d) view of (b, s, h, d) memory, so the model's transpose + reshape is
    free; each gradient comes in its input's layout, so the projections' view backward is too."""
    q, k, v, do = _hf_inputs(1, 19, 4, 2, 16, seed=9)
    q, k, v = (leaf(t) for t in (q, k, v))
    with use_configs(CONFIGS["small"]):
        out = attention(q, k, v, causal=True)
        out.backward(do)
    assert out.transpose(1, 2).is_contiguous()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad.stride() == t.stride(), f"d{name} strides {t.grad.stride()} != {name}'s {t.stride()}"
    contiguous = [leaf(t.contiguous()) for t in (q, k, v)]
    with use_configs(CONFIGS["small"]):
        attention(*contiguous, causal=True).backward(do)
    assert all(t.grad.is_contiguous() for t in contiguous)


def test_reference_agrees_with_sdpa():
    """Pins the reference's semantics (GQA head mapping, top-left causal) to PyTorch's."""
    q, k, v, _ = _inputs(1, 4, 2, 7, 11, 16, torch.float64, seed=5)
    for causal in (False, True):
        ref = attention_ref(q, k, v, causal=causal, scale=0.4)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.4, enable_gqa=True)
        torch.testing.assert_close(ref, sdpa, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config", ["small", "mixed_atomic", "small_tma"])
def test_every_output_element_is_written(config, use_configs):
    """Every buffer the op allocates starts as NaN (out, lse, delta, dq/dk/dv, the fp32 dQ
    accumulator); any element a kernel skips shows up as NaN."""
    q, k, v, do = _inputs(1, 2, 1, 21, 37, 24, torch.float32, seed=6)
    with use_configs(CONFIGS[config]), poisoned_allocations():
        got = _ours(q, k, v, do, True)
    _check_against_reference(got, q, k, v, do, True)


def test_keys_no_query_sees_get_zero_grads(use_configs):
    # causal, seq_q < seq_k: keys past seq_q are never attended; their dK/dV are exactly 0
    q, k, v, do = _inputs(1, 1, 1, 5, 40, 16, torch.float32, seed=7)
    with use_configs(CONFIGS["small"]):
        _, _, dk, dv = _ours(q, k, v, do, True)
    assert torch.equal(dk[:, :, 5:], torch.zeros_like(dk[:, :, 5:]))
    assert torch.equal(dv[:, :, 5:], torch.zeros_like(dv[:, :, 5:]))
    assert dk[:, :, :5].abs().sum() > 0


def test_empty_query_sequence():
    q, k, v, do = _inputs(1, 2, 2, 0, 5, 16, torch.float32)
    got = _ours(q, k, v, do, True)
    assert got[0].shape == (1, 2, 0, 16)
    assert torch.equal(got[2], torch.zeros_like(k)) and torch.equal(got[3], torch.zeros_like(v))


def test_launch_parameters_come_from_the_spec(use_configs):
    seen = []
    q, k, v, do = _inputs(1, 4, 2, 17, 9, 32, torch.float32)
    with use_configs(CONFIGS["small"], seen):
        _ours(q, k, v, do, True)
    kernels = {name for name, _ in seen}
    assert {"attention_fwd", "attention_bwd_preprocess", "attention_bwd_dkdv", "attention_bwd_dq"} <= kernels
    problem = dict(seen[0][1])
    assert problem["head_dim"] == 32 and problem["causal"] is True and problem["dtype"] == "torch.float32"
    assert problem["group"] == 2 and problem["seq_q"] == 32 and problem["seq_k"] == 16


def test_bad_config_from_a_spec_is_rejected(use_configs):
    q, k, v, _ = _inputs(1, 1, 1, 8, 8, 16, torch.float32)
    with use_configs({"attention_fwd": dict(BLOCK_M=24)}):
        with pytest.raises(ValueError, match="BLOCK_M=24"):
            attention(q, k, v)
    with use_configs({"attention_bwd_dq": dict(BLOCK_M=512)}):  # beyond the padded lse/delta rows
        out = attention(q.requires_grad_(), k, v)
        with pytest.raises(ValueError, match="BLOCK_M=512.*from 16 to 256"):
            out.sum().backward()


def _scores(q, k, causal, scale):
    """float64 scaled scores with k's heads repeated for GQA, -inf above the top-left diagonal."""
    s = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2) * scale
    return s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf")) if causal else s


def _own_kernels_spec(calls, written, run, decline=False):
    """A spec whose ``attention_forward`` / ``attention_backward`` record each call and, when ``run``,
    compute in float64 from exactly what the hooks promise (the forward writes out and the base-2
    logsumexp; the backward's runner reads that lse and delta = rowsum(dO * O)), keeping copies in
    ``written``; otherwise they decline with ``decline``."""

    def attention_forward(q, k, v, o, lse, causal, scale, *, bounds):
        calls.append(("forward", tuple(q.shape), tuple(k.shape), causal, scale))
        if run and bounds is None:
            s = _scores(q, k, causal, scale)
            o.copy_(torch.softmax(s, -1) @ v.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1))
            lse[..., : q.shape[2]] = torch.logsumexp(s, -1) / math.log(2)
            written["out"] = o.clone()
        return run and bounds is None

    def attention_backward(q, k, v, do, dk, dv, lse, causal, scale, *, bounds):
        calls.append(("backward", tuple(q.shape), tuple(k.shape), causal, scale))
        if not run or bounds is not None:
            return decline

        def backward(dqa, delta):
            calls.append(("backward run", tuple(dqa.shape), dqa.dtype))
            written["dqa"], written["delta"] = dqa.clone(), delta.clone()  # as the op hands them over
            sq, group = q.shape[2], q.shape[1] // k.shape[1]
            p = torch.exp2(_scores(q, k, causal, scale) / math.log(2) - lse[..., :sq, None].double())
            dp = do.double() @ v.double().repeat_interleave(group, dim=1).transpose(-1, -2)
            ds = p * (dp - delta[..., :sq, None].double())
            fold = lambda t: t.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731 (sum a group's q heads)
            dqa[..., : q.shape[3]] += ds @ k.double().repeat_interleave(group, dim=1) * scale
            dv.copy_(fold(p.transpose(-1, -2) @ do.double()))
            dk.copy_(fold(ds.transpose(-1, -2) @ q.double()) * scale)
            written["dq"], written["dk"], written["dv"] = dqa[..., : q.shape[3]].clone(), dk.clone(), dv.clone()

        return backward

    return make_spec(
        "own_kernels_spec",
        kernel_config=lambda kernel, **problem: CONFIGS["small"].get(kernel),
        attention_forward=attention_forward,
        attention_backward=attention_backward,
    )


@pytest.mark.parametrize("run", [True, False], ids=["runs", "declines"])
def test_a_backend_may_run_its_own_kernels(run, registry):
    """The forward and the backward ask the backend first: what its kernels write is the op's result;
    declining leaves the portable kernels."""
    calls, written = [], {}
    tritonspec.register_spec("own-kernels-test", _own_kernels_spec(calls, written, run))
    q, k, v, do = _inputs(1, 4, 2, 33, 21, 32, torch.float32, seed=11)
    with tritonspec.use_backend("own-kernels-test"):
        got = _ours(q, k, v, do, True, scale=0.3)
    ran = [("backward run", (1, 4, 33, 32), torch.float32)] if run else []
    assert calls == [(kind, (1, 4, 33, 32), (1, 2, 21, 32), True, 0.3) for kind in ("forward", "backward")] + ran
    _check_against_reference(got, q, k, v, do, True, scale=0.3)
    if run:  # bit for bit what the spec wrote, not a second run of the portable kernels
        assert all(torch.equal(got[i], written[name]) for i, name in enumerate(("out", "dq", "dk", "dv")))


class _BackwardLaunches:
    """Records the backward's launches (kernel name -> its arguments by name) and passes them through."""

    def __init__(self, monkeypatch):
        self.module = sys.modules["tritonspec.ops.attention"]
        self.launch, self.seen = self.module.launch, {}
        monkeypatch.setattr(self.module, "launch", self)

    def __call__(self, kernel, grid, *args, **kwargs):
        self.seen.setdefault(kernel.__name__, []).append(kwargs)
        return self.launch(kernel, grid, *args, **kwargs)


def _float32_allocations(monkeypatch):
    """The shapes of the float32 tensors ``torch.empty`` allocates from here on."""
    shapes, empty = [], torch.empty

    def recording(*size, **kwargs):
        t = empty(*size, **kwargs)
        if t.dtype == torch.float32:
            shapes.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", recording)
    return shapes


@pytest.mark.parametrize("decline", [False, None])
def test_a_declined_backward_allocates_no_dq_accumulator(decline, registry, monkeypatch):
    """The backward hook answers before the op allocates anything: on a decline the preprocess only
    computes delta (no fp32 dQ accumulator allocated or zeroed) and the portable kernels match float64."""
    calls = []
    tritonspec.register_spec("declines-test", _own_kernels_spec(calls, {}, run=False, decline=decline))
    q, k, v, do = _inputs(2, 4, 2, 37, 29, 24, torch.float32, seed=13)  # head dim 24: dqa's is padded to 32
    with tritonspec.use_backend("declines-test"):
        q, k, v = (leaf(t) for t in (q, k, v))
        out = attention(q, k, v, causal=True, scale=0.25)
        launches, allocated = _BackwardLaunches(monkeypatch), _float32_allocations(monkeypatch)
        out.backward(do)
    assert [c[0] for c in calls] == ["forward", "backward"]
    (pre,) = launches.seen["_attn_bwd_pre_kernel"]
    assert pre["ZERO_DQA"] is False and pre["DQA"] is pre["DELTA"]  # the dummy pointer: never read
    assert "_attn_bwd_dq_convert_kernel" not in launches.seen and "_attn_bwd_dq_kernel" in launches.seen
    assert (2, 4, 37, 32) not in allocated
    got = (out.detach(), q.grad, k.grad, v.grad)
    _check_against_reference(got, q.detach(), k.detach(), v.detach(), do, True, scale=0.25)


def test_a_taken_backward_runs_on_a_zeroed_accumulator_and_delta(registry, monkeypatch):
    """A backend that takes the backward gets, once its hook returned, a zeroed fp32 accumulator with
    the head dim padded and delta = rowsum(dO * O) (padded rows 0); the op converts what it adds up."""
    calls, written = [], {}
    tritonspec.register_spec("takes-test", _own_kernels_spec(calls, written, run=True))
    q, k, v, do = _inputs(2, 4, 2, 37, 29, 24, torch.float32, seed=17)
    with tritonspec.use_backend("takes-test"):
        q, k, v = (leaf(t) for t in (q, k, v))
        out = attention(q, k, v, causal=True, scale=0.25)
        launches = _BackwardLaunches(monkeypatch)
        out.backward(do)
    assert [c[0] for c in calls] == ["forward", "backward", "backward run"]
    (pre,) = launches.seen["_attn_bwd_pre_kernel"]
    assert pre["ZERO_DQA"] is True and pre["DQA"] is not pre["DELTA"]
    dqa, delta = written["dqa"], written["delta"]
    assert dqa.dtype == torch.float32 and tuple(dqa.shape) == (2, 4, 37, 32) and not dqa.any()
    ref_delta = (out.detach().double() * do.double()).sum(-1)
    torch.testing.assert_close(delta[..., :37].double(), ref_delta, rtol=1e-5, atol=1e-5)
    assert not delta[..., 37:].any()
    got = (out.detach(), q.grad, k.grad, v.grad)
    _check_against_reference(got, q.detach(), k.detach(), v.detach(), do, True, scale=0.25)


@pytest.mark.parametrize("result", [True, 1, "run"])
def test_a_backward_hook_returning_neither_a_runner_nor_a_decline_is_an_error(result, registry):
    def attention_backward(q, k, v, do, dk, dv, lse, causal, scale, *, bounds):
        return result

    tritonspec.register_spec("bad-runner-test", make_spec("bad_runner_spec", attention_backward=attention_backward))
    q, k, v = (leaf(t) for t in _inputs(1, 2, 1, 17, 17, 16, torch.float32, seed=19)[:3])
    with tritonspec.use_backend("bad-runner-test"):
        out = attention(q, k, v)
        with pytest.raises(
            tritonspec.SpecContractError,
            match=r"backend 'bad-runner-test' hook 'attention_backward' returned the wrong thing: expected False "
            r"or None \(decline\) or a function to run, got",
        ):
            out.sum().backward()


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((_t(2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), {}, ValueError, r"argument 'q' must have 4 dimensions"),
        ((_t(1, 2, 8, 16), [1], _t(1, 2, 8, 16)), {}, TypeError, r"argument 'k' must be a torch.Tensor"),
        (
            (_t(1, 2, 8, 16), _t(1, 2, 8, 16, dtype=torch.float16), _t(1, 2, 8, 16)),
            {},
            TypeError,
            r"argument 'k' has dtype torch.float16 but 'q' has torch.float32",
        ),
        ((_t(1, 2, 8, 16, dtype=torch.float64),) * 3, {}, TypeError, r"argument 'q' has dtype torch.float64"),
        ((_t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), {}, ValueError, r"'q' has 3 heads, which is not"),
        ((_t(1, 2, 8, 16), _t(1, 2, 8, 32), _t(1, 2, 8, 32)), {}, ValueError, r"argument 'k' has head_dim 32"),
        ((_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 9, 16)), {}, ValueError, r"'k' and 'v' must have the same shape"),
        ((_t(1, 2, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16)), {}, ValueError, r"argument 'k' has batch 2"),
        ((_t(1, 2, 8, 16), _t(1, 2, 0, 16), _t(1, 2, 0, 16)), {}, ValueError, r"argument 'k' has seq_k = 0"),
        ((_t(1, 2, 8, 300), _t(1, 2, 8, 300), _t(1, 2, 8, 300)), {}, ValueError, r"'q' has head_dim 300"),
        ((_t(1, 2, 8, 16),) * 3, {"scale": float("nan")}, ValueError, r"argument 'scale' must be a finite"),
        ((_t(1, 2, 8, 16),) * 3, {"scale": "0.5"}, ValueError, r"argument 'scale' must be a finite"),
        ((_t(1, 2, 8, 16),) * 3, {"causal": 1}, TypeError, r"argument 'causal' must be a bool"),
    ],
)
def test_bad_inputs_raise(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attention(*args, **kwargs)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    no_interpreter(monkeypatch)
    x = _t(1, 1, 4, 16)
    with pytest.raises(ValueError, match="argument 'q' is on the CPU"):
        attention(x, x, x)


def test_scale_default_is_inverse_sqrt_head_dim(use_configs):
    q, k, v, _ = _inputs(1, 1, 1, 6, 6, 32, torch.float32, seed=8)
    with use_configs(CONFIGS["small"]):
        a = attention(q, k, v)
        b = attention(q, k, v, scale=1 / math.sqrt(32))
    assert torch.equal(a, b)


def _library_ops():
    from tritonspec.ops.attention import ATTENTION

    return ATTENTION.forward_op, ATTENTION.backward_op


def test_library_op_schemas():
    """The schemas the op's annotated forward and backward give: what compiled graphs call."""
    _library_ops()  # registers them
    ops = torch.ops.tritonspec
    assert str(ops.attention_fwd.default._schema) == (
        "tritonspec::attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? bounds, Tensor? sinks, bool causal, "
        "float scale) -> (Tensor, Tensor)"
    )
    assert str(ops.attention_bwd.default._schema) == (
        "tritonspec::attention_bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? bounds, "
        "Tensor? sinks, bool causal, float scale) -> (Tensor, Tensor, Tensor, Tensor)"
    )


def test_library_op_path_in_eager(monkeypatch, use_configs):
    """The registered ops (what torch.compile calls) and their autograd, without compiling."""
    from tritonspec.ops import _library

    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    q, k, v, do = _inputs(1, 4, 2, 33, 33, 32, torch.float32, seed=3)
    with use_configs(CONFIGS["small"]):
        got = _ours(q, k, v, do, True)
    _check_against_reference(got, q, k, v, do, True)


def test_torch_compile_fullgraph(use_configs):
    """No graph break: the forward and backward run as custom ops inside one compiled graph."""
    q, k, v, do = _inputs(1, 2, 1, 17, 17, 16, torch.float32, seed=4)
    ql, kl, vl = (leaf(t) for t in (q, k, v))

    def f(q, k, v):
        return attention(q * 0.5, k, v, causal=True) + q

    out = torch.compile(f, fullgraph=True)(ql, kl, vl)
    out.backward(do)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q64 * 0.5, k64, v64, causal=True) + q64
    ref.backward(do.double())
    for name, g, r in [
        ("out", out, ref),
        ("dq", ql.grad, q64.grad),
        ("dk", kl.grad, k64.grad),
        ("dv", vl.grad, v64.grad),
    ]:
        _assert_close(name, g.detach(), r.detach(), _TOL[torch.float32])


def test_opcheck():
    fwd, bwd = _library_ops()
    q, k, v, do = _inputs(1, 2, 1, 17, 17, 16, torch.float32, seed=5)
    ql, kl, vl = (leaf(t) for t in (q, k, v))
    torch.library.opcheck(fwd, (ql, kl, vl, None, None, True, 0.25))
    o, lse = fwd(q, k, v, None, None, False, 0.25)
    torch.library.opcheck(bwd, (do, q, k, v, o, lse, None, None, False, 0.25))
