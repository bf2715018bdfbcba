"""Fused linear + cross-entropy against the float64 reference: loss (per token for "none"), d hidden,
d weight, d bias, over the reductions, ignored tokens, label smoothing, softcap, num_items_in_batch,
several chunks and ragged vocabulary blocks.

Runs on the CPU through the Triton interpreter (shapes kept small); the same tests run on a GPU with
TRITONSPEC_TEST_DEVICE=cuda. Outputs come from ``poisoned_allocations``, so an element no kernel or GEMM
wrote is NaN and fails the elementwise comparison.

Error model (the tolerances below). float32: the logits and the sums carry float32 roundoff, far below
RTOL[float32]. bfloat16 (u = 2**-8): the logits are rounded to bfloat16 as ``lm_head`` rounds them, which moves
each token's loss by up to ~3u * max|z| (lse, z_y and the smoothing mean) and each softmax value by up to
2u * max|z| relative; the gradient rows are rounded once (u), each GEMM output once (u), and d weight once
per chunk it accumulates over. Sums cancel (softmax - target sums to zero), so gradient tolerances are
relative to the sums of absolute terms (|G| @ |W| and so on), as quack's weight-gradient tolerances are.
"""

import sys

import pytest
from helpers import leaf, make_spec
import torch
import torch.nn.functional as F

import tritonspec
from tritonspec.ops import _library
from numerics import assert_close, poisoned_allocations
from tritonspec.ops.linear_cross_entropy import (
    LINEAR_CROSS_ENTROPY,
    LINEAR_CROSS_ENTROPY_NONE,
    chunk_tokens,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)

lce = sys.modules["tritonspec.ops.linear_cross_entropy"]

U_BF16 = 2.0**-8


@pytest.fixture
def chunks(monkeypatch):
    """Force chunks of ``n`` tokens (the default rule follows Liger's, tiny at these vocabulary / hidden sizes)."""

    def force(n):
        monkeypatch.setattr(lce, "chunk_tokens", lambda tokens: n)

    return force


def _inputs(gen, device, n=(17,), h=24, v=100, dtype=torch.float32, bias=False, ignored=(), wscale=1.0):
    """hidden (*n, h), weight (v, h) scaled so logits are ~N(0, wscale^2), labels with ``ignored`` flat
    positions set to -100, and a bias (or None)."""
    x = torch.randn(*n, h, generator=gen)
    w = torch.randn(v, h, generator=gen) * (wscale / h**0.5)
    b = 0.5 * torch.randn(v, generator=gen) if bias else None
    y = torch.randint(0, v, n, generator=gen)
    y.view(-1)[list(ignored)] = -100
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w), y.to(device), cast(b)


def _reference(x, w, y, b, go, kw):
    """(loss, grads by name, tolerance scales by name) in float64; ``kw`` are the op's keywords."""
    x64, w64 = leaf(x.double()), leaf(w.double())
    b64 = None if b is None else leaf(b.double())
    loss = linear_cross_entropy_ref(x64, w64, y, bias=b64, **kw)
    loss.backward(go.double())
    grads = {"hidden": x64.grad, "weight": w64.grad, "bias": None if b is None else b64.grad}
    # G = d loss / d logits: the reference again with the logits as "hidden" and the identity as weight.
    z = x64.detach().reshape(-1, x.shape[-1]) @ w64.detach().t()
    if b is not None:
        z = z + b64.detach()
    zl = leaf(z)
    eye = torch.eye(w.shape[0], dtype=torch.float64, device=w.device)
    linear_cross_entropy_ref(zl, eye, y.reshape(-1), **kw).backward(go.double().reshape(-1 if go.dim() else ()))
    g = zl.grad.abs()
    cap = kw.get("softcap")
    zmax = (cap * torch.tanh(z / cap) if cap else z).abs().max().item()
    scales = {
        "hidden": (g @ w64.detach().abs()).max().item(),
        "weight": (g.t() @ x64.detach().reshape(-1, x.shape[-1]).abs()).max().item(),
        "bias": g.sum(0).max().item(),
    }
    return loss.detach(), grads, scales, zmax


