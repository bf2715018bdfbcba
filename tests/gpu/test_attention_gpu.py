"""Attention on a CUDA GPU against a float64 reference computed from the same (upcast) inputs.

Tolerance model: our error must stay within a small multiple of the error PyTorch's own SDPA makes
in the same dtype (both round P and dS to 16 bits before the matmuls), plus one ulp of the output's
magnitude. Runs with the op's portable defaults, with the tuned sm90 table for the ``tl`` kernels, and
as the nvidia spec ships (that table plus Hopper's warp-specialized forward).
"""

import collections
import json
import os

import pytest
from helpers import leaf, make_spec
import torch
import torch.nn.functional as F

import tritonspec
from tritonspec.ops.attention import attention, attention_ref
from tritonspec_backends.nvidia.backend.spec.attention_sm90 import (
    backward as backward_sm90,
    forward as forward_sm90,
    launchers as launchers_sm90,
)
from tritonspec_backends.nvidia.backend.spec.configs import h100_attention_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _spec(fn, hopper=False):
    def kernel_config(kernel, **problem):
        return fn(kernel, **{k: v for k, v in problem.items() if k != "device"})

    exports = {"kernel_config": kernel_config}
    if hopper:  # as the nvidia spec ships: Hopper's own forward and backward kernels where they apply
        exports.update(
            attention_forward=launchers_sm90.attention_forward, attention_backward=launchers_sm90.attention_backward
        )
    return make_spec("attention_gpu_test_spec", **exports)


def _tuned(kernel, **problem):
    """The shipped sm90 table, or a candidate table (bench --sweep's table.json) named by
    TRITONSPEC_ATTENTION_TABLE, so a sweep's winners are tested before they are committed."""
    path = os.environ.get("TRITONSPEC_ATTENTION_TABLE")
    tables = None
    if path:
        with open(path) as fh:
            tables = {
                kern: {(int(key.split(",")[0]), bool(int(key.split(",")[1]))): cfg for key, cfg in t.items()}
                for kern, t in json.load(fh).items()
            }
    return h100_attention_config(kernel, tables=tables, **problem)


def _is_sm90():
    return torch.cuda.get_device_capability()[0] == 9


def _atomic_reduce(kernel, **problem):
    cfg = _tuned(kernel, **problem)
    if kernel == "attention_bwd_dkdv" and cfg is not None:
        cfg.update(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, DQ_ATOMIC=True, DQ_TMA_REDUCE=True)
    return cfg


def _atomic_ptr(kernel, **problem):
    cfg = _tuned(kernel, **problem)
    if kernel == "attention_bwd_dkdv" and cfg is not None:
        cfg.update(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2, DQ_ATOMIC=True, DQ_TMA_REDUCE=False)
    return cfg


# name -> (kernel_config, with Hopper's own kernels): "h100" is what the nvidia spec ships on sm90;
# the atomic variants test the portable dK/dV kernel with dQ riding on it (Hopper's own would take over)
SPECS = {
    "default": (None, False),
    "h100": (_tuned, True),
    "h100_tl": (_tuned, False),
    "h100_atomic_reduce": (_atomic_reduce, False),
    "h100_atomic_ptr": (_atomic_ptr, False),
}


@pytest.fixture
def configs(registry):
    name = "attention-gpu-test"

    def use(key):
        fn, hopper = SPECS[key]
        if fn is None:
            tritonspec.register_spec(name, _spec(lambda kernel, **problem: None))
        else:
            if not _is_sm90():
                pytest.skip("tuned table is for sm90")
            tritonspec.register_spec(name, _spec(fn, hopper))
        return tritonspec.use_backend(name)

    return use


def _run(q, k, v, do, causal, fn):
    q, k, v = (leaf(t) for t in (q, k, v))
    out = fn(q, k, v, causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), dq, dk, dv


