"""The experts' two GEMMs for decode-sized batches: no sort, each chosen expert's weights read once.

At a few tokens the experts' cost is reading the chosen experts' weights, and the sort of the sorted path
(:mod:`tritonspec.ops.moe`: three launches before the first GEMM, and blocks of padding rows after it) is
launch latency on the critical path. Here, for at most :data:`MAX_TOKENS` tokens, each GEMM is one launch
of ``_moe_decode_kernel`` (two in all), a program per (pair, column block):

* a pair's program works only if its expert appears in no earlier pair (later pairs of the same expert
  exit at once), so each chosen expert's weights are read once, whatever the number of tokens sharing it;
* it gathers every token that chose the expert (a 16-row tile masked by the ids, no sort) and writes the
  rows of those pairs (pair order, ``T*k`` rows): ``act(gate, up)`` for the up GEMM, the expert's output
  for the down GEMM. A token that names the expert in several of its slots is one row, its first such
  slot's; its later ones stay unwritten;
* the GEMM is swapped (``W_e @ x^T``): the weight's columns fill the MMA's M side, the tokens its narrow N.

The down GEMM's programs then count themselves done, per column block, on an int32 counter (which the up
GEMM zeroes); the last to finish sums each token's ``k`` rows there in slot order, so the result does not
depend on which program is last (a slot that repeats an earlier slot's expert adds the earlier slot's row
again, with its own weight). On sm90 the backend's table launches both with programmatic dependent launch:
each starts while the kernel before it ends, prefetches its weights' first tiles into L2, and waits for that
kernel's writes before touching anything it may write; each lets the next start once its own main loop is
done.
Forward only (inference): training keeps the sorted path, whose saved pre-activations the backward reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..kernel_table import MoEDecode
from ..launch import launch_config
from ._dependent_launch import prefetch_l2
from ._library import PlanCache, cdiv, launch, next_pow2

__all__ = ["MAX_TOKENS", "moe_decode"]

MAX_TOKENS = 16  # the token tile: one MMA's narrow side


@triton.jit
def _moe_decode_kernel(
    # Pointers to matrices
    A,  # (T, K) tokens (GATED), or (T * k, K) each pair's row
    IDS,  # (T * k,) each pair's expert: [0, E) in W, [E, E + E2) in W2
    W,  # (E, K, N) by strides, or (GATED) (E, K, 2N): each expert's gate and up columns
    BIAS,  # (E, N) or (E, 2N) by strides, read when HAS_BIAS
    W2,  # (E2, ...) the experts [E, E + E2): W's layout but for the expert stride (offload: host memory)
    BIAS2,  # (E2, ...) their biases, BIAS's layout but for the expert stride
    ROWS,  # (T * k, N) out: the rows of each pair whose expert is in [0, E + E2)
    WEIGHTS,  # (T * k,) the routing weights (not GATED)
    OUT,  # (T, N) out (not GATED): each token's routing-weighted sum of its rows
    COUNTS,  # int32: per column block, the programs done (not GATED); GATED zeroes the first NUM_COUNTS
    # Matrix dimensions
    T,
    N,
    K,
    E,
    E2,
    TOP_K,
    NUM_COUNTS,
    # Strides
    stride_a,
    stride_w_e,
    stride_w2_e,
    stride_w_k,
    stride_w_n,
    stride_bias_e,
    stride_bias2_e,
    stride_bias_n,
    stride_out,
    # Scalars
    clamp,  # gpt_oss's clamp
    # Meta-parameters
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_N columns of the rows of every token that chose pair ``p``'s expert, once per expert.

    GATED: ``act(x @ gate_e, x @ up_e)`` from the tokens' rows (W's gate columns [0, N) and up [N, 2N), or
    INTERLEAVED alternate columns); else ``h @ W_e`` from the pairs' rows, and the last program of a column
    block to finish sums every token's rows there. Rounded as a Hugging Face expert rounds (each
    projection's output, the activation).
    """
    p = tl.program_id(0)
    c = tl.program_id(1)
    if PDL:
        # Launched while the kernel before ends: the weights' first two K steps into L2 (its ids come from
        # before that kernel, and a stale one only prefetches another expert), then wait for its writes.
        if stride_w_k == 1:
            e_hint = tl.minimum(tl.maximum(tl.load(IDS + p), 0), E - 1)
            lines = tl.minimum(tl.arange(0, (2 * BLOCK_K + 63) // 64) * 64, K - 1)  # 128-byte lines, 16-bit weights
            w_rows = tl.minimum(c * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
            tile = W + e_hint.to(tl.int64) * stride_w_e + w_rows[:, None] * stride_w_n + lines[None, :]
            prefetch_l2(tile)
            if GATED:
                prefetch_l2(tile + N * stride_w_n)
        gdc_wait()
    if GATED:
        if (p == 0) & (c == 0):  # the down launch's counters, zero before it starts
            zeroes = tl.arange(0, BLOCK_C)
            tl.store(COUNTS + zeroes, tl.zeros([BLOCK_C], dtype=tl.int32), mask=zeroes < NUM_COUNTS)
    e = tl.load(IDS + p)
    earlier = tl.arange(0, BLOCK_P)
    before = tl.load(IDS + earlier, mask=earlier < p, other=-1)
    works = ((e >= 0) & (e < E + E2) & (tl.sum((before == e).to(tl.int32), axis=0) == 0)).to(tl.int32)
    k_end = K * works  # the other programs only count themselves done
    # the tokens that chose e, and in which of their k slots
    tokens = tl.arange(0, BLOCK_T)
    js = tl.arange(0, BLOCK_J)
    token_ids = tl.load(
        IDS + tokens[:, None] * TOP_K + js[None, :],
        mask=(tokens < T)[:, None] & (js < TOP_K)[None, :],
        other=-1,
    )
    hit = token_ids == e
    chose = tl.max(hit.to(tl.int32), axis=1) * works > 0
    # each token's first slot naming e (a token may name it in several): its row, the one the sum reads
    pairs = tokens * TOP_K + tl.min(tl.where(hit, js[None, :], BLOCK_J), axis=1)
    a_cols = A + (tokens if GATED else pairs).to(tl.int64)[None, :] * stride_a  # A^T: (K, tokens)
    far = e >= E
    w_e = tl.where(far, W2 + (e - E).to(tl.int64) * stride_w2_e, W + e.to(tl.int64) * stride_w_e)
    b_e = tl.where(far, BIAS2 + (e - E).to(tl.int64) * stride_bias2_e, BIAS + e.to(tl.int64) * stride_bias_e)
    cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if GATED and INTERLEAVED:
        c2 = c * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c2_ok = c2 < 2 * N
        acc = tl.zeros([2 * BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
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
            acc += tl.load(b_e + c2 * stride_bias_n, mask=c2 < 2 * N * works, other=0.0).to(tl.float32)[None, :]
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_T, BLOCK_N, 2)))
    elif GATED:
        acc_g = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
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
            b_ok = cols < N * works
            acc_g += tl.load(b_e + cols * stride_bias_n, mask=b_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_e + (N + cols) * stride_bias_n, mask=b_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
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
            acc += tl.load(b_e + cols * stride_bias_n, mask=cols < N * works, other=0.0).to(tl.float32)[None, :]
    if PDL:  # the next launch may start: this program's loads are done
        gdc_launch_dependents()
    if GATED:
        gate = acc_g.to(ROWS.dtype.element_ty).to(tl.float32)
        up = acc_u.to(ROWS.dtype.element_ty).to(tl.float32)
        if ACT == "silu":
            rows = (gate * tl.sigmoid(gate)).to(ROWS.dtype.element_ty).to(tl.float32) * up
        else:  # gpt_oss
            g = tl.minimum(gate, clamp)
            u = tl.minimum(tl.maximum(up, -clamp), clamp)
            rows = (u + 1.0) * (g * tl.sigmoid(1.702 * g))
    else:
        rows = acc
    row_at = pairs.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(ROWS + row_at, rows.to(ROWS.dtype.element_ty), mask=chose[:, None] & col_ok[None, :])
    if not GATED:
        # Count this program done once all its threads stored; the last of the column block's T * k
        # programs sees every row written (acquire; L2 reads) and sums each token's in slot order.
        tl.debug_barrier()
        if tl.atomic_add(COUNTS + c, 1, sem="acq_rel") == T * TOP_K - 1:
            t_ok = tokens < T
            total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for j in range(0, TOP_K):
                pair = tokens * TOP_K + j
                e_j = tl.load(IDS + pair, mask=t_ok, other=-1)
                ok = (e_j >= 0) & (e_j < E + E2)
                # the row of the token's first slot naming e_j (j itself unless a slot before it repeats)
                row = tokens * TOP_K + tl.min(tl.where(token_ids == e_j[:, None], js[None, :], BLOCK_J), axis=1)
                y = tl.load(
                    ROWS + row.to(tl.int64)[:, None] * N + cols[None, :],
                    mask=ok[:, None] & col_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                ).to(tl.float32)
                total += y * tl.load(WEIGHTS + pair, mask=ok, other=0.0).to(tl.float32)[:, None]
            out_at = tokens.to(tl.int64)[:, None] * stride_out + cols[None, :]
            tl.store(OUT + out_at, total.to(OUT.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])


_DEFAULT = MoEDecode(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)

# Eager LaunchPlans (see _launch_cache): decode repeats the same shapes every step, and at a few tokens the
# host's time per launch is what an eager step waits on. key -> (up plan, down plan, counters).
_PLANS = PlanCache()


def _or(t, stand_in):
    """A kernel argument: ``t``, or where it is missing, a tensor of the right kind the kernel never reads."""
    return stand_in if t is None else t


def _gemm(a, ids, w, bias, w2, bias2, rows, weights, out, counts, num_counts, gated, interleaved, activation, clamp,
          cfg):  # fmt: skip
    """One launch of ``_moe_decode_kernel``: its LaunchPlan, or None. ``w2``/``bias2``: the far experts, or None."""
    T, k = ids.shape
    n = w.shape[2] // 2 if gated else w.shape[2]
    has_bias = bias is not None
    bias_stride = bias.stride() if has_bias else (0, 0)
    return launch(
        _moe_decode_kernel,
        (T * k, cdiv(n, cfg.BLOCK_N)),
        A=a,
        IDS=ids,
        W=w,
        BIAS=_or(bias, counts),
        W2=_or(w2, w),
        BIAS2=_or(bias2, _or(bias, counts)),
        ROWS=rows,
        WEIGHTS=weights,
        OUT=out,
        COUNTS=counts,
        T=T,
        N=n,
        K=w.shape[1],
        E=w.shape[0],
        E2=0 if w2 is None else w2.shape[0],
        TOP_K=k,
        NUM_COUNTS=num_counts,
        stride_a=a.stride(0),
        stride_w_e=w.stride(0),
        stride_w2_e=0 if w2 is None else w2.stride(0),
        stride_w_k=w.stride(1),
        stride_w_n=w.stride(2),
        stride_bias_e=bias_stride[0],
        stride_bias2_e=bias2.stride(0) if has_bias and w2 is not None else 0,
        stride_bias_n=bias_stride[1],
        stride_out=out.stride(0),
        clamp=float(clamp),
        GATED=gated,
        INTERLEAVED=interleaved,
        HAS_BIAS=has_bias,
        ACT=activation,
        PDL=cfg.PDL,
        BLOCK_T=MAX_TOKENS,
        BLOCK_J=max(2, next_pow2(k)),
        BLOCK_P=max(16, next_pow2(T * k)),
        BLOCK_C=max(2, next_pow2(num_counts)),
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        **cfg.options,
        plan=True,
    )


def _check_far(near: tuple, far: tuple) -> None:
    """The far experts must be laid out as the near ones but for the expert stride (the kernel's one extra
    stride): same shapes past the expert axis, same inner strides, biases on both sides or neither."""
    for name, a, b in zip(("gate_up", "down", "gate_up_bias", "down_bias"), near, far):
        if (a is None) != (b is None):
            raise ValueError(f"moe_decode: far {name} is {'missing' if b is None else 'given'}, unlike the near one")
        if a is not None and (a.shape[1:] != b.shape[1:] or a.stride()[1:] != b.stride()[1:] or a.dtype != b.dtype):
            raise ValueError(
                f"moe_decode: far {name} has shape {tuple(b.shape)}, strides {b.stride()} and dtype {b.dtype}; "
                f"expected those of the near one, {tuple(a.shape)}, {a.stride()}, {a.dtype}, but for the first axis"
            )


def moe_decode(x, ids, weights, gate_up, down, gate_up_bias, down_bias, interleaved, activation, clamp, far=None):
    """``out`` (T, H): each token's routing-weighted sum of its experts' outputs, for T <= MAX_TOKENS.

    ``gate_up`` (E, H, 2I) and ``down`` (E, I, H) are strided views (K, then N), as :mod:`tritonspec.ops.moe`
    passes them; ``ids`` and ``weights`` (T, k) contiguous. ``far``: ``(gate_up, down, gate_up_bias, down_bias)``
    of E2 more experts, ids [E, E + E2), stored elsewhere (offloaded experts: host memory the GPU reads in
    place); each is read by the same programs, so the result is bit for bit that of one (E + E2, ...) store.
    """
    T, H = x.shape
    if T > MAX_TOKENS:
        raise ValueError(f"moe_decode: at most {MAX_TOKENS} tokens, got {T}")
    if far is not None:
        _check_far((gate_up, down, gate_up_bias, down_bias), far)
    far_up, far_down, far_up_bias, far_down_bias = far if far is not None else (None,) * 4
    k, I = ids.shape[1], gate_up.shape[2] // 2
    dev = x.device
    h = torch.empty((T * k, I), dtype=x.dtype, device=dev)
    rows = torch.empty((T * k, H), dtype=x.dtype, device=dev)
    out = torch.empty_like(x)
    key = (x.shape, x.stride(), ids.shape, ids.dtype, weights.dtype, gate_up.shape, gate_up.stride(), down.stride())
    key += tuple(None if b is None else (b.shape, b.stride()) for b in (gate_up_bias, down_bias))
    key += tuple(None if t is None else (t.shape, t.stride()) for t in (far_up, far_down, far_up_bias, far_down_bias))
    key += (interleaved, x.dtype, activation, clamp, dev)
    plans = _PLANS.get(key)
    if plans is not None:
        up, down_sum, num_counts = plans
        counts = torch.empty(num_counts, dtype=torch.int32, device=dev)
        # a plan's tensors in argument order, the stand-ins for missing ones as _gemm passes them
        up_bias, down_bias_ = _or(gate_up_bias, counts), _or(down_bias, counts)
        far_up_args = (_or(far_up, gate_up), _or(far_up_bias, up_bias))
        far_down_args = (_or(far_down, down), _or(far_down_bias, down_bias_))
        if up(x, ids, gate_up, up_bias, *far_up_args, h, weights, out, counts) and down_sum(
            h, ids, down, down_bias_, *far_down_args, rows, weights, out, counts
        ):
            return out
    experts = gate_up.shape[0] + (0 if far_up is None else far_up.shape[0])
    problem = dict(tokens=next_pow2(T), top_k=k, H=int(H), I=int(I), E=experts, dtype=str(x.dtype))
    cfg_up = launch_config(MoEDecode, dev, lambda: _DEFAULT, gated=True, **problem)
    cfg_down = launch_config(MoEDecode, dev, lambda: _DEFAULT, gated=False, **problem)
    num_counts = cdiv(H, cfg_down.BLOCK_N)
    counts = torch.empty(num_counts, dtype=torch.int32, device=dev)
    tail = (weights, out, counts, num_counts)
    up = _gemm(x, ids, gate_up, gate_up_bias, far_up, far_up_bias, h, *tail, True, interleaved, activation, clamp,
               cfg_up)  # fmt: skip
    down_sum = _gemm(h, ids, down, down_bias, far_down, far_down_bias, rows, *tail, False, False, activation, clamp,
                     cfg_down)  # fmt: skip
    if up is not None and down_sum is not None:
        _PLANS[key] = (up, down_sum, num_counts)
    return out
