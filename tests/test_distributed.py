"""tritonspec.distributed on gloo, 2 CPU processes: FSDP2 and expert parallelism against one process.

Every distributed run is compared with the single-process run of the same model (same seed, same random
weights) on the same global batch: each rank takes its half of the batch, and the averaged loss and every
gradient (FSDP2's shards gathered with ``full_tensor``; an expert-parallel rank's experts against its slice
of the single-process experts' gradients) must match. The model's kernels run on the Triton interpreter in
both runs, so the only difference is where sums are split: see ``_close`` for the tolerance.

The dispatch/combine test is exact: integer-valued float64 rows and weights, so every routed row, its
expert's local id, the combined output and the backward's gradients are checked for equality.
"""

import functools
import importlib
import socket
import time

import pytest
from helpers import RULES, build_model, py_random
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tritonspec.nn as tnn

transformers = pytest.importorskip("transformers")

WORLD = 2
DEADLINE_S = 300  # a hang guard (a collective mismatch never returns), far above the slowest run
SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
)
BATCH, SEQ = 4, 8  # global batch: each rank runs BATCH // WORLD sequences
MOE_RULES = """
- match: {class: transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts, kernel: moe}
  replace: {kernel: moe}
- match: {name: "norm$", class: torch.nn.modules.module.Module}
  replace: {class: tritonspec.nn.RMSNorm}
"""


# -- process plumbing --------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, port, args):
    torch.set_num_threads(1)  # 2 processes on 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
        # both ranks past every collective before either tears gloo down: a rank closing its pairs
        # while the other still used them aborted a CI run (SIGABRT, "terminate called without an
        # active exception"; the same seed replayed clean)
        dist.barrier()
    except BaseException as e:  # pytest's Failed (from pytest.raises) is no Exception: spawn would drop it
        raise RuntimeError(f"rank {rank}: {type(e).__name__}: {e}") from e
    finally:
        dist.destroy_process_group()


def _spawn(fn, *args):
    """Run ``fn(rank, *args)`` on WORLD gloo processes; a rank's exception fails the test, a hang times out."""
    ctx = mp.start_processes(_entry, args=(fn, _free_port(), args), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed test did not finish in {DEADLINE_S} s (a collective mismatch hangs)")


@functools.cache
def _seed():
    return py_random().randrange(2**31)  # this run's seed (printed; TRITONSPEC_TEST_SEED replays it)


# -- model steps -------------------------------------------------------------------------------------------


def _model(name, seed, front_end=None, moe=None, **sizes):
    model = build_model(name, torch.float32, seed=seed, moe=moe, **dict(SIZES, **sizes))
    if front_end == "kernelize":
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    elif front_end == "registry":
        tnn.apply_available_kernels(model)
    elif front_end == "rules":
        tnn.apply_rules(model, MOE_RULES if name == "qwen3_moe" else RULES)
    if front_end is not None:
        assert tnn.report(model), front_end
    return model


def _batch(seed, vocab=SIZES["vocab_size"]):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))


def _step(model, ids, call=None, distributed=True):
    """(loss, {name: grad}) of one step; distributed: the loss averaged over ranks, gradients gathered whole."""
    model.zero_grad(set_to_none=True)
    loss = (model if call is None else call)(input_ids=ids, labels=ids).loss
    loss.backward()
    loss = loss.detach()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone()
    if distributed:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss, grads


def _local(ids, rank):
    per = ids.shape[0] // WORLD
    return ids[rank * per : (rank + 1) * per]


def _close(what, got, want, rel=1e-5):
    """float32 runs that differ only in how sums are split: each rank's loss is a mean over its half of the
    batch and FSDP averages the halves (gloo reduce-scatter in float32); expert gradients sum the same token
    contributions grouped by rank. A reordered float32 sum of n terms moves by at most about n * eps times the
    sum of |terms|; with at most a few hundred terms of one sign-mixed tensor that stays far under 1e-5 of the
    tensor's largest entry (~80 eps), while a lost token, a missing shard or a gradient averaged over the
    wrong number of ranks is off by O(1) of it."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    tol = rel * max(want.abs().max().item() if want.numel() else 0.0, 1e-6)
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def _compare(tag, got, want, expert_slice=None):
    (loss, grads), (ref_loss, ref_grads) = got, want
    _close(f"{tag} loss", loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), tag
    for n, g in grads.items():
        r = ref_grads[n]
        if expert_slice is not None and n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            r = r[expert_slice]
        _close(f"{tag} grad {n}", g, r)


class _Counted:
    """Counts calls of the op ``attr`` of module ``modules[0]`` in this process, also where the other modules
    imported it by name: the kernels must really run."""

    def __init__(self, attr, *modules):
        modules = [importlib.import_module(m) for m in modules]
        self.n, orig = 0, getattr(modules[0], attr)

        def counted(*a, **k):
            self.n += 1
            return orig(*a, **k)

        for m in modules:
            setattr(m, attr, counted)


# -- dispatch / combine: exact -----------------------------------------------------------------------------


def _routing(seed, rank, tokens, top_k, experts):
    """Rank ``rank``'s (ids, weights): ids in [-1, experts] (the ends are sentinels), small integer weights."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    ids = torch.randint(-1, experts + 1, (tokens, top_k), generator=g)
    return ids, torch.randint(1, 4, (tokens, top_k), generator=g).double()


