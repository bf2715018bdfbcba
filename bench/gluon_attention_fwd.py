"""Experiment, not shipped: an FA3-style sm90 attention forward written in Gluon (Triton 3.6).

Question it answers: does overlapping the softmax of key block j+1 with the p.v matmul of block j
(q.k^T j+1 issued first, then p.v j, then ``warpgroup_mma_wait(1)``) lift the forward above the
``tl`` kernel in ``tritonspec.ops.attention``? Answer on the H100 (bench/NOTES.md, session 4): no.
ptxas (12.8 and 12.9) schedules ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` ahead of the softmax, so the
overlap written in the PTX does not survive into SASS; the kernel is correct and ~0-10% slower at
head_dim 128 (faster at 64).

    source bench/gpu_env.sh && python3 bench/gluon_attention_fwd.py    # checks, then a timing table
"""
import math
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from tritonspec.ops.attention import LOG2E, _padded_rows, attention_forward


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, b, hk, j, stage, BLOCK_N: gl.constexpr):
    kb = k_bars.index(stage)
    mbarrier.expect(kb, k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], kb, k_smem.index(stage))
    vb = v_bars.index(stage)
    mbarrier.expect(vb, v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], vb, v_smem.index(stage))


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, j, offs_m, SEQ_K, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
             MASKED: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr):
    """Online-softmax step on the raw scores of key block j: returns (p as the p.v A operand, alpha, m, l)."""
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        valid = gl.expand_dims(cols, 0) < SEQ_K
        if CAUSAL:
            valid = valid & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m, 1))
        s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return p, alpha, m_new, l_i


@gluon.jit
def _inner(acc, p, m_i, l_i, alpha, s0, q2, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, b, hk, lo, hi, n, qk_scale,
           mask_from, offs_m, SEQ_K, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
           STAGES: gl.constexpr, MASKED: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
           row_o: gl.constexpr, num_warps: gl.constexpr):
    for j in range(lo, hi):
        stage = j % STAGES
        nstage = (j + 1) % STAGES
        # q.k^T of block j+1 first, then p.v of block j: wgmma groups retire in order, so waiting for
        # one outstanding group below leaves p.v j running under the softmax of block j+1.
        mbarrier.wait(k_bars.index(nstage), ((j + 1) // STAGES) & 1)
        s = warpgroup_mma(q2, k_smem.index(nstage).reshape([BLOCK_N, D]).permute((1, 0)), s0, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_bars.index(stage), (j // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_N, D]), acc, is_async=True)
        s, p = warpgroup_mma_wait(1, deps=(s, p))
        p_next, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, j + 1, offs_m, SEQ_K, BLOCK_N, CAUSAL, MASKED,
                                           s_layout, p_layout)
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
        if num_warps > 4:
            gl.thread_barrier()  # both warpgroups are done with stage `stage` before TMA overwrites it
        if j + STAGES < n:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, b, hk, j + STAGES, stage, BLOCK_N)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p = p_next
    return acc, p, m_i, l_i


@gluon.jit
def attn_fwd_sm90(q_desc, k_desc, v_desc, o_desc, LSE, HQ, GROUP, SEQ_Q, SEQ_K, SEQ_PAD, qk_scale,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, SEQ_K)
        mask_from = gl.minimum(start_m, SEQ_K) // BLOCK_N
    else:
        hi = SEQ_K
        mask_from = SEQ_K // BLOCK_N
    n = gl.cdiv(hi, BLOCK_N)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        if i < n:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, b, hk, i, i, BLOCK_N)

    q2 = q_smem.reshape([BLOCK_M, D])
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q2, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), s0, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    if mask_from == 0:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, offs_m, SEQ_K, BLOCK_N, CAUSAL, True, s_layout,
                                      p_layout)
    else:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, offs_m, SEQ_K, BLOCK_N, CAUSAL, False, s_layout,
                                      p_layout)

    # block j+1's softmax is masked iff j+1 >= mask_from: two loops keep the mask out of the unmasked
    # one (a branch inside the overlap window makes ptxas retire the in-flight p.v early)
    split = gl.maximum(gl.minimum(mask_from - 1, n - 1), 0)
    acc, p, m_i, l_i = _inner(acc, p, m_i, l_i, alpha, s0, q2, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, b, hk,
                              0, split, n, qk_scale, mask_from, offs_m, SEQ_K, BLOCK_N, D, CAUSAL, STAGES, False,
                              s_layout, p_layout, row_o, num_warps)
    acc, p, m_i, l_i = _inner(acc, p, m_i, l_i, alpha, s0, q2, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, b, hk,
                              split, n - 1, n, qk_scale, mask_from, offs_m, SEQ_K, BLOCK_N, D, CAUSAL, STAGES, True,
                              s_layout, p_layout, row_o, num_warps)

    last = n - 1
    stage = last % STAGES
    mbarrier.wait(v_bars.index(stage), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(stage).reshape([BLOCK_N, D]), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=(acc, p))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    lse = m_i + gl.log2(l_i)
    gl.store(LSE + bh.to(gl.int64) * SEQ_PAD + offs_m, lse, mask=offs_m < SEQ_Q)
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    q2.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, start_m, 0], q_smem)
    tma.store_wait(0)