def _check(B, HQ, HKV, S, D, causal, dtype, q=None, k=None, v=None, do=None, op=attention):
    g = torch.Generator(device="cuda").manual_seed(S * 7 + D)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dtype)  # noqa: E731
    q = mk(B, HQ, S, D) if q is None else q
    k = mk(B, HKV, S, D) if k is None else k
    v = mk(B, HKV, S, D) if v is None else v
    do = mk(B, HQ, S, D) if do is None else do
    ours = _run(q, k, v, do, causal, lambda q, k, v, c: op(q, k, v, causal=c))
    ref = _run(
        q.double(), k.double(), v.double(), do.double(), causal, lambda q, k, v, c: attention_ref(q, k, v, causal=c)
    )
    sdpa = _run(
        q,
        k,
        v,
        do,
        causal,
        lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=HQ != HKV),
    )
    for name, o, r, s in zip(("out", "dq", "dk", "dv"), ours, ref, sdpa):
        assert o.dtype == dtype and o.shape == r.shape
        assert torch.isfinite(o).all(), f"{name}: non-finite values"
        err = (o.double() - r).abs().max().item()
        err_sdpa = (s.double() - r).abs().max().item()
        bound = 3 * err_sdpa + _EPS[dtype] * max(1.0, r.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} (SDPA's error {err_sdpa:.3e})"


@pytest.mark.parametrize("spec", ["h100", "h100_tl"])
@pytest.mark.parametrize("S", [1, 17, 1000, 4096])
@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_tuned_bf16(S, D, causal, spec, configs):
    with configs(spec):
        _check(1, 2, 2, S, D, causal, torch.bfloat16)


@pytest.mark.parametrize("S", [17, 1000])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_portable_defaults_bf16(S, D, causal, configs):
    with configs("default"):
        _check(1, 2, 2, S, D, causal, torch.bfloat16)


@pytest.mark.parametrize("spec", ["h100", "h100_tl", "default"])
@pytest.mark.parametrize("S", [17, 1000])
def test_fp16(S, spec, configs):
    with configs(spec):
        _check(1, 2, 2, S, 128, True, torch.float16)


@pytest.mark.parametrize("spec", ["h100", "h100_tl", "h100_atomic_reduce", "h100_atomic_ptr", "default"])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(spec, causal, configs):
    with configs(spec):
        _check(2, 8, 2, 1000, 128, causal, torch.bfloat16)


@pytest.mark.parametrize("spec", ["h100", "h100_tl", "default"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (16, 4), (32, 4), (8, 1)], ids=["ratio1", "ratio4", "ratio8", "mqa"])
def test_gqa_ratios_in_hf_layout(heads, D, spec, configs):
    """The models' GQA ratios, causal, with inputs in Hugging Face's transposed layout; the output and
    the gradients keep the layouts the model's reshapes need without copies."""
    HQ, HKV = heads
    B, S = 2, 1000
    g = torch.Generator(device="cuda").manual_seed(HQ + HKV)
    mk = lambda h: torch.randn(B, S, h, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)  # noqa
    q, k, v, do = mk(HQ), mk(HKV), mk(HKV), mk(HQ)
    with configs(spec):
        _check(B, HQ, HKV, S, D, True, torch.bfloat16, q, k, v, do)
        ql, kl, vl = (leaf(t) for t in (q, k, v))
        out = attention(ql, kl, vl, causal=True)
        grads = torch.autograd.grad(out, (ql, kl, vl), do)
    assert out.transpose(1, 2).is_contiguous()
    assert [t.stride() for t in grads] == [t.stride() for t in (q, k, v)]


@pytest.mark.parametrize("spec", ["h100", "h100_tl", "default"])
def test_hf_layout_and_odd_head_dim(spec, configs):
    """Strided (batch, seq, heads, dim).transpose(1, 2) inputs; head_dim 80 is padded to 128."""
    B, S, HQ, HKV, D = 2, 333, 4, 2, 80
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(B, S, HQ, D), mk(B, S, HKV, D), mk(B, S, HKV, D), mk(B, S, HQ, D)
    with configs(spec):
        _check(
            B,
            HQ,
            HKV,
            S,
            D,
            True,
            torch.bfloat16,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            do.transpose(1, 2),
        )


@pytest.mark.parametrize("causal", [False, True])
def test_torch_compile_fullgraph(causal, configs):
    """The custom ops run inside one Inductor graph (no graph break), forward and backward."""
    torch._dynamo.reset()
    with configs("h100" if _is_sm90() else "default"):
        _check(2, 8, 2, 1000, 128, causal, torch.bfloat16, op=torch.compile(attention, fullgraph=True))


def test_fp32_is_rejected_on_gpu():
    x = torch.randn(1, 1, 8, 64, device="cuda")
    with pytest.raises(TypeError, match="float32 only on the CPU interpreter"):
        attention(x, x, x)


class _LaunchSpy:
    """Counts the Hopper kernels' launches (through ``launchers.launch``) and passes them through.
    Starts with no launch plans, so a problem an earlier test ran launches through ``launch`` again."""

    def __init__(self, monkeypatch):
        self.launch, self.counts = launchers_sm90.launch, collections.Counter()
        monkeypatch.setattr(launchers_sm90, "launch", self)
        launchers_sm90._FWD_PLANS.clear()
        launchers_sm90._BWD_PLANS.clear()

    def __call__(self, kernel, grid, **kwargs):
        self.counts[kernel] += 1
        if kernel is forward_sm90._attn_fwd_ws_kernel:
            self.fwd_warpgroups = kwargs["WGS"]  # the kernel's arguments come by name
        return self.launch(kernel, grid, **kwargs)

    def launches(self):
        """(forward, backward) launches so far."""
        return self.counts[forward_sm90._attn_fwd_ws_kernel], self.counts[backward_sm90._attn_bwd_ws_kernel]


def _assert_as_close_as_sdpa(ours, q, k, v, do, causal):
    """Ours (out, dq, dk, dv) against float64, within 3x SDPA's own error on the same inputs."""
    ref = _run(
        q.double(), k.double(), v.double(), do.double(), causal, lambda q, k, v, c: attention_ref(q, k, v, causal=c)
    )
    sdpa = _run(
        q, k, v, do, causal, lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=True)
    )
    for name, o, r, s in zip(("out", "dq", "dk", "dv"), ours, ref, sdpa):
        err, err_sdpa = (o.double() - r).abs().max().item(), (s.double() - r).abs().max().item()
        assert err <= 3 * err_sdpa + _EPS[torch.bfloat16] * r.abs().max().item(), name


