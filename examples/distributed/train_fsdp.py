"""Train a kernelized Hugging Face model with FSDP2, optionally with expert parallelism, under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 examples/distributed/train_fsdp.py --model qwen3-moe --ep 2
    python -m torch.distributed.run --nproc_per_node=2 examples/distributed/train_fsdp.py --model llama --device cpu

(``python -m torch.distributed.run`` is ``torchrun``, which is on PATH only in an activated venv.) The model is a
small one with random weights built from its config (nothing is downloaded); swap in ``from_pretrained`` for a
real one. On CPU (gloo, Triton's interpreter) it is shrunk further unless you ask for no more than the
interpreter handles quickly. Ranks form a (dp, ep) DeviceMesh: the experts are split over ``ep``, every other
parameter is sharded by FSDP2 over all ranks, and each rank trains on its own batches. Rank 0 prints the mesh,
what was kernelized and the loss of each step.
"""

import argparse
import os
import time

MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[]),
    ),
}


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="llama")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models); must divide the world size")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--front-end", choices=("kernelize", "registry"), default="kernelize")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 compute, fp32 reduction")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile the sharded model")
    return p.parse_args()


def main():
    args = parse()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shrunk = device == "cpu" and args.seq * args.batch * args.hidden > 4096
    if device == "cpu":
        # Triton kernels run on CPU through its interpreter, chosen before triton is first imported (below)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if shrunk:
            args.seq, args.batch, args.hidden = 8, 2, 32  # keep the interpreter quick
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tritonspec.nn as tnn
    from tritonspec.distributed import expert_parallel, fully_shard_model

    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the world size {world}")

    config_cls, model_cls, moe = MODELS[args.model]
    config = getattr(transformers, config_cls)(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_hidden_layers=args.layers,
        vocab_size=1024,
        max_position_embeddings=4096,
        **moe,
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    with torch.device(device):
        model = getattr(transformers, model_cls)._from_config(config, dtype=torch.float32)
    if args.front_end == "kernelize":
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    else:
        tnn.apply_available_kernels(model)

    if args.ep > 1:
        mesh = init_device_mesh(device, (world // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
        expert_parallel(model, mesh, "ep")
    else:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    if args.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    fully_shard_model(model, mesh, mp_policy=mp_policy)
    if rank == 0:
        _describe(args, device, shrunk, mesh, tnn.report(model))
    step_fn = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    data = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own batches
    for step in range(args.steps):
        start = time.perf_counter()
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device, generator=data)
        loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0:
            print(f"step {step}: loss {loss.item() / world:.4f} ({time.perf_counter() - start:.2f} s)", flush=True)
    dist.destroy_process_group()


def _describe(args, device, shrunk, mesh, report):
    """Rank 0: the run's shape, its mesh and what tritonspec replaced (counted by kernel)."""
    size = f"hidden {args.hidden}, {args.layers} layers, batch {args.batch} x seq {args.seq} per rank"
    print(f"{args.model} on {device}: {size}" + (" (shrunk for the CPU interpreter)" if shrunk else ""))
    print(f"mesh: {mesh}")
    how = args.front_end + (", expert_parallel" if args.ep > 1 else "")
    print(f"tritonspec.nn.report(model) ({how}): {len(report)} changes")
    for kernel, n in sorted(report.counts().items()):
        print(f"  {n:3d} x {kernel}")


if __name__ == "__main__":
    main()