# -- host side ------------------------------------------------------------------------------------
def _descriptor(t, rows):
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, t.shape[-1]], gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]], layout)


def gluon_forward(q, k, v, causal, block_m=128, block_n=128, num_warps=8, stages=3):
    """(out, lse) like ``attention_forward`` (bf16, head_dim 64/128, scale 1/sqrt(head_dim))."""
    batch, heads_q, seq_q, head_dim = q.shape
    o = torch.empty_like(q)
    lse = _padded_rows(batch, heads_q, seq_q, float("inf"), q.device)
    grid = (triton.cdiv(seq_q, block_m), batch * heads_q)
    attn_fwd_sm90[grid](_descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
                        _descriptor(o, block_m), lse, heads_q, heads_q // k.shape[1], seq_q, k.shape[2],
                        lse.shape[-1], LOG2E / math.sqrt(head_dim), CAUSAL=causal, STAGES=stages,
                        num_warps=num_warps)
    return o, lse


CHECKS = [  # batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal, HF (b, s, h, d) layout
    (1, 2, 2, 1000, 1000, 128, True, False), (1, 2, 2, 1000, 1000, 128, False, False),
    (2, 4, 2, 17, 17, 128, True, False), (1, 1, 1, 1, 1, 128, False, False),
    (1, 8, 2, 4096, 4096, 128, True, False), (2, 4, 4, 300, 700, 128, False, True),
    (2, 4, 4, 700, 300, 128, True, True), (1, 4, 1, 513, 513, 64, True, False),
    (1, 4, 4, 2048, 2048, 64, False, False)]
CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2)]  # block_m, block_n, warps, stages
SHAPES = [(4, 32, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128), (8, 32, 2048, 64)]


def _qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, hf_layout):
    def make(heads, seq):
        if hf_layout:
            return torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    return make(heads_q, seq_q), make(heads_kv, seq_k), make(heads_kv, seq_k)


def check() -> int:
    """Every config against float64 SDPA; the error may not exceed twice the tl kernel's. Returns failures."""
    torch.manual_seed(0)
    bad = 0
    for case in CHECKS:
        *dims, head_dim, causal, hf_layout = case
        q, k, v = _qkv(*dims, head_dim, hf_layout)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                             enable_gqa=q.shape[1] != k.shape[1])
        o_tl, lse_tl = attention_forward(q, k, v, causal, 1 / math.sqrt(head_dim))
        err_tl = (o_tl.double() - ref).abs().max().item()
        for cfg in CONFIGS:
            o, lse = gluon_forward(q, k, v, causal, *cfg)
            err = (o.double() - ref).abs().max().item()
            lse_err = (lse[..., :q.shape[2]] - lse_tl[..., :q.shape[2]]).abs().max().item()
            ok = bool(torch.isfinite(o).all()) and err <= max(2 * err_tl, 1e-2) and lse_err < 1e-2
            bad += not ok
            if not ok:
                print(f"FAIL {case} {cfg}: err {err:.2e} (tl {err_tl:.2e}) lse {lse_err:.1e}")
    print(f"checks: {len(CHECKS) * len(CONFIGS) - bad} passed, {bad} failed")
    return bad


def bench(rounds=2):
    """Forward TFLOP/s, medians over interleaved rounds: tl kernel, each Gluon config, cuDNN."""
    names = ["tl"] + ["gluon " + "x".join(map(str, c)) for c in CONFIGS] + ["cudnn"]
    rows = {}
    for _ in range(rounds):
        for shape in SHAPES:
            batch, heads, seq, head_dim = shape
            for causal in (True, False):
                q, k, v = _qkv(batch, heads, heads, seq, seq, head_dim, False)
                fns = [lambda: attention_forward(q, k, v, causal, 1 / math.sqrt(head_dim))]
                fns += [lambda c=c: gluon_forward(q, k, v, causal, *c) for c in CONFIGS]

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fns.append(cudnn)
                flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
                for name, fn in zip(names, fns):
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                    rows.setdefault((shape, causal, name), []).append(flops / ms / 1e9)
    print("| b x h x s x d | causal | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for shape in SHAPES:
        for causal in (True, False):
            vals = [statistics.median(rows[(shape, causal, n)]) for n in names]
            print(f"| {'x'.join(map(str, shape))} | {causal} | " + " | ".join(f"{x:.0f}" for x in vals) + " |")


if __name__ == "__main__":
    sys.exit(check() or bench())
