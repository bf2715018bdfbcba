"""Training on torch.distributed: a Qwen3-MoE-style model under FSDP2, stock vs kernelized vs expert-parallel.

Why: ``examples/distributed/train_fsdp.py`` shows that tritonspec's kernels and ``tritonspec.distributed`` train
under FSDP2 and expert parallelism; this measures what they buy on several GPUs (the numbers so far were taken ad
hoc on 2x and 4x H200). The model is transformers' Qwen3MoeForCausalLM with random weights, built from its config
here (nothing is downloaded): Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8,
vocab 151936), 4 layers, 2 x 2048 tokens per GPU, FSDP2 with bf16 compute over fp32 weights and fp32 gradient
reduction. Variants, one after another in one process group, only one resident at a time:

  hf-fsdp     (a) transformers as shipped (SDPA attention, grouped_mm experts): fully_shard per decoder layer, root
  ts-fsdp     (b) tritonspec.nn.kernelize(mode=TRAINING) + tritonspec.distributed.fully_shard_model
  ts-ep       (c) the same with the experts split over all N ranks: expert_parallel on a (dp=1, ep=N) mesh
  ts-dp2-ep   (d) the same on a (dp=2, ep=N/2) mesh (N >= 4, even)

Default: every variant that applies; ts-ep from 4 ranks, on fewer only when named (or in the CPU smoke run).
Method: per variant, WARMUP steps (Triton compiles, autotuning), then STEPS timed steps of forward + loss + backward
+ AdamW (fused where available), wall clock between torch.cuda.synchronize() calls. tok/s/GPU: the mean over ranks
of tokens per rank / mean step time. peak GiB: the largest torch.cuda.max_memory_allocated over ranks during the
steps (reset once the model is sharded and its optimizer made). step-0 loss: the first step's loss, averaged over
ranks. Every variant starts from the same weights (seed 0) and every rank draws the same batches in every variant
(seed 1000 + rank), so the step-0 losses must agree up to bf16 noise. A variant that cannot run on this many ranks
is skipped with the reason; one that fails ends the run after printing the rows done (the other ranks would wait in
a collective for good).

Usage (on a lent GPU machine, after ``source bench/gpu_env.sh``):
  python -m torch.distributed.run --nproc_per_node=2 bench/bench_distributed.py --variants hf-fsdp,ts-fsdp,ts-ep
  python -m torch.distributed.run --nproc_per_node=4 bench/bench_distributed.py
  [--variants a,b,c,d --steps 10 --warmup 3 --layers 4 --seq 2048 --batch 2 --experts 128 --out FILE.md]
Smoke run of this script on CPU (tiny model, gloo, the Triton interpreter):
  TRITON_INTERPRET=1 python -m torch.distributed.run --nproc_per_node=2 bench/bench_distributed.py --device cpu \\
      --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time
import traceback


def _cpu_requested(argv):
    return any(a == "--device=cpu" or (a == "--device" and argv[i + 1 : i + 2] == ["cpu"]) for i, a in enumerate(argv))


if _cpu_requested(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the lent machines' rule)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import emit  # noqa: E402

VARIANTS = ("hf-fsdp", "ts-fsdp", "ts-ep", "ts-dp2-ep")
ALIASES = {"a": "hf-fsdp", "b": "ts-fsdp", "c": "ts-ep", "d": "ts-dp2-ep"}
# Qwen3-30B-A3B's layer; every layer sparse (mlp_only_layers=[]), so intermediate_size (2 * hidden, as in
# examples/distributed/train_fsdp.py) is never used
SHAPES = {
    "cuda": dict(
        layers=4,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        experts=128,
        top_k=8,
        moe_intermediate=768,
        vocab=151936,
        seq=2048,
        batch=2,
        warmup=3,
        steps=10,
    ),
    "cpu": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=8,
        top_k=2,
        moe_intermediate=32,
        vocab=1000,
        seq=32,
        batch=2,
        warmup=0,
        steps=1,
    ),
}


def parse():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # --device is read before argparse runs: no abbreviations
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma list of {', '.join(VARIANTS)} (or a, b, c, d); default: every one that applies",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; cpu 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; cpu 0)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; cpu 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; cpu 32)")
    p.add_argument("--batch", type=int, default=None, help="sequences per GPU (default 2)")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (default 128; cpu 8)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: smoke run of this script (tiny model, gloo, TRITON_INTERPRET=1)",
    )
    p.add_argument("--out", default=None, help="markdown file to write the table to")
    args = p.parse_args()
    for k, v in SHAPES[args.device].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    if args.variants is not None:
        names = [ALIASES.get(n.strip(), n.strip()) for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown or not names:
            p.error(
                f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose from "
                f"{', '.join(VARIANTS)} or a, b, c, d"
            )
        args.variants = list(dict.fromkeys(names))
    return args


def plan(args, world: int) -> tuple[list[tuple[str, tuple, tuple]], list[str]]:
    """The variants to run as (name, mesh shape, mesh dim names), and a reason for each one skipped."""
    asked = args.variants is not None
    runs, skipped = [], []
    for name in args.variants or VARIANTS:
        if name in ("hf-fsdp", "ts-fsdp"):
            runs.append((name, (world,), ("dp",)))
            continue
        ep = world if name == "ts-ep" else world // 2
        if name == "ts-ep" and world < 2:
            skipped.append(f"{name}: expert parallel needs at least 2 ranks; this run has {world}")
        elif name == "ts-ep" and world < 4 and not asked and args.device == "cuda":
            skipped.append(f"{name}: under 4 GPUs only when named (--variants hf-fsdp,ts-fsdp,ts-ep runs ep={world})")
        elif name == "ts-dp2-ep" and (world < 4 or world % 2):
            skipped.append(f"{name}: needs an even number of ranks, at least 4 (dp=2 x ep=N/2); this run has {world}")
        elif name == "ts-dp2-ep" and args.device == "cpu":  # dp > 1: the experts' gradients are reduce-scattered
            skipped.append(
                f"{name}: not on gloo: fully_shard_model divides the experts' gradients by the mesh size, "
                "so FSDP2 reduce-scatters them with ReduceOp.PREMUL_SUM, which gloo lacks (NCCL has it)"
            )
        elif args.experts % ep:
            skipped.append(f"{name}: {args.experts} experts cannot be split evenly over ep={ep} ranks")
        else:
            runs.append((name, (world // ep, ep), ("dp", "ep")))
    return runs, skipped


def model_config(args):
    import transformers

    return transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_hidden_layers=args.layers,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq),
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        mlp_only_layers=[],
        norm_topk_prob=True,
        use_cache=False,
    )


def build(config, device):
    """The same random weights on every rank and in every variant; fp32 (FSDP2 computes in bf16)."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.float32)
    return model.train()