def _loss_weight(y, kw):
    """What one token's loss error is multiplied by in the result: the reduction's factor times |grad_output|."""
    valid = (y != kw.get("ignore_index", -100)).sum().item()
    reduction = kw.get("reduction", "mean")
    if reduction == "sum":
        return max(valid, 1)
    if reduction == "mean" and kw.get("num_items_in_batch") is not None:
        return max(valid, 1) / float(kw["num_items_in_batch"])
    return 1.0


def _close(actual, expected, name, dtype, scale, rtol_bf16):
    if dtype == torch.float32:
        assert_close(actual, expected, name, dtype, scale=scale)
    else:
        torch.testing.assert_close(
            actual.double(),
            expected.double(),
            rtol=rtol_bf16,
            atol=rtol_bf16 * max(scale, 1e-30),
            msg=lambda m: f"{name} ({dtype}): {m}",
        )


def _check(x, w, y, b=None, *, frozen=(), go=None, n_chunks=1, **kw):
    """The op's loss and gradients (for the inputs not in ``frozen``) against the reference."""
    xl = x.detach().clone().requires_grad_("hidden" not in frozen)
    wl = w.detach().clone().requires_grad_("weight" not in frozen)
    bl = None if b is None else b.detach().clone().requires_grad_("bias" not in frozen)
    with poisoned_allocations():
        loss = linear_cross_entropy(xl, wl, y, bias=bl, **kw)
        if go is None:  # not 1: the backward's scaling runs
            go = torch.randn(loss.shape, device=loss.device) if loss.dim() else torch.tensor(0.75, device=loss.device)
        loss.backward(go)
    ref, grads, scales, zmax = _reference(x, w, y, b, go, kw)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    dtype = x.dtype
    weight = _loss_weight(y, kw)
    _close(loss, ref, "loss", dtype, None if dtype == torch.float32 else weight, rtol_bf16=(3 * zmax + 2) * U_BF16)
    rtol = (2 * zmax + 3 + n_chunks) * U_BF16
    for name, t in (("hidden", xl), ("weight", wl), ("bias", bl)):
        if t is None:
            continue
        if name in frozen:
            assert t.grad is None, name
        else:
            assert t.grad is not None and t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
            _close(t.grad, grads[name], f"d{name}", dtype, scales[name], rtol)
    return loss


# -- the reductions, over dtypes, several chunks and ignored tokens --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(reduction, dtype, gen, chunks, device):
    """17 tokens in chunks of 5 (the last one 2); an ignored run from 3 to 6 spans the first boundary."""
    chunks(5)
    x, w, y, _ = _inputs(gen, device, n=(17,), dtype=dtype, ignored=(3, 4, 5, 6, 12))
    _check(x, w, y, reduction=reduction, n_chunks=4)


def test_strided_hidden_and_labels(gen, device):
    """A sliced hidden (B, T-1, H) and labels viewed with a stride: read as they are, grads shaped like them."""
    x, w, _, _ = _inputs(gen, device, n=(2, 6))
    y = torch.randint(0, 100, (2, 12), generator=gen).to(device)[:, ::2]
    y[0, 2] = -100
    _check(x[:, 1:], w, y[:, 1:], reduction="none")
    _check(x.transpose(0, 1), w, y.t())


def test_leading_dims_and_one_chunk(gen, device):
    x, w, y, _ = _inputs(gen, device, n=(2, 3, 4), ignored=(0, 7))
    loss = _check(x, w, y, reduction="none")
    assert loss.shape == (2, 3, 4) and loss.view(-1)[0] == 0 and loss.view(-1)[7] == 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("case", ["smoothing", "smoothing_1", "softcap", "bias", "all"])
