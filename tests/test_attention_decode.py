"""Split-K decode attention (``ops.attention_decode``) against a float64 reference.

Shapes are tiny (the interpreter runs every program in numpy) but odd: seq_k not a block multiple, padded and
non-power-of-two head dims, GQA groups whose rows fill several 16-row tiles, K/V as views of a larger static
cache whose unfilled slots hold random values (so a key read by mistake changes the result). A test spec sets
the launch configs: "direct" keeps the op's defaults (one split at these sizes: the partial kernel writes the
output), "split" and "split_wide" force one block of 16 or 32 keys a split (and 16-row tiles for "split"), so the
combine kernel runs over several splits (the tests check it did), two splits a step: its running max then rises
between steps, so what it summed before must be rescaled. The same
tests run on a GPU (TRITONSPEC_TEST_DEVICE=cuda) in float16 and bfloat16.
"""

import dataclasses
import importlib
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_spec, no_interpreter

import tritonspec
from numerics import assert_close, poisoned_allocations
from tritonspec.devices import interpreting
from tritonspec.ops.attention import attention_ref
from tritonspec.ops.attention_decode import MAX_QUERIES, attention_decode

decode_module = importlib.import_module("tritonspec.ops.attention_decode")  # the package binds the function's name

CONFIGS = {
    "direct": {"attention_decode": dict(min_split_keys=1 << 16)},  # one split: the partial kernel writes the output
    "split": {
        "attention_decode": dict(BLOCK_M=16, BLOCK_N=16, min_split_keys=16, programs_per_unit=64),
        "attention_decode_combine": dict(BLOCK_S=2),
    },
    "split_wide": {
        "attention_decode": dict(BLOCK_N=32, min_split_keys=32, programs_per_unit=64),
        "attention_decode_combine": dict(BLOCK_S=2),
    },
}


@pytest.fixture
def use_configs(registry):
    """Run under a throwaway backend whose spec returns the given launch configs (and records the asks)."""

    def use(name, seen=None):
        table = CONFIGS[name]

        def kernel_config(kernel, device, **problem):
            if seen is not None:
                seen.append((kernel, problem))
            return None if table is None else table.get(kernel)

        tritonspec.register_spec(
            "attention-decode-test", make_spec("attention_decode_spec", kernel_config=kernel_config)
        )
        return tritonspec.use_backend("attention-decode-test")

    return use


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, grid) of every launch the op makes."""
    seen = []
    real = decode_module.launch

    def recorded(kernel, grid, *args, **kwargs):
        seen.append((kernel.__name__, tuple(grid)))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(decode_module, "launch", recorded)
    return seen


def _dtypes(device):
    return [torch.float32, torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16]


def _rand(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _inputs(gen, B, HQ, HKV, SQ, SK, D, dtype, device):
    return tuple(_rand(gen, *s, dtype=dtype, device=device) for s in ((B, HQ, SQ, D), (B, HKV, SK, D), (B, HKV, SK, D)))


def reference(q, k, v, keep=None, sinks=None, scale=None):
    """float64 softmax(q k^T * scale) v over the keys ``keep`` (bool, broadcastable to (batch, 1, seq_q, seq_k)),
    with GQA and sinks; a query that sees no key outputs 0."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q.double() @ k64.transpose(-1, -2) * scale
    if keep is None:
        keep = torch.ones(s.shape[-1], dtype=torch.bool, device=q.device)
    keep = keep.expand(q.shape[0], 1, q.shape[2], k.shape[2])
    empty = ~keep.any(-1, keepdim=True)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    if sinks is not None:
        s = torch.cat((s, sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)), -1)
    p = torch.softmax(s, -1)[..., : k.shape[2]].masked_fill(empty, 0.0)
    return p @ v64


def _keep_of(bounds, seq_k):
    j = torch.arange(seq_k, device=bounds.device)
    return ((j >= bounds[0][..., None]) & (j < bounds[1][..., None]))[:, None]