@pytest.mark.parametrize(
    "seq_q,seq_k,causal,d",
    [
        (1000, 1000, True, 128),
        (700, 300, True, 128),
        (300, 700, False, 128),
        (300, 700, True, 128),
        (320, 1000, True, 128),
        (4096, 4096, False, 128),
        (5000, 5000, True, 128),
        (1000, 1000, False, 64),
        (300, 700, False, 64),
        (4096, 4096, False, 64),
        (5000, 5000, True, 64),
    ],
)
def test_hopper_kernels_run_as_shipped(seq_q, seq_k, causal, d, monkeypatch):
    """No backend selected: the device resolves to the installed nvidia spec, whose Hopper kernels run
    the forward and the whole backward (seq_q != seq_k both ways: top-left causal as SDPA); the outputs
    and all gradients match float64. The backward's causal CTAs pair key tiles i and -1-i: odd tile
    counts (300 keys: 3 tiles) leave the middle one alone, and at 320 x 1000 the last key tiles see no
    query. The forward is persistent: at 4096 and 5000 there are more query tiles than SMs, so CTAs
    run several (causal: of different lengths), their ring and barrier phases carried across tiles. Head dim
    64 without the mask runs the forward's three-warpgroup CTAs (192-row tiles: 1000 and 4096 rows
    leave the last tile partial)."""
    if not _is_sm90():
        pytest.skip("Hopper's own kernels run on sm90 only")
    spy = _LaunchSpy(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(seq_q + seq_k)
    q, do = (torch.randn(2, 4, seq_q, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, seq_k, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    ours = _run(q, k, v, do, causal, lambda q, k, v, c: attention(q, k, v, causal=c))
    assert spy.launches() == (1, 1)
    assert spy.fwd_warpgroups == (3 if d == 64 and not causal else 2)
    _assert_as_close_as_sdpa(ours, q, k, v, do, causal)


def test_hopper_forward_in_head_sections(monkeypatch):
    """With an L2 too small for two kv heads' K/V, the forward's schedule goes one GQA group at a
    time, each group's causal tiles longest first: the outputs and gradients still match float64."""
    if not _is_sm90():
        pytest.skip("Hopper's own kernels run on sm90 only")
    spy = _LaunchSpy(monkeypatch)
    monkeypatch.setattr(launchers_sm90, "_l2_bytes", lambda device: 0)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, do = (torch.randn(2, 8, 3000, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 3000, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    ours = _run(q, k, v, do, True, lambda q, k, v, c: attention(q, k, v, causal=c))
    assert spy.launches() == (1, 1)
    _assert_as_close_as_sdpa(ours, q, k, v, do, True)


def test_a_captured_forward_outlives_the_launch_plans():
    """A CUDA graph that captured the Hopper forward still computes attention after the launch plans
    are dropped (a registry change or a full plan cache drops them) and freed memory is handed out
    again: the forward's tile list, whose address the graph holds, lives as long as the process."""
    if not _is_sm90():
        pytest.skip("Hopper's own kernels run on sm90 only")
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(2, 8, 1000, 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capturing stream, as torch.cuda.graph asks
        attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention(q, k, v, causal=True)
    launchers_sm90._FWD_PLANS.clear()
    with torch.cuda.stream(side):  # the warm-up's stream: its freed blocks go to calls on it
        junk = [torch.full((n,), 2**30, dtype=torch.int32, device="cuda") for n in range(64, 4096, 64)]
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    del junk
    ref = attention_ref(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    err, err_sdpa = (out.double() - ref).abs().max().item(), (sdpa.double() - ref).abs().max().item()
    assert err <= 3 * err_sdpa + _EPS[torch.bfloat16] * ref.abs().max().item()


def test_a_repeated_problem_relaunches_its_plan_on_the_new_tensors(monkeypatch):
    """A problem's second call launches the plan its first call recorded (no ``launch`` call, no
    descriptor built from scratch): the outputs and gradients are the second inputs', in Hugging
    Face's transposed layout, against float64."""
    if not _is_sm90():
        pytest.skip("Hopper's own kernels run on sm90 only")
    spy = _LaunchSpy(monkeypatch)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, do = (
            torch.randn(2, 700, 8, 128, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(2)
        )
        k, v = (
            torch.randn(2, 700, 2, 128, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(2)
        )
        ours = _run(q, k, v, do, True, lambda q, k, v, c: attention(q, k, v, causal=c))
        assert spy.launches() == (1, 1)  # the first call's; the second went through the plans
        _assert_as_close_as_sdpa(ours, q, k, v, do, True)


@pytest.mark.parametrize("case", ["head_dim 48", "head_dim 64", "decode", "negative scale", "unaligned stride"])
def test_hopper_kernels_decline_what_they_were_not_measured_on(case, monkeypatch):
    """Declined problems run the portable kernels, and give the same answer. Decode-sized queries
    decline only in the forward, where half the 128-row tile would idle; the backward takes them.
    Head dim 64 runs both, on 64-wide tiles."""
    if not _is_sm90():
        pytest.skip("Hopper's own kernels run on sm90 only")
    spy = _LaunchSpy(monkeypatch)
    B, H, S, D, scale = 1, 2, 300, 128, None
    if case.startswith("head_dim"):
        D = int(case.split()[1])
    elif case == "decode":
        S = 64
    elif case == "negative scale":
        scale = -0.05
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if case == "unaligned stride":  # 129-element rows: 258-byte strides TMA cannot address
        q = torch.randn(B, H, S, D + 1, device="cuda", dtype=torch.bfloat16)[..., :D]
    for t in (q, k, v):  # leaves as they are: a clone would realign the unaligned view
        t.requires_grad_()
    out = attention(q, k, v, scale=scale)
    ours = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
    assert spy.launches() == {"decode": (0, 1), "head_dim 64": (1, 1)}.get(case, (0, 0))
    ref = _run(
        q.double(),
        k.double(),
        v.double(),
        do.double(),
        False,
        lambda q, k, v, c: attention_ref(q, k, v, causal=c, scale=scale),
    )
    for name, o, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert (o.double() - r).abs().max().item() < 3e-2 * max(1.0, r.abs().max().item()), name
