"""Greedy decode of whole models at real shapes, random weights, bf16 on one GPU: transformers against ours.

    python bench/bench_decode.py [--case qwen3-30b-a3b|llama-3-8b|all] [--batch 1,8] [--prompt 64,2048]
                                 [--new 256] [--variants hf-eager,hf-graphs,ts-eager,ts-graphs,...] [--out FILE.md]

Variants:
- ``hf-eager``: transformers' model as it is (SDPA, its experts implementation), dynamic cache.
- ``hf-graphs``: ``cache_implementation="static"`` with transformers' own compile path (its ``CompileConfig``:
  Inductor, ``mode="reduce-overhead"``, so CUDA graphs), ``fullgraph=True``.
- ``ts-eager``: ``kernelize(model, mode=Mode.INFERENCE)`` plus ``attn_implementation="tritonspec"``, dynamic cache.
- ``ts-graphs``: the same model under the same static cache and compile path as ``hf-graphs``.
- ``hf-decoder`` / ``ts-decoder``: transformers' model / ours, decoded by ``tritonspec.nn.GraphDecoder`` (one
  Inductor-compiled step captured in one CUDA graph, replayed per token; no guard check or host sync per token).
Each row's model is the same: ours is kernelized for its rows and reverted after (weights untouched).

Weights: normal(0, 0.02), norms 1, the LM head 10x wider (greedy choices then have a margin above bf16 rounding,
so the tokens of different implementations can be compared: the last column); each router's rows are rescaled
to norm 4 (logits of std ~4 after the norm layer) so the top-k is decided by the token, not by ties of
near-equal logits: routing is not degenerate.
Timing, per (batch, prompt), after a warm-up generate of both lengths below (compiles, CUDA-graph recordings):
time to first token = ``generate(max_new_tokens=1)``; decode tok/s = batch * (new - 1) / (t(new) - t(1)).
Bytes per step: every weight a step reads (the LM head; for MoE layers only the experts the batch routes to,
expected distinct experts under uniform routing), plus the KV cache read at the step's mean context; the bound
is HBM bandwidth (``--hbm``, H100: 3.0 TB/s) over those bytes. Peak GiB: ``max_memory_allocated`` during the rows.

``--smoke`` runs tiny models on the CPU interpreter (no graphs there: the static rows run eagerly).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import transformers  # noqa: E402

from harness import log, model_config, timed  # noqa: E402  bench/harness.py: this script's directory is on sys.path
from tritonspec.nn import GraphDecoder, Mode, kernelize, revert  # noqa: E402
from tritonspec.nn.attention import use_tritonspec_attention  # noqa: E402
from tritonspec.nn.detectors import is_fused_experts, is_topk_router  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float32 if SMOKE else torch.bfloat16
GiB = 2**30

CASES = ("qwen3-30b-a3b", "llama-3-8b")  # of harness.MODEL_SHAPES
VARIANTS = ("hf-eager", "hf-graphs", "ts-eager", "ts-graphs", "hf-decoder", "ts-decoder")


def build(case, layers):
    cfg = model_config(case, layers=layers, smoke=SMOKE)
    with torch.device(DEV):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=DT)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g, dtype=torch.float32).mul_(0.02).to(DT))
        model.get_output_embeddings().weight.mul_(10.0)  # greedy choices with a margin above bf16 rounding
        for m in model.modules():
            if is_topk_router(m):
                m.weight.mul_(4.0 / m.weight.float().norm(dim=1, keepdim=True).to(DT))
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def step_bytes(model, batch, context):
    """HBM bytes one decode step reads: weights (routed experts only: expected distinct under uniform routing)
    and the KV cache at ``context`` keys."""
    cfg = model.config
    experts = [m for m in model.modules() if is_fused_experts(m)]
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    embed = model.get_input_embeddings().weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_ids)
    dense -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()  # rows looked up
    if model.get_output_embeddings().weight is embed:  # tied: the head reads it all
        dense += embed.numel() * embed.element_size()
    routed = 0
    for m in experts:
        e = sum(p.numel() * p.element_size() for p in m.parameters())
        n, k = cfg.num_experts, cfg.num_experts_per_tok
        routed += e / n * n * (1 - (1 - k / n) ** batch)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * DT.itemsize * context * batch
    return dense + routed + kv


def generate(model, ids, new, static, decoder=None):
    if decoder is not None:
        return decoder.generate(ids, max_new_tokens=new, eos_token_id=[])
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new, attention_mask=torch.ones_like(ids))
    if static:
        cc = transformers.CompileConfig(fullgraph=True)
        cc._compile_all_devices = SMOKE or None  # the CPU: compiled too, so --smoke checks the traced path
        if SMOKE:
            cc.backend, cc.mode = "aot_eager", None
        kw.update(cache_implementation="static", compile_config=cc)
    return model.generate(ids, **kw)


def measure(name, model, batch, prompt, new, static, reference, hbm, skip_guards=False):
    decoder = None
    if name.endswith("decoder"):  # captured by the warm-up, for this (batch, length)
        backend = "aot_eager" if SMOKE else "inductor"
        decoder = GraphDecoder(model, max_cache_len=prompt + new, batch_size=batch, compile_backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    ids = ids.to(DEV)
    with torch.no_grad():
        t_warm = time.perf_counter()
        generate(model, ids, 1, static, decoder)
        out = generate(model, ids, new, static, decoder)
        log(f"{name} b={batch} p={prompt}: warm-up {time.perf_counter() - t_warm:.1f} s")
        if DEV.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards and static):
            t1, _ = timed(lambda: generate(model, ids, 1, static, decoder), DEV)
            tn, out = timed(lambda: generate(model, ids, new, static, decoder), DEV)
    same = reference.get((batch, prompt))
    if same is None:
        reference[(batch, prompt)] = out
        same = "ref"
    else:
        same = "yes" if torch.equal(same, out) else f"{(same != out).sum().item()} differ"
    tok_s = batch * (new - 1) / max(tn - t1, 1e-9)
    nbytes = step_bytes(model, batch, prompt + new // 2)
    bound = batch * hbm / nbytes
    peak = torch.cuda.max_memory_allocated() / GiB if DEV.type == "cuda" else float("nan")
    row = dict(
        name=name, batch=batch, prompt=prompt, tok_s=tok_s, ttft_ms=t1 * 1e3, peak=peak, gb=nbytes / 1e9,
        of_bound=tok_s / bound, same=same,
    )  # fmt: skip
    log(row)
    return row


def use_ours(model):
    kernelize(model, mode=Mode.INFERENCE)
    use_tritonspec_attention(model, source="bench")


def run_case(case, args):
    model = build(case, args.layers)
    log(f"{case}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters on {DEV}")
    rows, reference = [], {}
    for variant in args.variants:
        ours, static = variant.startswith("ts-"), variant.endswith("graphs")
        if ours:
            use_ours(model)
        torch._dynamo.reset()
        skip = args.skip_guards
        try:
            for batch in args.batch:
                for prompt in args.prompt:
                    row = measure(variant, model, batch, prompt, args.new, static, reference, args.hbm, skip)
                    rows.append((case, row))
        finally:
            if ours:
                revert(model)
            gc.collect()
    del model
    gc.collect()
    return rows


def table(rows, args):
    env = f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
    dev = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU interpreter (--smoke)"
    lines = [
        f"## Decode, {dev}, {env}, {datetime.date.today()}",
        "",
        f"bf16, greedy, {args.new} new tokens; bound = {args.hbm / 1e12:.1f} TB/s over the bytes a step reads",
        "",
        "| model | variant | batch | prompt | tok/s | x hf-graphs | of HBM bound | TTFT ms | GB/step | peak GiB | "
        "tokens = hf-eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(c, r["batch"], r["prompt"]): r["tok_s"] for c, r in rows if r["name"] == "hf-graphs"}
    for case, r in rows:
        b = base.get((case, r["batch"], r["prompt"]))
        lines.append(
            f"| {case} | {r['name']} | {r['batch']} | {r['prompt']} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / b if b else float('nan'):.2f} | {r['of_bound']:.0%} | {r['ttft_ms']:.1f} | "
            f"{r['gb']:.2f} | {r['peak']:.1f} | {r['same']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="all", help=f"one of {', '.join(CASES)}, or all")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", default="64,2048")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hbm", type=float, default=3.0e12, help="HBM bytes/s of the bound (H100 SXM: 3.0e12)")
    ap.add_argument(
        "--skip-guards",
        action="store_true",
        help="time the graphs variants under torch.compiler.set_stance(skip_guard_eval_unsafe=True): Dynamo checks "
        "only the guards that tell its compiled steps apart (tens of thousands of guards a step otherwise)",
    )
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.prompt = [int(p) for p in args.prompt.split(",")]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if SMOKE:
        args.new = min(args.new, 4)
        args.batch, args.prompt = sorted({min(b, 2) for b in args.batch}), sorted({min(p, 8) for p in args.prompt})
    cases = list(CASES) if args.case == "all" else [args.case]
    rows = [row for case in cases for row in run_case(case, args)]
    text = table(rows, args)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