def _check(out, ref, q, v):
    """``out`` within the dtype's error model of ``ref``: one rounding of the output, plus (half types) the
    probabilities rounded before P @ V, an error relative to the values' magnitude."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # (batch, seq_q, heads, dim) memory: HF's transpose is free
    scale = None if q.dtype == torch.float32 else max(ref.abs().max().item(), v.abs().max().item())
    assert_close(out, ref, "out", scale=scale)


def _splits_used(launches):
    grids = [grid for name, grid in launches if name == "_decode_partial_kernel"]
    assert grids, launches
    return grids[-1][1]


def _expect_splits(config, launches):
    """The split configs really ran several splits and the combine; the default ran one launch."""
    n = _splits_used(launches)
    combines = [name for name, _ in launches if name == "_decode_combine_kernel"]
    if config == "direct":
        assert n == 1 and not combines, launches
    else:
        assert n >= 2 and combines, launches


CASES = [
    # B, HQ, HKV, SQ, SK, D
    (1, 4, 1, 1, 77, 16),  # GQA 4/1, one query
    (2, 4, 2, 3, 45, 64),  # GQA 4/2, three queries
    (1, 2, 2, 16, 33, 24),  # MHA, MAX_QUERIES queries, head_dim padded to 32
    (1, 8, 1, 5, 50, 16),  # 40 rows: three 16-row tiles under "split"
]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_float64_reference(case, config, device, gen, use_configs, launches):
    q, k, v = _inputs(gen, *case, torch.float32 if device == "cpu" else torch.bfloat16, device)
    with use_configs(config), torch.no_grad():
        out = attention_decode(q, k, v)
    _check(out, reference(q, k, v), q, v)
    _expect_splits(config, launches)


@pytest.mark.parametrize("config", ["direct", "split"])
def test_half_precision(config, device, gen, use_configs):
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = _inputs(gen, 2, 4, 2, 2, 70, 32, dtype, device)
        with use_configs(config):
            out = attention_decode(q, k, v, scale=0.3)
        _check(out, reference(q, k, v, scale=0.3), q, v)


@pytest.mark.parametrize("config", ["direct", "split"])
def test_head_dim_256_and_negative_scale(config, device, gen, use_configs):
    q, k, v = _inputs(gen, 1, 2, 1, 2, 40, 256, _dtypes(device)[0], device)
    with use_configs(config):
        out = attention_decode(q, k, v, scale=-0.2)
    _check(out, reference(q, k, v, scale=-0.2), q, v)


def _static_cache(gen, B, HKV, max_len, D, dtype, device, layout):
    """k, v over a preallocated cache of ``max_len`` slots, all random (unfilled slots too): (batch, heads,
    slots, dim), or transformers' (batch, slots, heads, dim) memory transposed."""
    if layout == "heads_first":
        return tuple(_rand(gen, B, HKV, max_len, D, dtype=dtype, device=device) for _ in range(2))
    return tuple(_rand(gen, B, max_len, HKV, D, dtype=dtype, device=device).transpose(1, 2) for _ in range(2))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout", ["heads_first", "transposed"])
def test_static_cache_with_mask_or_bounds(layout, config, device, gen, use_configs, launches):
    """Each sequence has its own filled length; its queries are the last ``SQ`` filled positions (causal among
    themselves). The full cache goes in with transformers' (batch, 1, seq_q, max_len) mask, or with key bounds;
    a view of the first sequence's filled prefix goes in with its part of the mask."""
    B, HQ, HKV, SQ, D, max_len = 2, 4, 2, 3, 16, 96
    dtype = _dtypes(device)[0]
    k, v = _static_cache(gen, B, HKV, max_len, D, dtype, device, layout)
    q = _rand(gen, B, SQ, HQ, D, dtype=dtype, device=device).transpose(1, 2)  # HF's layout too
    lengths = torch.tensor([37, 81], device=device)
    pos = lengths[:, None] - SQ + torch.arange(SQ, device=device)  # (batch, seq_q): each query's position
    bounds = torch.stack((torch.zeros_like(pos), pos + 1))
    keep = _keep_of(bounds, max_len)
    with use_configs(config), torch.no_grad():
        by_mask = attention_decode(q, k, v, mask=keep)
        by_bounds = attention_decode(q, k, v, key_bounds=bounds)
        prefix = attention_decode(q[:1], k[:1, :, :37], v[:1, :, :37], mask=keep[:1, :, :, :37])
    ref = reference(q, k, v, keep)
    _check(by_mask, ref, q, v)
    _check(by_bounds, ref, q, v)
    _check(prefix, ref[:1], q[:1], v)
    if config != "direct":
        assert all(grid[1] >= 2 for name, grid in launches if name == "_decode_partial_kernel")


