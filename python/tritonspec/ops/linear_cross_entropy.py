"""Fused LM head + cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` without the (tokens, vocab) logits.

``linear_cross_entropy(hidden, weight, labels)`` equals ``F.cross_entropy(hidden @ weight.T, labels)`` with
the options Hugging Face causal-LM losses use: ``ignore_index``, label smoothing as torch defines it, Gemma's
logit softcap (``softcap * tanh(logits / softcap)``) and transformers' ``num_items_in_batch``. Labels are
aligned with ``hidden`` (``hidden[i]`` predicts ``labels[i]``): the caller shifts.

The tokens go in chunks. Per chunk the logits come from a torch matmul (cuBLAS on GPU) in the input dtype,
rounded as ``lm_head`` rounds them; a Triton kernel (one program per token) reads each row twice in float32,
stores the token's loss and overwrites the row with d loss / d logits (softmax - target distribution, times
softcap's chain rule and the reduction's factor); then ``d hidden = G @ weight`` lands in its rows of one
preallocated buffer, ``d weight += G.T @ hidden`` (addmm, beta=1) and ``d bias += G.sum(0)``.

* ``reduction="mean"`` / ``"sum"``: the loss is a scalar, so the gradients are computed in the forward (as
  Liger-Kernel does) and the backward only scales them by grad_output, in place, and only when it is not 1
  (one host synchronization, as Liger's). A second backward through the same graph after such a scaling
  fails with autograd's "modified by an inplace operation" error instead of returning scaled-twice grads.
* ``reduction="none"``: grad_output is a per-token vector that must weight each gradient row *before* the
  sums over tokens, so the forward computes the losses only and the backward runs the chunks again (one
  more logits GEMM), each token's grad_output folded into its row.

Gradients are computed only for inputs that require grad, and none at all under ``torch.no_grad`` or when
nothing requires grad. Layers: ``_cross_entropy_rows_kernel`` (jit) -> ``linear_cross_entropy_chunks`` (the
chunk loop) -> the ``LINEAR_CROSS_ENTROPY`` / ``LINEAR_CROSS_ENTROPY_NONE`` ops -> ``linear_cross_entropy``.

Why ``Op(..., opaque=True)`` (``torch.library.custom_op``, not ``triton_op``): the body is a Python loop of
cuBLAS calls writing into slices of buffers it reuses, around a kernel that rewrites its input in place;
traced into the graph, every one of those writes would have to be functionalized, the loop unrolled per token
count. Opaque, torch.compile keeps one node with its fake (shapes only) and no graph break. Under
torch.compile the backward's scaling is out of place (a custom op may not return its inputs), so there the
gradients briefly exist twice.

Memory (``chunk_tokens``). Beyond the inputs the op holds d weight (V*H in the weight's dtype: an fp32
accumulator would add 1 GiB at V=128256, H=4096), d hidden (N*H) and one chunk's logits. Liger-Kernel 0.8.5
holds the same, with chunks of next_pow2(N / ceil(V / H)) tokens (256 at N=8192, H=4096; 64 at H=2048 and
Qwen3's vocabulary), so its d weight addmm, whose K is the chunk, re-reads and re-writes all of d weight for
every 64-256 tokens: memory-bound. Ours takes 512 tokens, where that addmm reaches the H100's ridge. At N=8192,
H=4096, V=128256 that holds 1191 MiB against Liger's 1129 (+5.5%, the larger chunk's logits) and runs 0.74x
Liger's time (bench/RESULTS.md). cuBLAS sums each chunk's products in fp32 and rounds d weight once per chunk.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..kernel_table import LinearCrossEntropy
from ..launch import launch_config
from ._checks import check_not_dtensor, check_same_device, check_same_dtype, check_tensor
from ._library import Op, cdiv, launch, next_pow2

_OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")

# Tokens per chunk: the d weight addmm has K = the chunk and reads and writes the whole (V, H) d weight per
# chunk, so its intensity is ~K/2 FLOP per byte against the H100's ridge of ~300 (989 TFLOP/s over 3.35 TB/s):
# 512 tokens reach it; more only cost logits memory.
CHUNK = 512


def chunk_tokens(n: int) -> int:
    """Tokens per chunk for ``n`` tokens (n >= 1): at most ``CHUNK``, evened out over the chunks it takes, so
    the last one is not a sliver."""
    return cdiv(n, cdiv(n, CHUNK))


# ----------------------------------------------------------------------------------------------
# float64 reference (shared by tests and benchmarks)
# ----------------------------------------------------------------------------------------------
def linear_cross_entropy_ref(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    softcap=None,
    num_items_in_batch=None,
) -> torch.Tensor:
    """``linear_cross_entropy`` in float64 with the logits materialized, differentiable: the definition of correct.

    torch's own cross-entropy per token; "mean" divides the sum by the non-ignored count (1 when there is
    none, so an all-ignored batch gives 0 where torch gives NaN) or by ``num_items_in_batch``.
    """
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per_token = F.cross_entropy(
        logits.reshape(-1, weight.shape[0]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / (num_items_in_batch.double() if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return total / (labels != ignore_index).sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    """tanh in float32 from exp2 (no libdevice, so every backend and the interpreter run it): a series below
    |x| = 1/8, where (1 - e) / (1 + e) would cancel; relative error about 3e-7 everywhere."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    x2 = x * x
    series = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, series, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _cross_entropy_rows_kernel(
    # Pointers
    logits_ptr,  # (rows, V): read, then overwritten with the gradient rows when WRITE_GRAD
    labels_ptr,  # (rows,) int64
    loss_ptr,  # (rows,) float32, written when WRITE_LOSS
    scale_ptr,  # float32 gradient factors: one for every row (stride_scale 0) or one per row (1)
    # Sizes
    V,
    # Strides
    stride_logits,
    stride_scale,
    # Scalars
    ignore_index,
    smoothing,
    softcap,  # read only when HAS_SOFTCAP
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
):
    """One token per program: its loss (unscaled, float32); with WRITE_GRAD its logits row becomes
    scale[row * stride_scale] * d loss / d logits. A label outside [0, V) other than ignore_index gives NaN
    (a loss and a gradient row), never an out-of-bounds read."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_logits
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(labels_ptr + row)
    if y == ignore_index:
        if WRITE_LOSS:
            tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            zero = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
            for v0 in range(0, V, BLOCK_V):
                c = v0 + cols
                tl.store(base + c, zero, mask=c < V)
        return
    bad = (y < 0) | (y >= V)
    y = tl.where(bad, 0, y)
    # Pass 1: online max and sum of exp (one exp per logit), and the logits' sum for label smoothing.
    m = -float("inf")
    d = 0.0
    z_sum = 0.0
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        mask = c < V
        z = tl.load(base + c, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_SOFTCAP:
            z = tl.where(mask, softcap * _tanh(z / softcap), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2((z - m_new) * LOG2E), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(d)
    z_y = tl.load(base + y).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * _tanh(z_y / softcap)
    # torch's label smoothing: (1 - eps) * (lse - z_y) + eps * mean_j(lse - z_j)
    loss = lse - z_y
    if HAS_SMOOTHING:
        loss = lse - (1.0 - smoothing) * z_y - smoothing * (z_sum / V)
    if WRITE_LOSS:
        tl.store(loss_ptr + row, tl.where(bad, float("nan"), loss))
    if WRITE_GRAD:
        # Pass 2: g_j = scale * (softmax_j - eps / V - (1 - eps) [j == y]) (* d softcap(z_j) / d z_j), formed
        # in float32 and rounded once, so softmax_y - 1 keeps its bits as softmax_y nears 1.
        scale = tl.load(scale_ptr + row * stride_scale)
        off_target = smoothing / V
        on_target = 1.0 - smoothing
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = c < V
            z = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(z / softcap)
                z = softcap * t
            g = tl.exp2((z - lse) * LOG2E) - off_target - tl.where(c == y, on_target, 0.0)
            if HAS_SOFTCAP:
                g = g * ((1.0 - t) * (1.0 + t))
            g = tl.where(bad, float("nan"), g * scale)
            tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=mask)


def _default(v: int) -> LinearCrossEntropy:
    # 8K logits a step over 16 warps: 16 float32 values per thread per live array, a 128K-vocab row in 16
    # steps a pass, and 4 programs (a 512-token chunk) per SM resident at once. Not yet tuned on a GPU
    # (Liger runs 32K-element blocks over 32 warps).
    block = min(next_pow2(v), 8192)
    return LinearCrossEntropy(BLOCK_V=block, num_warps=min(16, max(4, block // 512)))


# ----------------------------------------------------------------------------------------------
# the chunk loop
# ----------------------------------------------------------------------------------------------
def linear_cross_entropy_chunks(
    hidden,
    weight,
    labels,
    bias,
    scale,
    *,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    loss_rows=None,
    dh=None,
    need_dw: bool = False,
    need_db: bool = False,
):
    """The chunks over ``hidden`` (N, H) with ``labels`` (N,) contiguous int64; returns ``(dweight, dbias)``
    (None where not asked for).

    ``loss_rows`` (N,) float32 and ``dh`` (N, H), when given, are filled: each token's unscaled loss and
    d loss / d hidden. ``scale`` is float32, (1,) (one factor for every gradient row) or (N,) (one per row).
    ``softcap`` 0 means none. Nothing of the gradient is computed when no gradient is asked for.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    device = hidden.device
    grads = dh is not None or need_dw or need_db
    dw = torch.empty((v, h), dtype=weight.dtype, device=device) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=device) if need_db else None
    if n == 0:
        if dw is not None:
            dw.zero_()
        return dw, None if db is None else db.to(bias.dtype)
    c = chunk_tokens(n)
    cfg = launch_config(LinearCrossEntropy, device, lambda: _default(v), V=v, dtype=str(hidden.dtype))
    buf = torch.empty((c, v), dtype=hidden.dtype, device=device)
    per_row = scale.numel() != 1
    wt = weight.t()
    # the kernel's meta-parameters and launch options, the same for every chunk
    meta = dict(
        BLOCK_V=cfg.BLOCK_V,
        HAS_SOFTCAP=softcap > 0,
        HAS_SMOOTHING=label_smoothing > 0,
        WRITE_LOSS=loss_rows is not None,
        WRITE_GRAD=grads,
        **cfg.options,
    )
    for s in range(0, n, c):
        e = min(s + c, n)
        x = hidden[s:e]
        logits = buf[: e - s]
        if bias is None:
            torch.mm(x, wt, out=logits)
        else:
            torch.addmm(bias, x, wt, out=logits)
        # Without loss_rows, scale stands in for loss_ptr, which the kernel then never writes.
        launch(
            _cross_entropy_rows_kernel,
            (e - s,),
            logits_ptr=logits,
            labels_ptr=labels[s:e],
            loss_ptr=scale if loss_rows is None else loss_rows[s:e],
            scale_ptr=scale[s:e] if per_row else scale,
            V=v,
            stride_logits=v,
            stride_scale=int(per_row),
            ignore_index=ignore_index,
            smoothing=label_smoothing,
            softcap=softcap or 1.0,
            **meta,
        )
        if need_dw:
            if s == 0:
                torch.mm(logits.t(), x, out=dw)
            else:
                dw.addmm_(logits.t(), x)
        if need_db:
            db += logits.sum(0, dtype=torch.float32)
        if dh is not None:
            torch.mm(logits, weight, out=dh[s:e])
    return dw, None if db is None else db.to(bias.dtype)