def test_options_match_reference(case, reduction, gen, chunks, device):
    chunks(6)
    bias = case in ("bias", "all")
    x, w, y, b = _inputs(
        gen, device, n=(13,), bias=bias, ignored=(2, 6), wscale=3.0 if case in ("softcap", "all") else 1.0
    )
    kw = {
        "smoothing": dict(label_smoothing=0.25),
        "smoothing_1": dict(label_smoothing=1.0),
        "softcap": dict(softcap=2.0),
        "bias": {},
        "all": dict(label_smoothing=0.1, softcap=2.5, ignore_index=7),
    }[case]
    if case == "all":
        y[y == -100] = 7  # another ignore_index, which is also a class id
    _check(x, w, y, b, reduction=reduction, n_chunks=3, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_options_in_bfloat16_and_float32(dtype, gen, chunks, device):
    chunks(4)
    x, w, y, b = _inputs(gen, device, n=(11,), bias=True, ignored=(1,), dtype=dtype, wscale=3.0)
    _check(x, w, y, b, reduction="sum", label_smoothing=0.2, softcap=2.0, n_chunks=3)


@pytest.mark.parametrize("num_items", [23, "tensor"])
def test_num_items_in_batch(num_items, gen, chunks, device):
    """loss = sum / num_items_in_batch, as transformers' fixed_cross_entropy divides it."""
    chunks(5)
    x, w, y, _ = _inputs(gen, device, n=(12,), ignored=(0, 5))
    n = torch.tensor(23, device=device) if num_items == "tensor" else num_items
    loss = _check(x, w, y, num_items_in_batch=n, n_chunks=3)
    ref = linear_cross_entropy_ref(x, w, y, reduction="sum") / 23
    assert_close(loss, ref, "loss")


def test_reference_is_torch_and_transformers(gen, device):
    """The reference is torch's cross-entropy (mean over non-ignored, label smoothing) and transformers'
    fixed_cross_entropy for num_items_in_batch."""
    x, w, y, _ = _inputs(gen, device, n=(9,), ignored=(4,))
    logits = x.double() @ w.double().t()
    torch.testing.assert_close(
        linear_cross_entropy_ref(x, w, y, label_smoothing=0.3), F.cross_entropy(logits, y, label_smoothing=0.3)
    )
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    torch.testing.assert_close(
        linear_cross_entropy_ref(x, w, y, num_items_in_batch=torch.tensor(5)),
        loss_utils.fixed_cross_entropy(logits, y, torch.tensor(5)),
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(reduction="mean"),
        dict(reduction="sum"),
        dict(reduction="none"),
        dict(num_items_in_batch=4),
        dict(reduction="mean", label_smoothing=0.5),
    ],
)
def test_all_ignored_gives_zero_loss_and_zero_grads(kw, gen, chunks, device):
    """torch (and transformers' ForCausalLMLoss) give NaN for an all-ignored mean; we give 0 and zero grads."""
    chunks(3)
    x, w, y, b = _inputs(gen, device, n=(7,), bias=True, ignored=range(7))
    xl, wl, bl = leaf(x), leaf(w), leaf(b)
    with poisoned_allocations():
        loss = linear_cross_entropy(xl, wl, y, bias=bl, **kw)
        loss.backward(torch.ones_like(loss))
    assert torch.equal(loss, torch.zeros_like(loss))
    for t in (xl, wl, bl):
        assert torch.equal(t.grad, torch.zeros_like(t)), t.shape


def test_empty_batch(device):
    x = torch.randn(0, 8, device=device, requires_grad=True)
    w = torch.randn(10, 8, device=device, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=device))
    loss.backward()
    assert loss.item() == 0 and x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))


def test_label_out_of_range_gives_nan_not_a_fault(gen, device):
    x, w, y, _ = _inputs(gen, device, n=(4,))
    y[1], y[2] = 100, -3
    loss = linear_cross_entropy(x, w, y, reduction="none")
    assert loss[1].isnan() and loss[2].isnan() and loss[[0, 3]].isfinite().all()