def optimizer(model):
    """AdamW, fused where this torch has it for these parameters (FSDP2's DTensors), else foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=1e-5, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-5, foreach=True), "foreach"


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(name, shape, dim_names, args, config, device, rank):
    """Build, shard, train; this rank's (tokens/s, peak bytes, step-0 loss, mean step s, optimizer kind, note)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import tritonspec.nn as tnn
    from tritonspec.distributed import expert_parallel, fully_shard_model

    mesh = init_device_mesh(device, shape, mesh_dim_names=dim_names)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build(config, device)
    note = None
    if name == "hf-fsdp":
        note = (
            f"hf-fsdp: attention {model.config._attn_implementation}, experts "
            f"{getattr(model.config, '_experts_implementation', '?')}"
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    else:
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
        if rank == 0:  # what the front end installed (a kernel that did not apply is absent)
            counts = tnn.report(model).counts()
            print(
                f"{name}: " + ", ".join(f"{k.rsplit('.', 2)[-2]} x{n}" for k, n in sorted(counts.items())), flush=True
            )
        if "ep" in dim_names:
            expert_parallel(model, mesh, "ep")
        fully_shard_model(model, mesh, mp_policy=mp_policy)
    opt, opt_kind = optimizer(model)
    data = torch.Generator(device=device).manual_seed(1000 + rank)  # this rank's batches, the same every variant

    def step():
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device, generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loss0 = None
    for _ in range(args.warmup):
        loss = step()
        loss0 = loss if loss0 is None else loss0
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
        loss0 = loss if loss0 is None else loss0
    sync(device)
    step_s = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return args.batch * args.seq / step_s, peak, loss0.float().item(), step_s, opt_kind, note  # model, opt freed


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def table(args, config, device, world, rows, notes, opt_kind):
    import transformers
    import triton

    dev = (
        f"{torch.cuda.get_device_name()} x {world}"
        if device == "cuda"
        else f"{platform.processor() or 'cpu'}, {world} ranks (gloo, Triton interpreter: smoke run)"
    )
    lines = [
        f"## Training on torch.distributed: Qwen3-MoE-style, random weights ({config.num_hidden_layers} layers, "
        f"hidden {config.hidden_size}, {config.num_attention_heads}/{config.num_key_value_heads} heads of "
        f"{config.head_dim}, {config.num_experts} experts of {config.moe_intermediate_size}, "
        f"top-{config.num_experts_per_tok}, vocab {config.vocab_size}), {args.batch} x {args.seq} tokens per GPU",
        "",
        f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}; date {datetime.date.today()} (bench/bench_distributed.py: FSDP2 bf16 "
        f"params / fp32 reduce, AdamW ({opt_kind}), {args.warmup} warmup + {args.steps} timed steps; "
        f"peak GiB: the largest rank's).",
        "",
        "| variant | mesh | tok/s/GPU | peak GiB | step-0 loss |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak'] / 2**30:.2f}" if device == "cuda" else "-"
        lines.append(f"| {r['name']} | {r['mesh']} | {r['tok_s']:,.0f} | {peak} | {r['loss']:.5f} |")
    if len(rows) > 1:
        ref = rows[0]
        worst = max(abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) for r in rows[1:])
        notes = [f"step-0 losses: largest relative difference to {ref['name']} {worst:.2e}"] + notes
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main():
    args = parse()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_distributed: no CUDA GPU here; --device cpu runs the smoke run")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench_distributed: --device cpu needs TRITON_INTERPRET=1")
    device = args.device
    if device == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(args)
    runs, notes = plan(args, world)
    notes = [f"skipped {n}" for n in notes]
    if rank == 0:
        for n in notes:
            print(n, flush=True)
        if not runs:
            print("bench_distributed: no variant to run", flush=True)
    rows, opt_kinds = [], set()
    for name, shape, dim_names in runs:
        mesh_text = " x ".join(f"{d}={s}" for d, s in zip(dim_names, shape))
        try:
            tok_s, peak, loss0, step_s, opt_kind, note = run_variant(name, shape, dim_names, args, config, device, rank)
        except Exception as e:  # the other ranks may sit in a collective this rank never joins: end the run
            print(
                f"rank {rank}: {name} ({mesh_text}) failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                file=sys.stderr,
                flush=True,
            )
            traceback.print_exc()
            if rank == 0:
                failed = notes + [f"{name}: failed on rank 0 ({type(e).__name__}); the run ends here"]
                print(table(args, config, device, world, rows, failed, "/".join(sorted(opt_kinds)) or "-"), flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        free(device)
        opt_kinds.add(opt_kind)
        notes += [note] if note else []
        t = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        sums = torch.tensor([tok_s, loss0], dtype=torch.float64, device=t)
        maxes = torch.tensor([peak, step_s], dtype=torch.float64, device=t)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        row = dict(
            name=name,
            mesh=mesh_text,
            tok_s=sums[0].item() / world,
            loss=sums[1].item() / world,
            peak=maxes[0].item(),
            slowest_ms=maxes[1].item() * 1e3,
        )
        rows.append(row)
        if rank == 0:
            print(
                f"{name} ({mesh_text}): step-0 loss {row['loss']:.5f}, {row['tok_s']:,.0f} tok/s/GPU, "
                f"slowest rank {row['slowest_ms']:.1f} ms/step"
                + (f", peak {row['peak'] / 2**30:.2f} GiB" if device == "cuda" else ""),
                flush=True,
            )
    if rank == 0 and rows:
        emit(table(args, config, device, world, rows, notes, "/".join(sorted(opt_kinds))), args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
