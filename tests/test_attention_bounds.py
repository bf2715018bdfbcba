"""Attention with key bounds (padding, packed sequences, sliding windows) and sinks, against float64.

Each query sees one interval of keys; the cases cover what transformers' masks produce: left and right
padding (a batch row all padding included), sequences packed by ``cu_seqlens`` or restarting
``position_ids`` (empty ones included), windows smaller and larger than the sequences, GPT-OSS's sinks,
decode steps against a padded cache, and bidirectional padding. Tiles of 16 make every q block walk the
masked / unmasked / masked key ranges and every key block a range of q blocks.
"""

import pytest
from helpers import leaf
import torch

from numerics import poisoned_allocations
import test_attention
from tritonspec.devices import interpreting
from tritonspec.ops.attention import attention, attention_ref, causal_key_bounds, key_bounds_from_mask

CONFIGS = test_attention.CONFIGS
use_configs = test_attention.use_configs  # the fixture: launch configs from a throwaway backend

pytestmark = pytest.mark.skipif(not interpreting(), reason="interpreter tests: CPU tensors need TRITON_INTERPRET=1")

_TOL = {torch.float32: 2e-5, torch.float16: 6e-3, torch.bfloat16: 3e-2}


def _inputs(B, HQ, HKV, SQ, SK, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(B, SQ, HQ, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(B, SK, HKV, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    sinks = torch.randn(HQ, generator=g)
    return q, k, v, do, sinks


def _run(fn, q, k, v, do, sinks, key_bounds):
    q, k, v = (leaf(t) for t in (q, k, v))
    sinks = None if sinks is None else leaf(sinks)
    out = fn(q, k, v, key_bounds=key_bounds, sinks=sinks)
    out.backward(do.to(out.dtype))
    grads = (q.grad, k.grad, v.grad) + (() if sinks is None else (sinks.grad,))
    return (out.detach(), *grads)


def _check(q, k, v, do, sinks, key_bounds):
    got = _run(attention, q, k, v, do, sinks, key_bounds)
    sinks64 = None if sinks is None else sinks.double()
    ref = _run(attention_ref, *(t.double() for t in (q, k, v, do)), sinks64, key_bounds)
    for name, g, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert g.shape == r.shape, name
        g = g.double()
        assert torch.isfinite(g).all(), f"{name}: {(~torch.isfinite(g)).sum().item()} non-finite values"
        err = (g - r).abs().max().item()
        bound = _TOL[q.dtype] * max(1.0, r.abs().max().item())
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"
    return got


def _causal_padded(lengths, S, left):
    """transformers' causal mask with a padding mask (left or right) as a (batch, 1, S, S) bool."""
    lengths = torch.tensor(lengths)
    pos = torch.arange(S)
    tokens = pos[None] >= (S - lengths)[:, None] if left else pos[None] < lengths[:, None]
    return (pos[None, :, None] >= pos[None, None, :]) & tokens[:, None, :]


PACKED = [
    # (cu_seqlens, window, heads (q, kv), head_dim)
    ([0, 7, 20, 20, 45], None, (2, 1), 32),  # an empty sequence, ragged lengths
    ([0, 45], 5, (4, 2), 16),  # window much smaller than the sequence
    ([0, 3, 40, 41], 100, (2, 2), 24),  # window larger than every sequence; head_dim padded
    ([0, 16, 32, 48], 16, (2, 1), 16),  # boundaries on tile edges, window = tile
]


@pytest.mark.parametrize("config", ["small", "small_tma"])
@pytest.mark.parametrize("case", PACKED, ids=lambda c: f"cu{len(c[0]) - 1}-w{c[1]}-h{c[2][0]}x{c[2][1]}-d{c[3]}")
def test_packed_sequences(case, config, use_configs):
    cu, window, (hq, hkv), d = case
    S = cu[-1]
    q, k, v, do, _ = _inputs(1, hq, hkv, S, S, d, torch.float32, seed=S + hq)
    bounds = causal_key_bounds(cu_seqlens=torch.tensor(cu), window=window)
    with use_configs(CONFIGS[config]):
        _check(q, k, v, do, None, bounds)


@pytest.mark.parametrize("config", ["small", "mixed_atomic"])
@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_padded_batch(left, config, use_configs):
    S = 37
    mask = _causal_padded([30, 37, 0, 5], S, left)  # the third row is all padding
    q, k, v, do, _ = _inputs(4, 4, 2, S, S, 16, torch.float32, seed=int(left))
    with use_configs(CONFIGS[config]):
        out, dq, dk, dv = _check(q, k, v, do, None, key_bounds_from_mask(mask))
    # padding queries output 0 and pass no gradient; padding keys get none
    pad_q = ~mask.any(-1)  # (batch, S)
    assert torch.equal(out.transpose(1, 2)[pad_q], torch.zeros_like(out.transpose(1, 2)[pad_q]))
    assert torch.equal(dq.transpose(1, 2)[pad_q], torch.zeros_like(dq.transpose(1, 2)[pad_q]))
    pad_k = ~mask.any(-2)
    assert torch.equal(dk.transpose(1, 2)[pad_k], torch.zeros_like(dk.transpose(1, 2)[pad_k]))


@pytest.mark.parametrize("config", ["small", "mixed_atomic"])
@pytest.mark.parametrize("window", [None, 6])
def test_sinks(window, config, use_configs):
    """GPT-OSS: a per-head logit in each softmax denominator, with its gradient; with padding and a window."""
    S = 33
    mask = _causal_padded([33, 20], S, left=True)
    if window is not None:
        pos = torch.arange(S)
        mask &= pos[:, None] - pos[None, :] < window
    q, k, v, do, sinks = _inputs(2, 4, 2, S, S, 16, torch.float32, seed=11)
    with use_configs(CONFIGS[config]):
        _check(q, k, v, do, sinks, key_bounds_from_mask(mask))


def test_decode_against_a_padded_cache(use_configs):
    """Three new queries against a left-padded cache of 29 keys (seq_q != seq_k)."""
    SQ, SK = 3, 29
    lengths = torch.tensor([29, 11])
    keys = torch.arange(SK)
    mask = (keys[None, None] <= (SK - SQ + torch.arange(SQ))[None, :, None]) & (keys >= SK - lengths[:, None])[
        :, None, :
    ]
    q, k, v, do, _ = _inputs(2, 2, 1, SQ, SK, 16, torch.float32, seed=12)
    with use_configs(CONFIGS["small"]):
        _check(q, k, v, do, None, key_bounds_from_mask(mask[:, None]))


def test_bounds_changed_in_place_are_read_again(use_configs):
    """What the kernels derive from key bounds is kept on them for every layer of a batch; bounds the caller
    then changes in place are derived again (never stale), forward and backward."""
    q, k, v, do, _ = _inputs(1, 2, 1, 40, 40, 16, torch.float32, seed=21)
    bounds = causal_key_bounds(cu_seqlens=torch.tensor([0, 17, 40]))
    with use_configs(CONFIGS["small"]):
        first = _check(q, k, v, do, None, bounds)
        assert _check(q, k, v, do, None, bounds)[0].equal(first[0])  # kept: the same result again
        bounds.copy_(causal_key_bounds(cu_seqlens=torch.tensor([0, 5, 40])))
        again = _check(q, k, v, do, None, bounds)
    assert not again[0][:, :, 17:].equal(first[0][:, :, 17:])


def test_bounds_made_in_inference_mode(use_configs):
    """Inference tensors keep no version count: bounds made under torch.inference_mode are derived afresh
    each call (a generation loop's), not kept, and give the reference's output."""
    q, k, v, _, _ = _inputs(2, 2, 1, 24, 24, 16, torch.float32, seed=22)
    with torch.inference_mode(), use_configs(CONFIGS["small"]):
        bounds = causal_key_bounds(position_ids=torch.tensor([list(range(10)) + list(range(14))] * 2))
        for _ in range(2):
            got = attention(q, k, v, key_bounds=bounds)
            ref = attention_ref(q.double(), k.double(), v.double(), key_bounds=bounds)
            torch.testing.assert_close(got.double(), ref, rtol=0, atol=_TOL[torch.float32])


def test_bidirectional_padding(use_configs):
    """An encoder's batch: every token sees every token of its row, padding none."""
    S = 21
    tokens = torch.arange(S)[None] < torch.tensor([21, 9])[:, None]
    mask = tokens[:, None, :] & tokens[:, :, None]
    q, k, v, do, _ = _inputs(2, 2, 2, S, S, 16, torch.float32, seed=13)
    with use_configs(CONFIGS["small"]):
        _check(q, k, v, do, None, key_bounds_from_mask(mask))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, use_configs):
    q, k, v, do, sinks = _inputs(1, 4, 2, 40, 40, 32, dtype, seed=14)
    bounds = causal_key_bounds(cu_seqlens=torch.tensor([0, 9, 40]), window=12)
    with use_configs(CONFIGS["small"]):
        _check(q, k, v, do, sinks, bounds)


@pytest.mark.parametrize("config", ["small", "mixed_atomic", "small_tma"])
def test_every_output_element_is_written(config, use_configs):
    """NaN-filled allocations: any element a kernel skips (padding rows included) shows up as NaN."""
    S = 35
    mask = _causal_padded([35, 12, 0], S, left=False)
    q, k, v, do, sinks = _inputs(3, 2, 1, S, S, 16, torch.float32, seed=15)
    with use_configs(CONFIGS[config]), poisoned_allocations():
        _check(q, k, v, do, sinks, key_bounds_from_mask(mask))


def test_bounds_builders_agree_with_the_masks_they_describe():
    S = 30
    cu = torch.tensor([0, 4, 4, 17, 30])
    starts = torch.repeat_interleave(cu[:-1], cu.diff())
    pos = torch.arange(S)
    position_ids = (pos - starts)[None]  # restarts at every sequence, as packing collators write them
    for window in (None, 5):
        keep = (pos[None, :] <= pos[:, None]) & (starts[None, :] == starts[:, None])
        if window is not None:
            keep &= pos[:, None] - pos[None, :] < window
        want = key_bounds_from_mask(keep[None])
        assert torch.equal(causal_key_bounds(cu_seqlens=cu, window=window), want)
        assert torch.equal(causal_key_bounds(position_ids=position_ids, window=window), want)
    assert torch.equal(causal_key_bounds(seq_len=S), key_bounds_from_mask(torch.ones(S, S).tril().bool()[None]))
    two_runs = torch.ones(1, 4, 6, dtype=torch.bool)
    two_runs[..., 2] = False
    assert key_bounds_from_mask(two_runs) is None  # a hole: not an interval, SDPA's


def test_bad_arguments_get_clear_errors():
    q, k, v, _, _ = _inputs(1, 2, 1, 8, 8, 16, torch.float32, seed=16)
    good = causal_key_bounds(seq_len=8)
    with pytest.raises(ValueError, match="'causal' and 'key_bounds' exclude each other"):
        attention(q, k, v, causal=True, key_bounds=good)
    with pytest.raises(ValueError, match=r"'key_bounds' must be an int32 or int64 tensor of shape \(2, batch, seq_q\)"):
        attention(q, k, v, key_bounds=good[:, :, :5])
    with pytest.raises(ValueError, match="'key_bounds' must be an int32 or int64"):
        attention(q, k, v, key_bounds=good.float())
    with pytest.raises(ValueError, match=r"'sinks' must be a floating-point tensor of shape \(heads_q,\)"):
        attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="exactly one of seq_len, cu_seqlens, position_ids"):
        causal_key_bounds(seq_len=4, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="'cu_seqlens' must start at 0 and never decrease"):
        causal_key_bounds(cu_seqlens=torch.tensor([0, 5, 3]))
    with pytest.raises(ValueError, match="'window' must be a positive int"):
        causal_key_bounds(seq_len=4, window=0)
    with pytest.raises(ValueError, match="'mask' must be a bool tensor"):
        key_bounds_from_mask(torch.ones(1, 4, 4))


def test_library_op_with_bounds_and_sinks(monkeypatch, use_configs):
    """The registered ops (what torch.compile calls): bounds and sinks through their schemas, and opcheck."""
    from tritonspec.ops import _library
    from tritonspec.ops.attention import ATTENTION, _padded_bounds

    monkeypatch.setattr(_library, "FORCE_LIBRARY_OP", True)
    q, k, v, do, sinks = _inputs(1, 2, 1, 24, 24, 16, torch.float32, seed=17)
    bounds = causal_key_bounds(cu_seqlens=torch.tensor([0, 10, 24]), window=7)
    with use_configs(CONFIGS["small"]):
        _check(q, k, v, do, sinks, bounds)
        padded = _padded_bounds(bounds, 24)
        torch.library.opcheck(ATTENTION.forward_op, (leaf(q), leaf(k), leaf(v), padded, leaf(sinks), False, 0.25))
