"""One training step (forward + backward + AdamW) of a Llama-style or Qwen3-MoE-style model: eager Hugging Face
vs kernelized.

Not a test: it measures. Variants, all bf16, same weights and batch:
  hf-sdpa          transformers as shipped (attn_implementation="sdpa"; MoE experts: grouped_mm), the baseline
  hf-eager         transformers with its eager attention
  ts-kernelize     tritonspec.nn.kernelize: Triton RMSNorm, SwiGLU, RoPE, the residual add fused into the
                   post-attention norm, the LM head fused with the loss, and for MoE models the experts and
                   the router (attention stays SDPA)
  ts-all           apply_available_kernels: the above plus attn_implementation="tritonspec"
  liger            Liger-Kernel rope/rms_norm/swiglu (no fused cross-entropy), if importable
  liger-flce       the same with Liger's fused linear cross-entropy (everything Liger offers for the model)

Method: each variant gets its own model and optimizer; WARMUP steps (Triton compiles, autotuning), then
STEPS timed steps with CUDA events, in two rounds in opposite variant order (clock drift and thermal
effects hit every variant alike); the median over both rounds is reported with p20/p80. Peak memory is
``max_memory_allocated`` over one step after ``reset_peak_memory_stats``; "step peak" subtracts what was
resident before the step (weights, grads=None, optimizer state). Before timing, every variant's first-step
loss is compared with the baseline's. MoE models train with ``output_router_logits`` (the auxiliary
load-balancing loss is in the loss).

With --packed, each row of the batch holds several sequences (lengths uniform in [seq/4, seq], the last cut at
the row's end) and the model gets ``position_ids`` that restart at each, as packing collators
(``DataCollatorWithFlattening``, LLaMA-Factory's packing) hand them over, with ``use_cache=False`` as training
frameworks set it (with a cache transformers does not mask the packing): transformers then masks across
sequences (a dense 4-D mask for SDPA), and our attention takes each query's key interval.

With --profile, one more step per variant runs under the torch profiler: its GPU time by kernel class
(attention forward / backward per layer, copies and layout changes, the rest), so an attention that makes the step
slower, or copies around it, show.

Usage: python bench/bench_training_step.py [--model llama|qwen3-moe] [--hidden 2048 --layers 8 --batch 4
       --seq 2048 --packed --profile --out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import statistics
import sys
import time

import torch
from harness import emit


MODULES = {
    "llama": "transformers.models.llama.modeling_llama",
    "qwen3-moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
}


def build(args, attn):
    import transformers

    common = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(4096, args.seq),
    )
    if args.model == "qwen3-moe":  # Qwen3-30B-A3B's layer: 128 experts of 768, top-8, head_dim 128
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=args.intermediate,
            head_dim=128,
            moe_intermediate_size=args.moe_intermediate,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            norm_topk_prob=True,
            output_router_logits=True,
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common, intermediate_size=args.intermediate)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(args.device):
        return cls._from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)


def prepare(name, args):
    import tritonspec.nn as tnn

    if name == "hf-sdpa":
        return build(args, "sdpa")
    if name == "hf-eager":
        return build(args, "eager")
    if name == "ts-kernelize":
        model = build(args, "sdpa")
        tnn.kernelize(model, mode=tnn.Mode.TRAINING)
        return model
    if name == "ts-all":
        model = build(args, "sdpa")
        tnn.apply_available_kernels(model)
        return model
    if name in ("liger", "liger-flce"):
        import liger_kernel.transformers as lk

        apply = lk.apply_liger_kernel_to_qwen3_moe if args.model == "qwen3-moe" else lk.apply_liger_kernel_to_llama
        model = build(args, "sdpa")
        apply(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=name == "liger-flce",
            model=model,
        )
        return model
    raise ValueError(name)


def packed_positions(batch: int, seq: int, g: torch.Generator, device) -> torch.Tensor:
    """(batch, seq) position_ids restarting at each packed sequence: lengths uniform in [seq/4, seq]."""
    rows = []
    for _ in range(batch):
        pos, n = [], 0
        while n < seq:
            length = min(int(torch.randint(seq // 4, seq + 1, (1,), generator=g)), seq - n)
            pos.append(torch.arange(length))
            n += length
        rows.append(torch.cat(pos))
    return torch.stack(rows).to(device)


class Variant:
    def __init__(self, name, args, ids, positions=None):
        import importlib

        modeling = importlib.import_module(MODULES[args.model])
        self.name, self.ids, self.positions = name, ids, positions
        # Liger rebinds the modeling module's globals (classes, apply_rotary_pos_emb); put them back on release
        # so variants built later are not silently Liger models.
        self._globals = (modeling, dict(vars(modeling)))
        try:
            self.model = prepare(name, args)
        except BaseException:
            self._restore_globals()
            raise
        if name.startswith("ts-"):  # what the front end installed (a kernel that did not apply is absent)
            import tritonspec.nn as tnn

            counts = tnn.report(self.model).counts()
            print(
                f"{name}: " + ", ".join(f"{k.rsplit('.', 2)[-2]} x{n}" for k, n in sorted(counts.items())), flush=True
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)
        self.times: list[float] = []

    def step(self):
        # packed: no cache, as training frameworks run (transformers masks the packing only then)
        packed = {} if self.positions is None else dict(position_ids=self.positions, use_cache=False)
        loss = self.model(input_ids=self.ids, labels=self.ids, **packed).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def release(self):
        del self.model, self.opt
        self._restore_globals()

    def _restore_globals(self):
        mod, saved = self._globals
        for k in set(vars(mod)) - set(saved):
            delattr(mod, k)
        for k, val in saved.items():
            if vars(mod).get(k) is not val:
                setattr(mod, k, val)


def timed(v: Variant, steps: int):
    for _ in range(steps):
        if not torch.cuda.is_available():  # CPU smoke runs of this script (interpreter): wall clock
            t0 = time.perf_counter()
            v.step()
            v.times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        v.step()
        end.record()
        torch.cuda.synchronize()
        v.times.append(start.elapsed_time(end))


# kernel classes of the profile, by name: attention backward before forward (cuDNN's names hold "flash"
# in both); the copies are what .contiguous(), reshape of a transposed tensor and dtype casts launch
_ATTN_BWD = ("_attn_bwd", "bprop", "flash_bwd", "fmha_bwd", "dot_product_attention_bwd", "efficient_attention_backward")
_ATTN_FWD = ("_attn_fwd", "fprop", "flash_fwd", "fmha_fwd", "efficient_attention_forward", "sdpa")
_COPY = ("direct_copy", "copy_kernel", "CatArrayBatchedCopy", "contiguous")


def profile_step(v: Variant, layers: int) -> dict:
    """GPU ms of one step by kernel class; attention per layer. Names of the copy kernels seen are kept."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        v.step()
        torch.cuda.synchronize()
    out = {"attn_fwd": 0.0, "attn_bwd": 0.0, "copy": 0.0, "total": 0.0, "copy_kernels": {}}
    for evt in prof.key_averages():
        ms = (getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)) / 1e3
        if not ms or evt.key.startswith(("ProfilerStep", "cudaDeviceSynchronize")) or evt.device_type.name != "CUDA":
            continue
        out["total"] += ms
        name = evt.key
        if any(t in name for t in _ATTN_BWD):
            out["attn_bwd"] += ms
        elif any(t in name for t in _ATTN_FWD):
            out["attn_fwd"] += ms
        elif any(t in name for t in _COPY):
            out["copy"] += ms
            out["copy_kernels"][name[:80]] = round(ms, 3)
    out["attn_fwd_layer"] = out["attn_fwd"] / layers
    out["attn_bwd_layer"] = out["attn_bwd"] / layers
    return out


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODULES), default="llama")
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--variants", default="hf-sdpa,hf-eager,ts-kernelize,ts-all,liger")
    p.add_argument("--out", default=None, help="markdown file to write the table to")
    p.add_argument("--profile", action="store_true", help="one profiled step per variant: attention ms per layer")
    p.add_argument("--device", default="cuda", help="cpu only for smoke runs (TRITON_INTERPRET=1)")
    p.add_argument("--packed", action="store_true", help="rows of packed sequences, position_ids restarting")
    args = p.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA GPU"
    else:  # smoke run: make the memory calls harmless
        for fn in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            setattr(torch.cuda, fn, lambda *a, **k: None)
        torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a, **k: 0

    import transformers
    import triton

    g = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device, generator=g)
    positions = (
        packed_positions(args.batch, args.seq, torch.Generator().manual_seed(1), args.device) if args.packed else None
    )

    results, notes, names = {}, [], []
    # Round 1: first-step loss, peak memory, timing. Round 2, in reverse order: timing again. Only one
    # variant is resident at a time.
    for name in args.variants.split(","):
        v = None
        try:
            v = Variant(name, args, ids, positions)
            first_loss = v.step().item()
            for _ in range(args.warmup - 1):
                v.step()
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            v.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            timed(v, args.steps)
            prof = profile_step(v, args.layers) if args.profile and torch.cuda.is_available() else None
        except Exception as e:  # an optional baseline (liger) may not import; a failing variant is reported
            notes.append(f"{name}: failed or skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            print(notes[-1], flush=True)
        else:
            results[name] = {
                "loss": first_loss,
                "peak": peak,
                "step_peak": peak - resident,
                "times": v.times,
                "profile": prof,
            }
            names.append(name)
            print(
                f"{name}: first loss {first_loss:.5f}, peak {peak / 2**30:.2f} GiB, "
                f"median {statistics.median(v.times):.1f} ms",
                flush=True,
            )
        if v is not None:
            v.release()
        del v
        gc.collect()
        torch.cuda.empty_cache()
    for name in names[::-1]:
        v = Variant(name, args, ids, positions)
        for _ in range(args.warmup):
            v.step()
        torch.cuda.synchronize()
        timed(v, args.steps)
        results[name]["times"] += v.times
        v.release()
        del v
        gc.collect()
        torch.cuda.empty_cache()

    base = results.get("hf-sdpa")
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or 'cpu'} (smoke run)"
    tokens = args.batch * args.seq
    lines = [
        f"## One training step, {'Qwen3-MoE' if args.model == 'qwen3-moe' else 'Llama'}-style bf16 (hidden "
        f"{args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
        + (
            f"{args.experts} experts of {args.moe_intermediate}, top-{args.top_k}, "
            if args.model == "qwen3-moe"
            else f"intermediate {args.intermediate}, "
        )
        + f"vocab {args.vocab}), "
        f"batch {args.batch} x seq {args.seq}" + (" of packed sequences" if args.packed else ""),
        "",
        f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}, transformers "
        f"{transformers.__version__}, python {platform.python_version()}; date {datetime.date.today()} "
        f"(run by bench/bench_training_step.py, AdamW, {args.warmup} warmup + 2x{args.steps} timed steps).",
        "",
        "| variant | step ms (median) | p20-p80 ms | tokens/s | speedup vs hf-sdpa | peak GiB | step peak GiB "
        "| memory vs hf-sdpa | first-step loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        r = results[name]
        med = statistics.median(r["times"])
        sp = statistics.median(base["times"]) / med if base else float("nan")
        mem = r["peak"] / base["peak"] if base and base["peak"] else float("nan")
        lines.append(
            f"| {name} | {med:.1f} | {quantile(r['times'], 0.2):.1f}-{quantile(r['times'], 0.8):.1f} | "
            f"{tokens / med * 1e3:,.0f} | {sp:.3f}x | {r['peak'] / 2**30:.2f} | "
            f"{r['step_peak'] / 2**30:.2f} | {mem:.3f}x | {r['loss']:.5f} |"
        )
    if any(results[n]["profile"] for n in names):
        lines += [
            "",
            "Profile of one step (GPU ms, torch profiler; attention per layer):",
            "",
            "| variant | attention fwd ms/layer | attention bwd ms/layer | copy and cast kernels ms | all kernels ms |",
            "|---|---|---|---|---|",
        ]
        for name in names:
            pr = results[name]["profile"]
            if pr:
                lines.append(
                    f"| {name} | {pr['attn_fwd_layer']:.3f} | {pr['attn_bwd_layer']:.3f} | {pr['copy']:.2f} | "
                    f"{pr['total']:.1f} |"
                )
        for name in names:
            pr = results[name]["profile"]
            if pr and pr["copy_kernels"]:
                lines.append(f"- {name} copies: " + "; ".join(f"{k} {ms} ms" for k, ms in pr["copy_kernels"].items()))
    lines += [""] + [f"- {n}" for n in notes]
    table = "\n".join(lines) + "\n"
    emit(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