# ----------------------------------------------------------------------------------------------
# ops
# ----------------------------------------------------------------------------------------------
def _grad_like(t: torch.Tensor, need: bool) -> torch.Tensor:
    """A gradient buffer shaped like ``t``, or an empty placeholder (op outputs are tensors, never None)."""
    return torch.empty(t.shape if need else 0, dtype=t.dtype, device=t.device)


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    num_items: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    reduction: str,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    *,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, dhidden, dweight, dbias)`` for "mean" / "sum": the gradients of the loss, placeholders where
    not needed. ``num_items`` (float32, 0-dim) replaces the mean's count of non-ignored tokens."""
    x = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).contiguous()
    if reduction == "mean":
        denom = num_items if num_items is not None else (y != ignore_index).sum().clamp(min=1).float()
        scale = denom.reciprocal().reshape(1)
    else:
        denom, scale = None, torch.ones(1, dtype=torch.float32, device=hidden.device)
    loss_rows = torch.empty(y.shape, dtype=torch.float32, device=hidden.device)
    dh = _grad_like(hidden, need_dh)
    dw, db = linear_cross_entropy_chunks(
        x,
        weight,
        y,
        bias,
        scale,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=softcap,
        loss_rows=loss_rows,
        dh=dh.view(x.shape) if need_dh else None,
        need_dw=need_dw,
        need_db=need_db and bias is not None,
    )
    loss = loss_rows.sum()
    if denom is not None:
        loss = loss / denom
    return (
        loss,
        dh,
        weight.new_empty(0) if dw is None else dw,
        (bias if bias is not None else weight).new_empty(0) if db is None else db,
    )