@pytest.mark.parametrize("config", ["direct", "split"])
def test_dense_masks_any_pattern_and_broadcast(config, device, gen, use_configs, launches):
    """Rows that are not intervals, whole key blocks masked for every query (skipped), a query that sees nothing
    (exactly 0), and masks broadcast over batch, queries or keys (stride 0)."""
    B, HQ, HKV, SQ, SK, D = 2, 4, 2, 3, 70, 16
    q, k, v = _inputs(gen, B, HQ, HKV, SQ, SK, D, _dtypes(device)[0], device)
    keep = torch.rand(B, 1, SQ, SK, generator=gen).to(device) > 0.6
    keep[..., 16:48] = False  # blocks no query of the tile sees
    keep[1, 0, 2] = False  # sees nothing
    masks = [
        keep,
        keep[:1],  # (1, 1, SQ, SK): broadcast over the batch
        keep[0, 0],  # (SQ, SK)
        keep[:, :, :1],  # (B, 1, 1, SK): one row for every query
        keep[0, 0, 0],  # (SK,)
        keep[:, :, :, :1],  # (B, 1, SQ, 1): every key or none
        keep.transpose(-1, -2).contiguous().transpose(-1, -2),  # keys not contiguous
    ]
    with use_configs(config), torch.no_grad():
        for mask in masks:
            out = attention_decode(q, k, v, mask=mask)
            _check(out, reference(q, k, v, mask), q, v)
            empty = ~mask.expand(B, 1, SQ, SK).any(-1)[:, 0]  # (B, SQ): queries that see no key
            rows = out.transpose(1, 2)[empty]
            assert torch.equal(rows, torch.zeros_like(rows))
            if mask is keep:
                assert empty[1, 2] and rows.numel() > 0
    _expect_splits(config, launches[-2:])


