"""The experts' two GEMMs for decode-sized batches: no sort, each chosen expert's weights read once.

At a few tokens the experts' cost is reading the chosen experts' weights, and the sort of the sorted path
(:mod:`tritonspec.ops.moe`: three launches before the first GEMM, and blocks of padding rows after it) is
launch latency on the critical path. Here, for at most :data:`MAX_TOKENS` tokens, each GEMM is one launch
of ``_moe_decode_kernel``, a program per (pair, column block):

* a pair's program works only if its expert appears in no earlier pair (later pairs of the same expert
  exit at once), so each chosen expert's weights are read once, whatever the number of tokens sharing it;
* it gathers every token that chose the expert (a 16-row tile masked by the ids, no sort) and writes the
  rows of those pairs (pair order, ``T*k`` rows): ``act(gate, up)`` for the up GEMM, the expert's output
  for the down GEMM;
* the GEMM is swapped (``W_e @ x^T``): the weight's columns fill the MMA's M side, the tokens its narrow N.

The sorted path's gather-reduce then sums each token's ``k`` rows in a fixed order (no atomics). Forward
only (inference): training keeps the sorted path, whose saved pre-activations the backward reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_table import MoEDecode
from ..launch import launch_config
from ._library import PlanCache, cdiv, launch, next_pow2

__all__ = ["MAX_TOKENS", "decode_rows"]

MAX_TOKENS = 16  # the token tile: one MMA's narrow side


@triton.jit
def _moe_decode_kernel(
    # Pointers to matrices
    A,  # (T, K) tokens (GATED), or (T * k, K) each pair's row
    IDS,  # (T * k,) each pair's expert
    W,  # (E, K, N) by strides, or (GATED) (E, K, 2N): each expert's gate and up columns
    BIAS,  # (E, N) or (E, 2N) by strides, read when HAS_BIAS
    OUT,  # (T * k, N) out: the rows of each pair whose expert is in [0, E)
    # Matrix dimensions
    T,
    N,
    K,
    E,
    TOP_K,
    # Strides
    stride_a,
    stride_w_e,
    stride_w_k,
    stride_w_n,
    stride_bias_e,
    stride_bias_n,
    # Scalars
    clamp,  # gpt_oss's clamp
    # Meta-parameters
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_N columns of the rows of every token that chose pair ``p``'s expert, once per expert.

    GATED: ``act(x @ gate_e, x @ up_e)`` from the tokens' rows (W's gate columns [0, N) and up [N, 2N), or
    INTERLEAVED alternate columns); else ``h @ W_e`` from the pairs' rows. Rounded as a Hugging Face expert
    rounds (each projection's output, the activation).
    """
    p = tl.program_id(0)
    e = tl.load(IDS + p)
    earlier = tl.arange(0, BLOCK_P)
    before = tl.load(IDS + earlier, mask=earlier < p, other=-1)
    if (e < 0) | (e >= E) | (tl.sum((before == e).to(tl.int32), axis=0) > 0):
        return
    # the tokens that chose e, and in which of their k slots
    tokens = tl.arange(0, BLOCK_T)
    js = tl.arange(0, BLOCK_J)
    hit = (
        tl.load(
            IDS + tokens[:, None] * TOP_K + js[None, :],
            mask=(tokens < T)[:, None] & (js < TOP_K)[None, :],
            other=-1,
        )
        == e
    )
    chose = tl.max(hit.to(tl.int32), axis=1) > 0
    pairs = tokens * TOP_K + tl.sum(tl.where(hit, js[None, :], 0), axis=1)  # an expert at most once per token
    a_cols = A + (tokens if GATED else pairs).to(tl.int64)[None, :] * stride_a  # A^T: (K, tokens)
    w_e = W + e.to(tl.int64) * stride_w_e
    b_e = BIAS + e.to(tl.int64) * stride_bias_e
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if GATED and INTERLEAVED:
        c2 = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c2_ok = c2 < 2 * N
        acc = tl.zeros([2 * BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & chose[None, :], other=0.0)
            w = tl.load(
                w_e + c2[:, None] * stride_w_n + ks[None, :] * stride_w_k,
                mask=c2_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(w, at, acc)
        acc = tl.trans(acc)  # (tokens, 2 * BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(b_e + c2 * stride_bias_n, mask=c2_ok, other=0.0).to(tl.float32)[None, :]
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_T, BLOCK_N, 2)))
    elif GATED:
        acc_g = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & chose[None, :], other=0.0)
            w_off = cols[:, None] * stride_w_n + ks[None, :] * stride_w_k
            w_mask = col_ok[:, None] & k_ok[None, :]
            acc_g = tl.dot(tl.load(w_e + w_off, mask=w_mask, other=0.0), at, acc_g)
            acc_u = tl.dot(tl.load(w_e + N * stride_w_n + w_off, mask=w_mask, other=0.0), at, acc_u)
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
        if HAS_BIAS:
            acc_g += tl.load(b_e + cols * stride_bias_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_e + (N + cols) * stride_bias_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & chose[None, :], other=0.0)
            w = tl.load(
                w_e + cols[:, None] * stride_w_n + ks[None, :] * stride_w_k,
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(w, at, acc)
        acc = tl.trans(acc)
        if HAS_BIAS:
            acc += tl.load(b_e + cols * stride_bias_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc_g.to(OUT.dtype.element_ty).to(tl.float32)
        up = acc_u.to(OUT.dtype.element_ty).to(tl.float32)
        if ACT == "silu":
            out = (gate * tl.sigmoid(gate)).to(OUT.dtype.element_ty).to(tl.float32) * up
        else:  # gpt_oss
            g = tl.minimum(gate, clamp)
            u = tl.minimum(tl.maximum(up, -clamp), clamp)
            out = (u + 1.0) * (g * tl.sigmoid(1.702 * g))
    else:
        out = acc
    rows = pairs.to(tl.int64)[:, None] * N
    tl.store(OUT + rows + cols[None, :], out.to(OUT.dtype.element_ty), mask=chose[:, None] & col_ok[None, :])


def _default(columns: int) -> MoEDecode:
    """64 columns a program, fewer where the chosen experts' ``columns`` in blocks would not fill an H100's 132
    SMs twice."""
    block_n = 64
    while block_n > 16 and columns // block_n < 264:
        block_n //= 2
    return MoEDecode(BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=4)


# Eager LaunchPlans (see _launch_cache): decode repeats the same shapes every step, and at a few tokens the
# host's time per launch is what an eager step waits on.
_PLANS = PlanCache()


def _gemm(a, ids, w, bias, out, gated, interleaved, activation, clamp, problem):
    T, k = ids.shape
    E, K, n = w.shape
    n = n // 2 if gated else n
    has_bias = bias is not None
    bias_stride = bias.stride() if has_bias else (0, 0)
    bias = bias if has_bias else torch.empty(1, device=a.device)
    key = (gated, a.shape, a.stride(), ids.shape, ids.dtype, w.shape, w.stride(), has_bias, bias_stride)
    key += (interleaved, a.dtype, activation, clamp, a.device)
    plan = _PLANS.get(key)
    if plan is not None and plan(a, ids, w, bias, out):
        return
    cols = min(problem["tokens"] * k, E) * n  # the most columns the chosen experts have (not counted: no sync)
    cfg = launch_config(MoEDecode, a.device, lambda: _default(cols), gated=gated, **problem)
    plan = launch(
        _moe_decode_kernel,
        (T * k, cdiv(n, cfg.BLOCK_N)),
        A=a,
        IDS=ids,
        W=w,
        BIAS=bias,
        OUT=out,
        T=T,
        N=n,
        K=K,
        E=E,
        TOP_K=k,
        stride_a=a.stride(0),
        stride_w_e=w.stride(0),
        stride_w_k=w.stride(1),
        stride_w_n=w.stride(2),
        stride_bias_e=bias_stride[0],
        stride_bias_n=bias_stride[1],
        clamp=float(clamp or 0.0),
        GATED=gated,
        INTERLEAVED=interleaved,
        HAS_BIAS=has_bias,
        ACT=activation,
        BLOCK_T=MAX_TOKENS,
        BLOCK_J=max(2, next_pow2(k)),
        BLOCK_P=max(16, next_pow2(T * k)),
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        **cfg.options,
        plan=True,
    )
    if plan is not None:
        _PLANS[key] = plan


def decode_rows(x, ids, gate_up, down, gate_up_bias, down_bias, interleaved, activation, clamp):
    """``y`` (T * k, H): each pair's expert output (rows of dropped pairs unwritten), for T <= MAX_TOKENS.

    ``gate_up`` (E, H, 2I) and ``down`` (E, I, H) are strided views (K, then N), as :mod:`tritonspec.ops.moe`
    passes them; ``ids`` (T, k) contiguous.
    """
    T, H = x.shape
    if T > MAX_TOKENS:
        raise ValueError(f"decode_rows: at most {MAX_TOKENS} tokens, got {T}")
    I = gate_up.shape[2] // 2
    problem = dict(tokens=next_pow2(T), top_k=ids.shape[1], H=int(H), I=int(I), E=gate_up.shape[0], dtype=str(x.dtype))
    h = torch.empty((ids.numel(), I), dtype=x.dtype, device=x.device)
    _gemm(x, ids, gate_up, gate_up_bias, h, True, interleaved, activation, clamp, problem)
    y = torch.empty((ids.numel(), H), dtype=x.dtype, device=x.device)
    _gemm(h, ids, down, down_bias, y, False, False, activation, clamp, problem)
    return y