# -- gradients only where asked for ----------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("frozen", [("weight",), ("hidden",), ("bias",), ("hidden", "bias")])
def test_gradients_only_for_inputs_that_require_them(frozen, reduction, gen, chunks, device, monkeypatch):
    chunks(4)
    calls = _spy_chunks(monkeypatch)
    x, w, y, b = _inputs(gen, device, n=(9,), bias=True, ignored=(3,))
    _check(x, w, y, b, frozen=frozen, reduction=reduction, n_chunks=3)
    grads = calls[-1]  # the forward's chunks ("mean") or the backward's ("none")
    assert grads == {"dh": "hidden" not in frozen, "need_dw": "weight" not in frozen, "need_db": "bias" not in frozen}


def _spy_chunks(monkeypatch):
    calls = []
    orig = lce.linear_cross_entropy_chunks

    def spy(*args, **kwargs):
        calls.append(
            {
                "dh": kwargs.get("dh") is not None,
                "need_dw": kwargs.get("need_dw", False),
                "need_db": kwargs.get("need_db", False),
            }
        )
        return orig(*args, **kwargs)

    monkeypatch.setattr(lce, "linear_cross_entropy_chunks", spy)
    return calls


@pytest.mark.parametrize("mode", ["no_grad", "nothing_requires_grad"])
def test_no_gradient_work_without_grad(mode, gen, device, monkeypatch):
    calls = _spy_chunks(monkeypatch)
    launches = []
    orig_launch = lce.launch

    def launch(kernel, grid, **kwargs):
        launches.append(kwargs["WRITE_GRAD"])
        return orig_launch(kernel, grid, **kwargs)

    monkeypatch.setattr(lce, "launch", launch)
    x, w, y, b = _inputs(gen, device, n=(6,), bias=True)
    if mode == "no_grad":
        x, w, b = leaf(x), leaf(w), leaf(b)
        with torch.no_grad():
            loss = linear_cross_entropy(x, w, y, bias=b)
    else:
        loss = linear_cross_entropy(x, w, y, bias=b)
    assert loss.grad_fn is None and not loss.requires_grad
    assert calls == [{"dh": False, "need_dw": False, "need_db": False}] and launches and not any(launches)
    assert_close(loss, linear_cross_entropy_ref(x.detach(), w.detach(), y, bias=b.detach()), "loss")


def test_gradient_buffers_become_grad_without_a_copy(gen, device, monkeypatch):
    """d hidden and d weight are the forward's buffers (scaled in place), adopted as .grad: no (V, H) copy."""
    buffers = []
    orig = lce.linear_cross_entropy_chunks

    def spy(*args, **kwargs):
        dw, db = orig(*args, **kwargs)
        buffers.extend([kwargs["dh"].data_ptr(), dw.data_ptr()])
        return dw, db

    monkeypatch.setattr(lce, "linear_cross_entropy_chunks", spy)
    x, w, y, _ = _inputs(gen, device, n=(5,))
    xl, wl = leaf(x), leaf(w)
    linear_cross_entropy(xl, wl, y).backward(torch.tensor(0.5, device=device))
    assert buffers == [xl.grad.data_ptr(), wl.grad.data_ptr()]


