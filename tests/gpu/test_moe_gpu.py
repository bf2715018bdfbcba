"""The experts' grouped GEMMs of Hopper's spec (``moe_experts_gemm``, ``moe_weight_grad``) at Mixtral-, Qwen3-
and GPT-OSS-class shapes: they take the GEMMs they should, every output element is written, and the op's output
and all its gradients equal the portable kernels' bit for bit (the same products summed in the same order), so
the float64 checks of those kernels hold for them too; the output is checked against float64 here as well.

Run with TRITONSPEC_TEST_DEVICE=cuda on an sm90 GPU; the CPU suite checks the op's side of the hooks."""

import pytest
import torch

from tritonspec.ops import moe as moe_mod
from numerics import assert_close, poisoned_allocations
from tritonspec.ops.moe import moe_experts, moe_experts_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _run(x, ids, w, gate_up, down, dout, kw):
    with torch.no_grad():
        inference = moe_experts(x, ids, w, gate_up, down, **kw)
    leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    out = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], **kw)
    out.backward(dout)
    return [inference, out.detach()] + [t.grad for t in leaves]


# (T, H, I, E, k, layout, with biases): Mixtral-class (every GEMM taken), Qwen3-class (small experts: the row
# GEMMs over rows sorted already, not gate/up), GPT-OSS-class (biases, interleaved gate/up, N not a multiple
# of the 256-column tile: the backward's dx only); each 512 rows an expert
CASES = {
    "mixtral": (1024, 2048, 16384, 4, 2, "concatenated", False),
    "qwen3": (1024, 2048, 768, 16, 8, "concatenated", False),
    "gpt_oss": (1024, 2880, 2880, 8, 4, "interleaved_transposed", True),
}
# per case, which of the asked GEMMs the hook takes, in the op's order: the inference forward's gate/up and
# down, the training forward's, then the backward's d h (over sorted rows where the weight gradients read
# them: large experts) and dx
TAKEN = {
    "mixtral": [True] * 6,
    "qwen3": [False, True, False, True, True],
    "gpt_oss": [True],
}
# and of the weight gradients (d down_proj, then d gate_up_proj; asked only without biases): those gathering
# the tokens' rows; Mixtral's read rows sorted first (d gate_up_proj in two blocks of x's columns): declined
WEIGHT_GRADS_TAKEN = {"mixtral": [False] * 3, "qwen3": [True, True], "gpt_oss": []}


@pytest.mark.skipif(not _sm90(), reason="Hopper's own kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_hopper_grouped_gemm_equals_the_portable_kernels(case, dtype, monkeypatch):
    T, H, I, E, k, layout, biases = CASES[case]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEV)
    w = torch.rand(T, k, generator=gen).softmax(-1).to(DEV, dtype)
    shapes = ((E, 2 * I, H), (E, H, I)) if layout == "concatenated" else ((E, H, 2 * I), (E, I, H))
    gate_up = (torch.randn(*shapes[0], generator=gen) * H**-0.5).to(DEV, dtype)
    down = (torch.randn(*shapes[1], generator=gen) * I**-0.5).to(DEV, dtype)
    kw = dict(layout=layout)
    if biases:
        kw.update(
            gate_up_bias=(torch.randn(E, 2 * I, generator=gen) * 0.1).to(DEV, dtype),
            down_bias=(torch.randn(E, H, generator=gen) * 0.1).to(DEV, dtype),
            activation="gpt_oss",
            clamp=7.0,
        )
    dout = torch.randn(T, H, generator=gen).to(DEV, dtype)
    asked, weight_grads = [], []
    backend_gemm, backend_weight_grad = moe_mod._backend_gemm, moe_mod._backend_weight_grad

    def recording(*args, **kwargs):
        run = backend_gemm(*args, **kwargs)
        asked.append(run is not None)
        return run

    def recording_weight_grad(*args):
        weight_grads.append(backend_weight_grad(*args))
        return weight_grads[-1]

    monkeypatch.setattr(moe_mod, "_backend_gemm", recording)
    monkeypatch.setattr(moe_mod, "_backend_weight_grad", recording_weight_grad)
    with poisoned_allocations():
        hopper = _run(x, ids, w, gate_up, down, dout, kw)
    assert asked == TAKEN[case]
    assert weight_grads == WEIGHT_GRADS_TAKEN[case]
    monkeypatch.setattr(moe_mod, "_backend_gemm", lambda *args, **kwargs: None)
    monkeypatch.setattr(moe_mod, "_backend_weight_grad", lambda *args: False)
    portable = _run(x, ids, w, gate_up, down, dout, kw)
    for name, a, b in zip(("inference", "out", "dx", "dweights", "dgate_up", "ddown"), hopper, portable):
        assert torch.equal(a, b), name
    f64 = {n: t.double() if torch.is_tensor(t) else t for n, t in kw.items()}
    ref = moe_experts_ref(x.double(), ids, w.double(), gate_up.double(), down.double(), **f64)
    assert_close(hopper[0], ref, "out", dtype)