@pytest.mark.parametrize("config", ["direct", "split"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_key_bounds_with_empty_and_clipped_rows(index_dtype, config, device, gen, use_configs):
    """Intervals anywhere (windows), beyond [0, seq_k) (clipped), empty (exactly 0 out), given as the
    non-contiguous view transformers' integration hands over."""
    B, HQ, HKV, SQ, SK, D = 2, 4, 2, 4, 90, 16
    q, k, v = _inputs(gen, B, HQ, HKV, SQ, SK, D, _dtypes(device)[0], device)
    lo = torch.tensor([[0, 10, 60, -5], [85, 30, 50, 0]])
    hi = torch.tensor([[90, 27, 200, 40], [120, 30, 20, 1]])  # [1, 1] and [1, 2] empty
    bounds = torch.stack((lo, hi)).to(device=device, dtype=index_dtype)
    as_mask = bounds.permute(1, 2, 0)[:, None].contiguous()  # (B, 1, SQ, 2), as bounds_mask stores them
    view = as_mask[:, 0].permute(2, 0, 1)
    assert not view.is_contiguous()
    with use_configs(config), torch.no_grad():
        out = attention_decode(q, k, v, key_bounds=view)
    keep = _keep_of(bounds.clamp(0, SK), SK)
    _check(out, reference(q, k, v, keep), q, v)
    assert torch.equal(out[1, :, 1:3], torch.zeros_like(out[1, :, 1:3]))


@pytest.mark.parametrize("config", ["direct", "split"])
def test_sinks(config, device, gen, use_configs):
    """GPT-OSS's sinks in the denominator, with no mask, with a mask, and with bounds where a query sees no key
    (still exactly 0: a sink has no value)."""
    B, HQ, HKV, SQ, SK, D = 2, 4, 2, 2, 60, 16
    dtype = _dtypes(device)[0]
    q, k, v = _inputs(gen, B, HQ, HKV, SQ, SK, D, dtype, device)
    sinks = _rand(gen, HQ, device=device) * 2
    bounds = torch.tensor([[[0, 5], [20, 0]], [[60, 33], [50, 0]]], device=device)  # [1, 1] sees nothing
    keep = _keep_of(bounds, SK)
    with use_configs(config), torch.no_grad():
        plain = attention_decode(q, k, v, sinks=sinks)
        masked = attention_decode(q, k, v, mask=keep, sinks=sinks.to(dtype))
        bounded = attention_decode(q, k, v, key_bounds=bounds, sinks=sinks)
    _check(plain, reference(q, k, v, sinks=sinks), q, v)
    _check(masked, reference(q, k, v, keep, sinks=sinks.to(dtype)), q, v)
    _check(bounded, reference(q, k, v, keep, sinks=sinks), q, v)
    assert torch.equal(bounded[1, :, 1], torch.zeros_like(bounded[1, :, 1]))


def test_reference_agrees_with_sdpa_and_attention_ref(gen):
    """Pins the reference's semantics (GQA head mapping, mask broadcast, bounds, sinks) to PyTorch's SDPA and to
    ``attention_ref``."""
    q, k, v = _inputs(gen, 2, 4, 2, 3, 11, 8, torch.float64, "cpu")
    keep = torch.rand(2, 1, 3, 11, generator=gen) > 0.3
    keep[..., 0] = True  # SDPA gives NaN for a row that sees nothing
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.4, enable_gqa=True)
    torch.testing.assert_close(reference(q, k, v, keep, scale=0.4), sdpa, rtol=1e-12, atol=1e-12)
    bounds = torch.tensor([[[0, 2, 5], [3, 3, 0]], [[11, 9, 6], [4, 3, 11]]])
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    got = reference(q, k, v, _keep_of(bounds, 11), sinks=sinks)
    torch.testing.assert_close(got, attention_ref(q, k, v, key_bounds=bounds, sinks=sinks), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_output_element_is_written(config, device, gen, use_configs):
    """The output and the workspace start as NaN (``torch.empty`` poisoned): an element no kernel writes, or a
    partial the combine reads but no program wrote, shows up as NaN."""
    q, k, v = _inputs(gen, 2, 8, 2, 3, 101, 24, _dtypes(device)[0], device)
    keep = torch.rand(2, 1, 3, 101, generator=gen).to(device) > 0.5
    with use_configs(config), torch.no_grad(), poisoned_allocations():
        outs = [attention_decode(q, k, v), attention_decode(q, k, v, mask=keep)]
    _check(outs[0], reference(q, k, v), q, v)
    _check(outs[1], reference(q, k, v, keep), q, v)


def test_no_keys_gives_zeros(device, gen, use_configs):
    q, k, v = _inputs(gen, 1, 2, 1, 2, 0, 16, _dtypes(device)[0], device)
    sinks = _rand(gen, 2, device=device)
    with use_configs("split"):
        out = attention_decode(q, k, v, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))


def test_launch_parameters_come_from_the_spec(device, gen, use_configs, launches):
    seen = []
    q, k, v = _inputs(gen, 1, 4, 2, 2, 40, 32, _dtypes(device)[0], device)
    with use_configs("split", seen):
        attention_decode(q, k, v, key_bounds=torch.tensor([[[0, 0]], [[40, 39]]], device=device))
    asked = dict(seen)
    assert set(asked) == {"attention_decode", "attention_decode_combine"}
    problem = asked["attention_decode"]
    assert problem["head_dim"] == 32 and problem["group"] == 2 and problem["seq_q"] == 2
    assert problem["seq_k"] == 64 and problem["keys"] == "bounds" and problem["dtype"] == str(q.dtype)
    assert asked["attention_decode_combine"]["splits"] == _splits_used(launches) == 3  # 40 keys, 16 a split


@pytest.mark.parametrize("config", ["direct", "split"])
def test_launch_plans_relaunch_with_each_calls_tensors(config, device, gen, use_configs, monkeypatch):
    """A repeated eager call relaunches its LaunchPlans with the call's tensors in the kernels' parameter order.
    The interpreter makes no plans, so stand-ins do: each relaunches its kernel with the tensors it is given
    substituted by position, so tensors handed over in another order fail here."""
    real = decode_module.launch

    def planning(kernel, grid, *args, plan=False, **kwargs):
        real(kernel, grid, *args, **kwargs)
        names = [n for n in inspect.signature(kernel.fn).parameters if isinstance(kwargs.get(n), torch.Tensor)]

        def relaunch(*tensors):
            assert len(tensors) == len(names)
            real(kernel, grid, *args, **{**kwargs, **dict(zip(names, tensors))})
            return True

        return relaunch if plan else None

    monkeypatch.setattr(decode_module, "launch", planning)
    monkeypatch.setattr(decode_module, "_PLANS", decode_module.PlanCache())
    B, HQ, HKV, SQ, SK, D = 2, 4, 2, 2, 50, 16
    dtype = _dtypes(device)[0]
    with use_configs(config), torch.no_grad():
        for kind in ("plain", "mask", "bounds"):
            for _ in range(2):  # the second call runs from the plans
                q, k, v = _inputs(gen, B, HQ, HKV, SQ, SK, D, dtype, device)
                sinks = _rand(gen, HQ, device=device)
                keep = torch.rand(B, 1, SQ, SK, generator=gen).to(device) > 0.5
                lo = torch.randint(0, SK // 2, (B, SQ), generator=gen)
                bounds = torch.stack((lo, lo + torch.randint(0, SK // 2, (B, SQ), generator=gen))).to(device)
                extra = dict(mask=keep) if kind == "mask" else dict(key_bounds=bounds) if kind == "bounds" else {}
                out = attention_decode(q, k, v, sinks=sinks, **extra)
                seen = keep if kind == "mask" else _keep_of(bounds, SK) if kind == "bounds" else None
                _check(out, reference(q, k, v, seen, sinks=sinks), q, v)
    assert len(decode_module._PLANS) == 3


def test_split_heuristic():
    """Up to two programs per SM and never past them, no split under min_split_keys, one split for short caches,
    no empty one."""
    cfg = decode_module._default(128, 4)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.min_split_keys, cfg.programs_per_unit) == (16, 64, 64, 2)
    for batch, heads_kv, seq_k in [(1, 8, 32768), (8, 8, 32768), (1, 8, 4096), (1, 4, 1000), (1, 8, 512)]:
        n, per = decode_module.splits(batch * heads_kv, seq_k, 132, cfg)
        blocks = -(-seq_k // cfg.BLOCK_N)
        assert (n - 1) * per < blocks <= n * per  # every split has keys
        assert n == 1 or per * cfg.BLOCK_N >= cfg.min_split_keys
        # about two programs per SM, or as many as min_split_keys (one block) allows; whole blocks per split round
        assert 0.75 * min(2 * 132, batch * heads_kv * blocks) <= n * batch * heads_kv <= 2 * 132
    assert decode_module.splits(8, 32768, 132, cfg) == (32, 16)  # Llama-3's 8 kv heads at 32k: 256 programs
    assert decode_module.splits(64, 32768, 132, cfg) == (4, 128)  # 5 splits would start a second wave
    assert decode_module.splits(8, 300, 132, cfg) == (5, 1)  # a short cache: a block per split
    assert decode_module.splits(256, 32768, 132, cfg) == (1, 512)  # more programs than a wave already
    one = dataclasses.replace(cfg, programs_per_unit=1)
    assert decode_module.splits(8, 32768, 132, one) == (16, 32)


@pytest.mark.parametrize("arch, pdl", [(90, True), (80, False)])
def test_programmatic_dependent_launch_on_sm90_only(arch, pdl, monkeypatch):
    """The nvidia table asks for PDL where it was measured (sm90), for both kernels; the kernels' waits and
    Triton's launch option come together, or neither."""
    from tritonspec import devices
    from tritonspec.launch import for_arch
    from tritonspec.ops._library import recording
    from tritonspec.specialization.resolve import use_backend

    q = torch.empty(1, 32, 1, 128, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(1, 8, 4096, 128, device="meta", dtype=torch.bfloat16)
    monkeypatch.setattr(devices, "META_COMPUTE_UNITS", 132)  # an H100's SMs: several splits
    with use_backend("nvidia"), for_arch(arch), torch.no_grad(), recording() as launches:
        attention_decode(q, k, v)
    assert [launch.kernel.fn.__name__ for launch in launches] == ["_decode_partial_kernel", "_decode_combine_kernel"]
    assert [(lc.kwargs["PDL"], lc.kwargs.get("launch_pdl", False)) for lc in launches] == [(pdl, pdl)] * 2
    # traced for torch.compile: Inductor takes no launch option but warps and stages, so neither goes
    with use_backend("nvidia"), for_arch(arch), torch.no_grad(), recording() as launches:
        decode_module._forward(q, k, v, None, None, None, 0.125, traced=True)
    assert [(lc.kwargs["PDL"], "launch_pdl" in lc.kwargs) for lc in launches] == [(False, False)] * 2


def _bad(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


_Q, _KV = _bad(1, 2, 2, 16), _bad(1, 1, 8, 16)


# The argument checks and the op's schema, on CPU tensors: interpreter sessions only (a GPU session refuses CPU
# tensors before anything else).
cpu_only = pytest.mark.skipif(not interpreting(), reason="CPU tensors: the interpreter session checks these")


@cpu_only
@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((_bad(2, 2, 16), _KV, _KV), {}, ValueError, r"argument 'q' must have 4 dimensions"),
        ((_Q, [1], _KV), {}, TypeError, r"argument 'k' must be a torch.Tensor"),
        ((_Q, _KV.half(), _KV), {}, TypeError, r"argument 'k' has dtype torch.float16 but 'q' has torch.float32"),
        ((_Q.double(), _KV.double(), _KV.double()), {}, TypeError, r"argument 'q' has dtype torch.float64"),
        ((_bad(1, 3, 2, 16), _bad(1, 2, 8, 16), _bad(1, 2, 8, 16)), {}, ValueError, r"'q' has 3 heads, which is not"),
        ((_Q, _bad(1, 1, 8, 32), _bad(1, 1, 8, 32)), {}, ValueError, r"argument 'k' has head_dim 32 but 'q' has 16"),
        ((_Q, _KV, _bad(1, 1, 9, 16)), {}, ValueError, r"'k' and 'v' must have the same shape"),
        ((_Q, _bad(2, 1, 8, 16), _bad(2, 1, 8, 16)), {}, ValueError, r"argument 'k' has batch 2 but 'q' has 1"),
        ((_bad(1, 1, 2, 300), _bad(1, 1, 8, 300), _bad(1, 1, 8, 300)), {}, ValueError, r"'q' has head_dim 300"),
        ((_bad(1, 2, 17, 16), _KV, _KV), {}, ValueError, r"argument 'q' has seq_q = 17; supported are 1..16"),
        ((_bad(1, 2, 0, 16), _KV, _KV), {}, ValueError, r"argument 'q' has seq_q = 0"),
        ((_Q, _KV, _KV), {"scale": float("inf")}, ValueError, r"argument 'scale' must be a finite non-zero"),
        ((_Q, _KV, _KV), {"scale": 0.0}, ValueError, r"argument 'scale' must be a finite non-zero"),
        ((_Q, _KV, _KV), {"scale": "0.5"}, ValueError, r"argument 'scale' must be a finite non-zero"),
        ((_Q, _KV, _KV), {"mask": [True]}, TypeError, r"argument 'mask' must be a torch.Tensor"),
        (
            (_Q, _KV, _KV),
            {"mask": torch.ones(1, 1, 2, 8)},
            ValueError,
            r"argument 'mask' must be a bool tensor \(True: attend\) broadcastable to \(batch, 1, seq_q, seq_k\) = "
            r"\(1, 1, 2, 8\), got torch.float32",
        ),
        ((_Q, _KV, _KV), {"mask": torch.ones(1, 1, 2, 9, dtype=torch.bool)}, ValueError, r"'mask' must be a bool"),
        ((_Q, _KV, _KV), {"mask": torch.ones(1, 2, 2, 8, dtype=torch.bool)}, ValueError, r"'mask' must be a bool"),
        ((_Q, _KV, _KV), {"mask": torch.ones(1, 1, 1, 2, 8, dtype=torch.bool)}, ValueError, r"'mask' must be a bool"),
        (
            (_Q, _KV, _KV),
            {"mask": torch.ones(1, 1, 2, 8, dtype=torch.bool), "key_bounds": torch.zeros(2, 1, 2, dtype=torch.int32)},
            ValueError,
            r"arguments 'mask' and 'key_bounds' exclude each other",
        ),
        (
            (_Q, _KV, _KV),
            {"key_bounds": torch.zeros(2, 1, 3, dtype=torch.int32)},
            ValueError,
            r"argument 'key_bounds' must be an int32 or int64 tensor of shape \(2, batch, seq_q\) = \(2, 1, 2\)",
        ),
        ((_Q, _KV, _KV), {"key_bounds": torch.zeros(2, 1, 2)}, ValueError, r"argument 'key_bounds' must be an int32"),
        ((_Q, _KV, _KV), {"key_bounds": (0, 8)}, TypeError, r"argument 'key_bounds' must be a torch.Tensor"),
        (
            (_Q, _KV, _KV),
            {"sinks": _bad(3)},
            ValueError,
            r"argument 'sinks' must be a floating-point tensor of shape \(heads_q,\) = \(2,\)",
        ),
        ((_Q, _KV, _KV), {"sinks": _bad(1, 2)}, ValueError, r"argument 'sinks' must have 1 dimensions"),
        ((_Q, _KV, _KV), {"sinks": torch.zeros(2, dtype=torch.int32)}, TypeError, r"argument 'sinks' has dtype"),
    ],
)
def test_bad_inputs_raise(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        attention_decode(*args, **kwargs)


@cpu_only
def test_devices_must_match():
    x = _bad(1, 1, 1, 16)
    with pytest.raises(ValueError, match=r"argument 'mask' is on meta but 'q' is on cpu"):
        attention_decode(x, x, x, mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device="meta"))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    no_interpreter(monkeypatch)
    x = _bad(1, 1, 1, 16)
    with pytest.raises(ValueError, match="argument 'q' is on the CPU"):
        attention_decode(x, x, x)


@pytest.mark.parametrize("name", ["q", "k", "v", "sinks"])
def test_gradients_are_refused_by_name(name, device, gen):
    q, k, v = _inputs(gen, 1, 2, 1, 1, 8, 16, _dtypes(device)[0], device)
    args = dict(q=q, k=k, v=v, sinks=_rand(gen, 2, device=device))
    args[name].requires_grad_()
    with pytest.raises(RuntimeError, match=rf"argument '{name}' requires grad.*use tritonspec.ops.attention"):
        attention_decode(args["q"], args["k"], args["v"], sinks=args["sinks"])
    with torch.no_grad():  # without grad mode, the same tensors are fine
        out = attention_decode(args["q"], args["k"], args["v"], sinks=args["sinks"])
    assert not out.requires_grad


def test_default_scale_is_inverse_sqrt_head_dim(device, gen):
    q, k, v = _inputs(gen, 1, 2, 1, 2, 20, 32, _dtypes(device)[0], device)
    assert torch.equal(attention_decode(q, k, v), attention_decode(q, k, v, scale=1 / math.sqrt(32)))


@cpu_only
def test_library_op_schema_and_opcheck(gen):
    assert str(torch.ops.tritonspec.attention_decode.default._schema) == (
        "tritonspec::attention_decode(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? key_bounds, "
        "Tensor? sinks, float scale) -> Tensor"
    )
    q, k, v = _inputs(gen, 1, 2, 1, 2, 20, 16, torch.float32, "cpu")
    keep = (torch.rand(1, 1, 2, 20, generator=gen) > 0.5).expand(1, 1, 2, 20)
    torch.library.opcheck(decode_module.ATTENTION_DECODE, (q, k, v, keep, None, torch.randn(2), 0.25))


@pytest.mark.parametrize("config", ["direct", "split"])
def test_torch_compile_fullgraph(config, device, gen, use_configs, monkeypatch):
    """One graph, no break: the op is a torch.library op; the same result as the eager call."""
    q, k, v = _inputs(gen, 2, 4, 2, 3, 50, 16, _dtypes(device)[0], device)
    keep = torch.rand(2, 1, 3, 50, generator=gen).to(device) > 0.4
    sinks = _rand(gen, 4, device=device)

    def step(q, k, v, keep, sinks):
        return attention_decode(q * 0.5, k, v, mask=keep, sinks=sinks).transpose(1, 2).contiguous() + 1

    with use_configs(config), torch.no_grad():
        eager = step(q, k, v, keep, sinks)
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, keep, sinks)
    assert torch.equal(compiled, eager)
    _check(eager.sub(1).transpose(1, 2), reference(q * 0.5, k, v, keep, sinks=sinks), q, v)


def test_max_queries_is_the_documented_bound():
    assert MAX_QUERIES == 16


def compile_as_inductor_types_it():
    """Subprocess (compiled, not interpreted): the decode kernels of a masked GQA step, bound as a launch binds
    them, compiled for sm90 with every float argument typed fp64, as Inductor types Python floats in the Triton
    kernels of a triton_op. The softmax must stay fp32 there (an fp64 scale once broke the kernel's tl.dot)."""
    from offline import run_checks
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    import triton
    from tritonspec import devices
    from tritonspec.kernel_check import _bind
    from tritonspec.launch import for_arch
    from tritonspec.ops._library import recording
    from tritonspec.specialization.resolve import use_backend

    def check():
        q = torch.empty(1, 32, 1, 128, device="meta", dtype=torch.bfloat16)
        k = v = torch.empty(1, 8, 4096, 128, device="meta", dtype=torch.bfloat16)
        mask = torch.empty(1, 1, 1, 4096, device="meta", dtype=torch.bool)
        units, devices.META_COMPUTE_UNITS = devices.META_COMPUTE_UNITS, 132  # an H100's SMs: several splits
        try:  # the nvidia table's sm90 configs: programmatic dependent launch's waits compile too
            with use_backend("nvidia"), for_arch(90), torch.no_grad(), recording() as launches:
                attention_decode(q, k, v, mask=mask)
        finally:
            devices.META_COMPUTE_UNITS = units
        target = GPUTarget("cuda", 90, 32)
        compiler = make_backend(target)
        assert {launch.kernel.fn.__name__ for launch in launches} == {
            "_decode_partial_kernel",
            "_decode_combine_kernel",
        }
        assert all(launch.kwargs["PDL"] for launch in launches)
        for launch in launches:
            c = _bind(compiler, launch)
            signature = {name: "fp64" if kind == "fp32" else kind for name, kind in c.signature.items()}
            assert signature != c.signature or launch.kernel.fn.__name__ != "_decode_partial_kernel"
            triton.compile(ASTSource(c.kernel, signature, c.constexprs, c.attrs), target=target, options=c.options)

    run_checks({"fp64 scalars": check})


@pytest.mark.skipif(not interpreting(), reason="runs the compile in a subprocess from the interpreted session")
def test_the_kernels_compile_with_fp64_scalars_as_inductor_passes_them():
    from offline import run_without_interpreter

    results = run_without_interpreter("test_attention_decode", "compile_as_inductor_types_it", timeout=600)
    assert results == {"fp64 scalars": "ok"}, results