def test_backward_with_grad_output_one_and_a_second_backward(gen, device):
    """grad_output 1 skips the scaling (so the graph can be walked twice); another grad_output scales the saved
    gradients in place, and a second backward then fails loudly instead of scaling them twice."""
    x, w, y, _ = _inputs(gen, device, n=(5,))
    xl, wl = leaf(x), leaf(w)
    loss = linear_cross_entropy(xl, wl, y)
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    x64, w64 = leaf(x.double()), leaf(w.double())
    (2 * linear_cross_entropy_ref(x64, w64, y)).backward()
    assert_close(xl.grad, x64.grad, "dhidden")
    assert_close(wl.grad, w64.grad, "dweight")
    loss.backward(torch.tensor(3.0, device=device), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(torch.tensor(3.0, device=device))


def test_autocast_computes_in_its_dtype(gen, device):
    """Under autocast, float32 hidden and weight go through the op in the autocast dtype (as F.linear would)."""
    x, w, y, _ = _inputs(gen, device, n=(6,))
    xl, wl = leaf(x), leaf(w)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(xl, wl, y)
    loss.backward()
    assert_close(loss, linear_cross_entropy(x.bfloat16(), w.bfloat16(), y).double(), "loss")
    assert xl.grad.dtype == torch.float32 and wl.grad.dtype == torch.float32


# -- launch parameters, chunking --------------------------------------------------------------------------------


@pytest.fixture
def small_blocks(registry):
    """A backend spec forcing BLOCK_V=32: V=100 takes four blocks, the last with 4 logits."""
    calls = []

    def kernel_config(kernel, **problem):
        calls.append((kernel, problem))
        return {"BLOCK_V": 32, "num_warps": 2} if kernel == "linear_cross_entropy" else None

    tritonspec.register_spec("test-lce-blocks", make_spec("tritonspec_test_lce_blocks", kernel_config=kernel_config))
    with tritonspec.use_backend("test-lce-blocks"):
        yield calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ragged_vocabulary_blocks_via_backend_spec(small_blocks, reduction, dtype, gen, chunks, device):
    chunks(4)
    x, w, y, b = _inputs(gen, device, n=(7,), v=100, bias=True, ignored=(2,), dtype=dtype, wscale=3.0)
    _check(x, w, y, b, reduction=reduction, label_smoothing=0.3, softcap=2.0, n_chunks=2)
    assert small_blocks and small_blocks[0][0] == "linear_cross_entropy" and small_blocks[0][1]["V"] == 100


def test_chunk_rule():
    """At most CHUNK (512) tokens, evened out over the chunks it takes; one chunk when the batch is smaller."""
    assert chunk_tokens(8192) == 512
    assert chunk_tokens(8000) == 500  # 16 chunks of 500, not 15 of 512 and one of 320
    assert chunk_tokens(513) == 257
    assert chunk_tokens(300) == 300
    assert chunk_tokens(1) == 1


# -- torch.library and torch.compile ---------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_library_op_path_in_eager(reduction, gen, chunks, monkeypatch, device):
    """The registered ops (what torch.compile calls) and their autograd, without compiling."""
    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    chunks(5)
    x, w, y, b = _inputs(gen, device, n=(11,), bias=True, ignored=(4, 5))
    _check(x, w, y, b, reduction=reduction, label_smoothing=0.1, n_chunks=3)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph(reduction, gen, device):
    """One graph with the op in it (aot_eager: Inductor's C++ build of the backward's scaling would cost the
    CPU suite ~10 s and tests nothing of ours)."""
    x, w, y, b = _inputs(gen, device, n=(2, 4), bias=True, ignored=(1,))

    def f(x, w, y, b):
        return 2 * linear_cross_entropy(x, w, y, bias=b, reduction=reduction, softcap=3.0).sum()

    xl, wl, bl = leaf(x), leaf(w), leaf(b)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(xl, wl, y, bl)
    out.backward()
    x64, w64, b64 = leaf(x.double()), leaf(w.double()), leaf(b.double())
    ref = 2 * linear_cross_entropy_ref(x64, w64, y, bias=b64, reduction=reduction, softcap=3.0).sum()
    ref.backward()
    assert_close(out, ref, "loss")
    for name, a, r in [("dhidden", xl, x64), ("dweight", wl, w64), ("dbias", bl, b64)]:
        assert_close(a.grad, r.grad, name)


def test_opcheck(gen, device):
    x, w, y, b = _inputs(gen, device, n=(5,), bias=True, ignored=(2,))
    need = (True, True, True)
    torch.library.opcheck(
        LINEAR_CROSS_ENTROPY.forward_op, (leaf(x), leaf(w), y, leaf(b), None, -100, 0.1, 2.0, "mean", *need)
    )
    torch.library.opcheck(
        LINEAR_CROSS_ENTROPY.forward_op,
        (x, leaf(w), y, None, torch.tensor(3.0, device=device), -100, 0.0, 0.0, "mean", False, True, False),
    )
    torch.library.opcheck(LINEAR_CROSS_ENTROPY_NONE.forward_op, (leaf(x), leaf(w), y, leaf(b), -100, 0.0, 0.0, *need))


# -- argument errors ----------------------------------------------------------------------------------------------


def _call(d, x=(3, 8), w=(10, 8), y=None, **kw):
    x = torch.randn(*x, device=d) if isinstance(x, tuple) else x
    w = torch.randn(*w, device=d) if isinstance(w, tuple) else w
    y = torch.zeros(x.shape[:-1], dtype=torch.long, device=d) if y is None else y
    return linear_cross_entropy(x, w, y, **kw)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: _call(d, x=[1.0], y=torch.zeros((), dtype=torch.long)), "'hidden' must be a torch.Tensor"),
        (lambda d: _call(d, x=torch.randn(3, 8, device=d).double()), "'hidden' has dtype torch.float64"),
        (lambda d: _call(d, w=(10, 8, 1)), "'weight' must have 2 dim"),
        (lambda d: _call(d, w=(10, 7)), "'weight' has shape \\(10, 7\\) but the hidden size"),
        (lambda d: _call(d, w=(0, 8)), "'weight' has no rows"),
        (lambda d: _call(d, x=(3, 0), w=(10, 0)), "'hidden' has an empty last"),
        (
            lambda d: _call(d, w=torch.randn(10, 8, device=d).bfloat16()),
            "'weight' has dtype torch.bfloat16 but 'hidden'",
        ),
        (lambda d: _call(d, w=torch.randn(10, 8, device="meta")), "'weight' is on meta"),
        (lambda d: _call(d, bias=torch.randn(9, device=d)), "'bias' has shape \\(9,\\)"),
        (lambda d: _call(d, bias=torch.randn(10, device=d).half()), "'bias' has dtype torch.float16"),
        (lambda d: _call(d, y=torch.zeros(3, dtype=torch.int32, device=d)), "'labels' has dtype torch.int32"),
        (lambda d: _call(d, y=torch.zeros(4, dtype=torch.long, device=d)), "'labels' has shape \\(4,\\)"),
        (lambda d: _call(d, y=[0, 1, 2]), "'labels' must be a torch.Tensor"),
        (lambda d: _call(d, reduction="avg"), "'reduction' must be one of 'mean', 'sum', 'none'"),
        (lambda d: _call(d, label_smoothing=1.5), "'label_smoothing' must be in \\[0, 1\\]"),
        (lambda d: _call(d, label_smoothing=-0.1), "'label_smoothing' must be in \\[0, 1\\]"),
        (lambda d: _call(d, label_smoothing="0.1"), "'label_smoothing' must be a float"),
        (lambda d: _call(d, softcap=0.0), "'softcap' must be a finite number > 0"),
        (lambda d: _call(d, softcap=-30.0), "'softcap' must be a finite number > 0"),
        (lambda d: _call(d, ignore_index=-100.0), "'ignore_index' must be an int"),
        (lambda d: _call(d, ignore_index=True), "'ignore_index' must be an int"),
        (lambda d: _call(d, ignore_index=2**70), "'ignore_index' must fit in int64"),
        (lambda d: _call(d, ignore_index=-(2**63) - 1), "'ignore_index' must fit in int64"),
        (lambda d: _call(d, num_items_in_batch=0), "'num_items_in_batch' must be > 0"),
        (lambda d: _call(d, num_items_in_batch=2.5), "'num_items_in_batch' must be an int or a tensor"),
        (lambda d: _call(d, num_items_in_batch=torch.ones(2, device=d)), "'num_items_in_batch' must be a one-element"),
        (lambda d: _call(d, num_items_in_batch=3, reduction="sum"), "'num_items_in_batch' .* needs reduction='mean'"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        call(device)