def _fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    num_items: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    reduction: str,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        hidden.new_empty((), dtype=torch.float32),
        _grad_like(hidden, need_dh),
        _grad_like(weight, need_dw),
        _grad_like(bias if bias is not None else weight, need_db and bias is not None),
    )


def _save(inputs: tuple, outputs: tuple) -> tuple:
    """The gradients the forward computed: the backward only scales them."""
    return outputs[1:]


def _backward(
    dloss: torch.Tensor,
    dhidden: torch.Tensor,
    dweight: torch.Tensor,
    dbias: torch.Tensor,
    *,
    in_place: bool,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's gradients times grad_output: in place in eager (our own buffers; skipped when it is 1),
    out of place when traced (a custom op returns fresh tensors)."""
    if dloss is None:
        return None, None, None
    gradients = (dhidden, dweight, dbias)
    if traced:
        return tuple(g * dloss for g in gradients)
    if bool(dloss != 1):  # one host synchronization, as in Liger
        for g in gradients:
            g.mul_(dloss)
    return gradients


def _backward_fake(
    dloss: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, dbias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return dhidden.new_empty(dhidden.shape), dweight.new_empty(dweight.shape), dbias.new_empty(dbias.shape)


LINEAR_CROSS_ENTROPY = Op(
    "linear_cross_entropy",
    forward=_forward,
    fake=_fake,
    save=_save,
    backward=_backward,
    backward_fake=_backward_fake,
    grads=(0, 1, None, 2) + (None,) * 8,
    opaque=True,
)


def _none_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    *,
    traced: bool,
) -> torch.Tensor:
    """Per-token losses shaped like ``labels``; no gradient work (the backward recomputes)."""
    y = labels.reshape(-1).contiguous()
    loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
    scale = torch.ones(1, dtype=torch.float32, device=hidden.device)  # unused: no gradient is written
    linear_cross_entropy_chunks(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        y,
        bias,
        scale,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=softcap,
        loss_rows=loss.view(-1),
    )
    return loss


def _none_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> torch.Tensor:
    return hidden.new_empty(labels.shape, dtype=torch.float32)


def _none_save(inputs: tuple, outputs: tuple) -> tuple:
    """The tensor inputs (hidden, weight, labels, bias): the backward runs the chunks again."""
    return inputs[:4]


def _none_backward(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
    *,
    in_place: bool,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunks again, each token's gradient row weighted by its grad_output before the sums over tokens."""
    if dloss is None:
        return None, None, None
    x = hidden.reshape(-1, hidden.shape[-1])
    dh = _grad_like(hidden, need_dh)
    dw, db = linear_cross_entropy_chunks(
        x,
        weight,
        labels.reshape(-1).contiguous(),
        bias,
        dloss.reshape(-1).to(torch.float32).contiguous(),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=softcap,
        dh=dh.view(x.shape) if need_dh else None,
        need_dw=need_dw,
        need_db=need_db and bias is not None,
    )
    return (
        dh,
        weight.new_empty(0) if dw is None else dw,
        (bias if bias is not None else weight).new_empty(0) if db is None else db,
    )


def _none_backward_fake(
    dloss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        _grad_like(hidden, need_dh),
        _grad_like(weight, need_dw),
        _grad_like(bias if bias is not None else weight, need_db and bias is not None),
    )


LINEAR_CROSS_ENTROPY_NONE = Op(
    "linear_cross_entropy_none",
    forward=_none_forward,
    fake=_none_fake,
    save=_none_save,
    statics=(4, 5, 6, 7, 8, 9),
    backward=_none_backward,
    backward_fake=_none_backward_fake,
    grads=(0, 1, None, 2) + (None,) * 6,
    opaque=True,
)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, num_items_in_batch):
    """Every error names the argument; only shapes, dtypes and Python values are read (nothing synchronizes)."""
    op = _OP
    check_tensor(op, "hidden", hidden)
    check_tensor(op, "weight", weight, ndim=2)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1)
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{op}: argument 'labels' must be a torch.Tensor, got {type(labels).__name__}")
    check_not_dtensor(op, "labels", labels)
    if labels.dtype != torch.int64:
        raise TypeError(f"{op}: argument 'labels' has dtype {labels.dtype}; expected torch.int64")
    check_same_device(op, hidden=hidden, weight=weight, labels=labels, **({} if bias is None else {"bias": bias}))
    h, v = hidden.shape[-1], weight.shape[0]
    if h == 0:
        raise ValueError(f"{op}: argument 'hidden' has an empty last (hidden) dimension, shape {tuple(hidden.shape)}")
    if weight.shape[1] != h:
        raise ValueError(
            f"{op}: argument 'weight' has shape {tuple(weight.shape)} but the hidden size (hidden.shape[-1]) is {h}"
        )
    if v == 0:
        raise ValueError(f"{op}: argument 'weight' has no rows (an empty vocabulary), shape {tuple(weight.shape)}")
    if bias is not None and bias.shape[0] != v:
        raise ValueError(
            f"{op}: argument 'bias' has shape {tuple(bias.shape)} but the vocabulary (weight.shape[0]) is {v}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{op}: argument 'labels' has shape {tuple(labels.shape)} but hidden's leading dims are "
            f"{tuple(hidden.shape[:-1])} (one label per token)"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: argument 'ignore_index' must be an int, got {type(ignore_index).__name__}")
    if not -(2**63) <= ignore_index < 2**63:  # compared with int64 labels, in the kernel and in torch alike
        raise ValueError(f"{op}: argument 'ignore_index' must fit in int64 (labels' dtype), got {ignore_index}")
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{op}: argument 'reduction' must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}"
        )
    if not _is_number(label_smoothing):
        raise TypeError(f"{op}: argument 'label_smoothing' must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: argument 'label_smoothing' must be in [0, 1], got {label_smoothing}")
    if softcap is not None:
        if not _is_number(softcap):
            raise TypeError(f"{op}: argument 'softcap' must be a float or None, got {type(softcap).__name__}")
        if not 0.0 < softcap < float("inf"):
            raise ValueError(f"{op}: argument 'softcap' must be a finite number > 0 (or None), got {softcap}")
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError(
                f"{op}: argument 'num_items_in_batch' divides the summed loss in place of the mean's "
                f"token count, so it needs reduction='mean', got reduction={reduction!r}"
            )
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1 or num_items_in_batch.dtype in (
                torch.bool,
                torch.complex64,
                torch.complex128,
            ):
                raise ValueError(
                    f"{op}: argument 'num_items_in_batch' must be a one-element real tensor (or an "
                    f"int), got shape {tuple(num_items_in_batch.shape)}, dtype {num_items_in_batch.dtype}"
                )
        elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, int):
            raise TypeError(
                f"{op}: argument 'num_items_in_batch' must be an int or a tensor, got "
                f"{type(num_items_in_batch).__name__}"
            )
        elif num_items_in_batch <= 0:
            raise ValueError(f"{op}: argument 'num_items_in_batch' must be > 0, got {num_items_in_batch}")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch=None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, never materializing the logits.

    Args:
        hidden: (..., H) float16/bfloat16/float32; any leading dims, flattened to N tokens.
        weight: (V, H), hidden's dtype (under autocast both are cast to its dtype, as ``F.linear`` would be).
        labels: (...) int64, hidden's leading dims, aligned with it (hidden[i] predicts labels[i]). A label
            outside [0, V) other than ``ignore_index`` gives NaN (torch raises there; checking would synchronize).
        bias: (V,) or None.
        ignore_index: tokens with this label add 0 to the loss and get zero gradients.
        reduction: "mean" (over non-ignored tokens; an all-ignored batch gives 0 and zero gradients, where
            torch and transformers' ``ForCausalLMLoss`` give NaN), "sum", or "none" (per token, shaped like labels).
        label_smoothing: in [0, 1], as ``F.cross_entropy`` defines it.
        softcap: logits become ``softcap * tanh(logits / softcap)`` (Gemma 2) when given (> 0).
        num_items_in_batch: an int > 0 or a one-element tensor (its value is not checked: that would
            synchronize); the loss is then ``sum / num_items_in_batch`` (transformers' gradient-accumulation
            semantics, ``fixed_cross_entropy``). Only with reduction="mean".
    Returns: the loss in float32: a scalar, or per token for reduction="none".

    Example (shift the labels, not hidden: a sliced hidden is copied to flatten it)::

        labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:]  # as transformers' ForCausalLMLoss shifts
        loss = linear_cross_entropy(hidden_states, lm_head.weight, labels)
    """
    _check(hidden, weight, labels, bias, ignore_index, reduction, label_smoothing, softcap, num_items_in_batch)
    device_type = hidden.device.type
    # what lm_head's F.linear would compute in (a device type without autocast, e.g. meta, has none)
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    check_same_dtype(_OP, hidden=hidden, weight=weight, **({} if bias is None else {"bias": bias}))
    grad = torch.is_grad_enabled()
    need = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    label_smoothing, softcap = float(label_smoothing), 0.0 if softcap is None else float(softcap)
    if reduction == "none":
        return LINEAR_CROSS_ENTROPY_NONE(hidden, weight, labels, bias, ignore_index, label_smoothing, softcap, *need)
    num_items = None
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items = num_items_in_batch.detach().reshape(()).to(device=hidden.device, dtype=torch.float32)
        else:
            num_items = torch.full((), float(num_items_in_batch), dtype=torch.float32, device=hidden.device)
    return LINEAR_CROSS_ENTROPY(
        hidden, weight, labels, bias, num_items, ignore_index, label_smoothing, softcap, reduction, *need
    )