def _dispatch_worker(rank, seed):
    from tritonspec.distributed import combine, dispatch

    E, K, H = 4, 3, 5
    group = dist.group.WORLD
    # (tokens on rank 0, on rank 1); case 1: rank 1 has none; case 2: rank 1 sends nothing to its own experts.
    # Empty splits must work both ways.
    for case, tokens in enumerate(((7, 4), (6, 0), (5, 3))):

        def rows(r):  # integer rows that say where they come from
            t = torch.arange(tokens[r], dtype=torch.float64)[:, None]
            return 1000 * (r + 1) + 10 * t + torch.arange(H, dtype=torch.float64)

        routes = [_routing(seed + case, r, tokens[r], K, E) for r in range(WORLD)]
        if case == 2:
            routes[1] = (routes[1][0].clamp(-1, 1), routes[1][1])
        ids, w = routes[rank]
        x = rows(rank).requires_grad_()
        w = w.clone().requires_grad_()
        got_rows, got_ids, plan = dispatch(x, ids, E, group)
        want_rows, want_ids = [], []  # the rows this rank must receive: source by source, pair order
        for src in range(WORLD):
            src_ids = routes[src][0]
            for t in range(tokens[src]):
                for j in range(K):
                    e = int(src_ids[t, j])
                    if 0 <= e < E and e // (E // WORLD) == rank:
                        want_rows.append(rows(src)[t])
                        want_ids.append(e % (E // WORLD))
        assert got_ids.tolist() == want_ids, (case, rank)
        assert torch.equal(got_rows.detach(), torch.stack(want_rows) if want_rows else torch.empty(0, H).double())
        out = combine(got_rows * (got_ids[:, None] + 1).double(), w, plan)  # "expert" e scales by e + 1
        valid = (ids >= 0) & (ids < E)
        scale = torch.where(valid, ids % (E // WORLD) + 1, 0).double()  # (T, K); sentinels: nothing
        want = ((w * scale)[:, :, None] * x[:, None, :]).sum(1)
        assert torch.equal(out.detach(), want.detach()), (case, rank)
        g = torch.arange(out.numel(), dtype=torch.float64).view_as(out) % 7 - 3
        (out * g).sum().backward()
        assert torch.equal(x.grad, (w * scale).sum(1, keepdim=True).detach() * g), (case, rank)
        assert torch.equal(w.grad, scale * (x.detach() @ g.T).diagonal()[:, None]), (case, rank)


def test_dispatch_combine_round_trip_is_exact():
    _spawn(_dispatch_worker, _seed())


# -- FSDP2: a tiny Llama through all three front ends; checkpointing, torch.compile, bf16 --------------------


def _llama_worker(rank, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tritonspec.distributed import fully_shard_model

    mesh = init_device_mesh("cpu", (WORLD,))
    ids = _batch(seed)
    rms = _Counted("rms_norm", "tritonspec.ops.rms_norm", "tritonspec.nn.modules")
    for front_end in ("kernelize", "registry", "rules"):
        want = _step(_model("llama", seed, front_end, num_hidden_layers=2), ids, distributed=False)
        model = fully_shard_model(_model("llama", seed, front_end, num_hidden_layers=2), mesh)
        calls = rms.n
        _compare(f"fsdp {front_end}", _step(model, _local(ids, rank)), want)
        assert rms.n > calls, f"{front_end}: the Triton RMSNorm did not run under FSDP2"
        if front_end != "kernelize":
            continue
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        _compare("fsdp + activation checkpointing", _step(model, _local(ids, rank)), want)
        model.activation_checkpointing_disable()
        compiled = torch.compile(model, backend="aot_eager")
        _compare("fsdp + torch.compile(aot_eager)", _step(model, _local(ids, rank), compiled), want)
    # bf16 compute, fp32 reduction: FSDP2's MixedPrecisionPolicy on the kernelized model
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fully_shard_model(_model("llama", seed, "kernelize", num_hidden_layers=2), mesh, mp_policy=mp_policy)
    loss, grads = _step(model, _local(ids, rank))
    ref_loss, ref_grads = want
    # bf16 keeps 8 bits: activations and weights rounded to 2**-8 relative move a ~4.6 loss by well under 1%.
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * abs(ref_loss.item()), (loss, ref_loss)
    for n, g in grads.items():  # gradients reduced in float32: finite, the parameters' dtype, roughly the same
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), n
        cos = torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[n].flatten(), dim=0)
        assert cos > 0.95, (n, cos.item())


def test_fsdp2_llama_front_ends_match_single_process():
    _spawn(_llama_worker, _seed())


# -- FSDP2 and FSDP2 + expert parallel: a tiny Qwen3-MoE -----------------------------------------------------

MOE = dict(num_hidden_layers=1, moe=dict(num_experts=4, moe_intermediate_size=16))


def _moe_worker(rank, seed):
    from torch.distributed.device_mesh import init_device_mesh

    from tritonspec.distributed import expert_parallel, fully_shard_model

    ids = _batch(seed)
    experts = _Counted("moe_experts", "tritonspec.ops.moe")
    per = MOE["moe"]["num_experts"] // WORLD
    mine = slice(rank * per, (rank + 1) * per)
    want = _step(_model("qwen3_moe", seed, "kernelize", **MOE), ids, distributed=False)

    # FSDP2 alone
    model = fully_shard_model(_model("qwen3_moe", seed, "kernelize", **MOE), init_device_mesh("cpu", (WORLD,)))
    _compare("fsdp", _step(model, _local(ids, rank)), want)
    assert experts.n > 0

    # expert parallel alone, forward: each rank's logits are its rows of the single-process logits; revert
    model = _model("qwen3_moe", seed, "kernelize", **MOE)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    ep_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    paths = expert_parallel(model, ep_mesh)
    assert len(paths) == MOE["num_hidden_layers"]
    with torch.no_grad():
        ref_logits = _model("qwen3_moe", seed, "kernelize", **MOE)(input_ids=ids).logits
        logits = model(input_ids=_local(ids, rank)).logits
    _close("expert parallel logits", logits, _local(ref_logits, rank))
    for p in paths:
        module = model.get_submodule(p)
        assert module.gate_up_proj.shape[0] == per and module.num_experts == per
        torch.testing.assert_close(module.down_proj, original[f"{p}.down_proj"][mine], rtol=0, atol=0)
    tnn.revert(model)
    assert not tnn.report(model)
    for n, p in model.named_parameters():
        assert torch.equal(p, original[n]), n
    assert all(model.get_submodule(p).num_experts == MOE["moe"]["num_experts"] for p in paths)

    # FSDP2 over both ranks for the dense part, experts split over the same two ranks (mesh dp=1 x ep=2)
    for front_end in ("kernelize", "registry", "rules"):
        ref = (
            want
            if front_end == "kernelize"
            else _step(_model("qwen3_moe", seed, front_end, **MOE), ids, distributed=False)
        )
        mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "ep"))
        model = _model("qwen3_moe", seed, front_end, **MOE)
        expert_parallel(model, mesh, "ep")
        fully_shard_model(model, mesh)
        calls = experts.n
        _compare(f"fsdp + ep {front_end}", _step(model, _local(ids, rank)), ref, expert_slice=mine)
        assert experts.n > calls, f"{front_end}: the Triton experts did not run on the dispatched pairs"


def test_fsdp2_and_expert_parallel_qwen3_moe_match_single_process():
    _spawn(_moe_worker, _seed())


# -- errors ------------------------------------------------------------------------------------------------


def _errors_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tritonspec import ops
    from tritonspec.distributed import expert_parallel, fully_shard_model

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    x, w = torch.randn(4, 8), torch.ones(8)
    for placement in (Shard(0), Replicate()):
        with pytest.raises(TypeError, match=r"rms_norm: argument 'x' is a DTensor .*full_tensor\(\)"):
            ops.rms_norm(distribute_tensor(x, mesh, [placement]), w)
    with pytest.raises(TypeError, match=r"rms_norm: argument 'weight' is a DTensor"):
        ops.rms_norm(x, distribute_tensor(w, mesh, [Replicate()]))
    model = _model("qwen3_moe", 0, num_hidden_layers=1, moe=dict(num_experts=3))
    with pytest.raises(ValueError, match="3 experts, not divisible by the 2 ranks"):
        expert_parallel(model, mesh)
    model = _model("qwen3_moe", 0, num_hidden_layers=1)
    expert_parallel(model, mesh)
    with pytest.raises(ValueError, match="expert dimension 'ep' and the data-parallel"):
        fully_shard_model(model, mesh)
    model.set_experts_implementation("eager")  # sharded experts have no eager path: a clear error, not ours
    with pytest.raises(RuntimeError, match=r"while it was '\w+' \(expert parallel, .*cannot follow the switch"):
        model(input_ids=torch.randint(0, 96, (1, 4)))


def test_errors():
    _spawn(_errors_worker)
