"""Launch-config tables for parts we cannot run, run for correctness on the GPU we have.

The sm80 table (A100) and the AMD CDNA table (gfx942, gfx90a) are chosen for those parts' limits and
checked offline by ``tritonspec check --kernels``; here their configs drive the same kernels on this GPU
(compiled for its own arch), so every tile they pick is shown to compute the right thing. The tables are
reached as their backends reach them: ``launch_config`` with the table's backend selected and
``for_arch`` naming the part. The NVIDIA table goes through a spec holding only it, so Hopper's own
attention kernels (which do not read tables) stay out of the way.
"""

import pytest
import torch
from helpers import leaf, make_spec
from numerics import assert_close

import tritonspec
from tritonspec.launch import for_arch
from tritonspec.ops import attention, linear_cross_entropy, moe_experts, rms_norm, rope, swiglu
from tritonspec.ops.attention import attention_ref
from tritonspec.ops.linear_cross_entropy import linear_cross_entropy_ref
from tritonspec.ops.moe import moe_experts_ref
from tritonspec.ops.rms_norm import rms_norm_ref
from tritonspec.ops.rope import rope_ref
from tritonspec.ops.swiglu import swiglu_ref
from tritonspec_backends.nvidia.backend.spec import configs as nvidia_configs

pytestmark = pytest.mark.gpu
DEV = "cuda"
PROFILES = [("sm80-table", 80), ("amd", "gfx942"), ("amd", "gfx90a")]


@pytest.fixture(params=PROFILES, ids=lambda p: f"{p[0]}-{p[1]}")
def profile(request):
    backend, arch = request.param
    if backend == "sm80-table":
        tritonspec.register_spec(backend, make_spec("sm80_table", kernel_config=nvidia_configs.kernel_config))
    try:
        with tritonspec.use_backend(backend), for_arch(arch):
            yield backend, arch
    finally:
        if backend == "sm80-table":
            tritonspec.PROVIDERS.unregister(backend)


def _backward(out, ref, inputs, refs):
    dy = torch.randn(out.shape, device=DEV).to(out.dtype)
    out.backward(dy)
    ref.backward(dy.double())
    return [(a.grad, b.grad) for a, b in zip(inputs, refs)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q", [1000, 16])
def test_attention(profile, d, causal, seq_q):
    if seq_q < 1000 and causal:
        pytest.skip("decode steps attend to every key")
    torch.manual_seed(d + seq_q)
    q = torch.randn(2, seq_q, 8, d, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(2, 1000, 2, d, device=DEV, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    ins = [leaf(t) for t in (q, k, v)]
    refs = [leaf(t.double()) for t in (q, k, v)]
    out = attention(*ins, causal=causal)
    ref = attention_ref(*refs, causal=causal)
    assert_close(out, ref, "out")
    for (g, rg), name in zip(_backward(out, ref, ins, refs), "qkv"):
        assert_close(g, rg, f"d{name}", scale=rg.abs().max().item() * 4)


@pytest.mark.parametrize("tokens", [1024, 4])  # 256 rows an expert (the tables' large tiles), and decode
def test_moe_experts(profile, tokens):
    torch.manual_seed(tokens)
    E, H, I, k = 8, 512, 768, 2
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, device=DEV).softmax(-1)
    gate_up = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) / H**0.5
    down = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) / I**0.5
    ins = [leaf(t) for t in (x, w, gate_up, down)]
    refs = [leaf(t.double()) for t in (x, w, gate_up, down)]
    out = moe_experts(ins[0], ids, ins[1], ins[2], ins[3])
    ref = moe_experts_ref(refs[0], ids, refs[1], refs[2], refs[3])
    assert_close(out, ref, "out", scale=ref.abs().max().item() * 2)
    for (g, rg), name in zip(_backward(out, ref, ins, refs), ("dx", "dweights", "dgate_up", "ddown")):
        assert_close(g, rg, name, torch.bfloat16, scale=rg.abs().max().item() * 8)


@pytest.mark.parametrize("n", [2048, 7168])
def test_row_kernels(profile, n):
    torch.manual_seed(n)
    x, w = torch.randn(64, n, device=DEV, dtype=torch.bfloat16), torch.randn(n, device=DEV, dtype=torch.bfloat16)
    xl, wl, x64, w64 = leaf(x), leaf(w), leaf(x.double()), leaf(w.double())
    y, ref = rms_norm(xl, wl, 1e-6), rms_norm_ref(x64, w64, 1e-6)
    assert_close(y, ref, "rms_norm")
    (dx, rdx), _ = _backward(y, ref, [xl, wl], [x64, w64])
    assert_close(dx, rdx, "rms_norm dx")
    g, u = (torch.randn(64, n, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    assert_close(swiglu(g, u), swiglu_ref(g.double(), u.double()), "swiglu")
    q = torch.randn(1, 64, 32, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    kk = torch.randn(1, 64, 8, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = (torch.randn(1, 64, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    for a, b, name in zip(rope(q, kk, cos, sin), rope_ref(q.double(), kk.double(), cos.double(), sin.double()), "qk"):
        assert_close(a, b, f"rope {name}")


def test_linear_cross_entropy(profile):
    torch.manual_seed(1)
    hidden = torch.randn(96, 512, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(32000, 512, device=DEV, dtype=torch.bfloat16) / 512**0.5
    labels = torch.randint(0, 32000, (96,), device=DEV)
    loss = linear_cross_entropy(hidden, weight, labels)
    ref = linear_cross_entropy_ref(hidden.double(), weight.double(), labels)
    assert_close(loss, ref, "loss", torch.bfloat16, scale=ref.abs().item() * 2)
