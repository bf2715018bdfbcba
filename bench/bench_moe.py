"""Benchmark the MoE experts (``moe_experts``) against transformers' own experts implementations, at the
expert shapes of real MoE models, in bf16, on one GPU.

    python bench/bench_moe.py [--out FILE.md] [--sweep] [--smoke]

Each case builds the model family's transformers experts module (Qwen3-MoE, Mixtral, GPT-OSS) with
random weights and routes random tokens with a softmax top-k router; implementations are switched the
way users switch them (``config._experts_implementation``): ``tritonspec`` against ``grouped_mm``
(``torch._grouped_mm``) and ``batched_mm``. Per (case, tokens, impl, mode): median / p20 / p80 of
``triton.testing.do_bench`` and TFLOP/s over the useful FLOPs (forward ``2*T*k*3*H*I``, backward
twice that). Our output and gradients are checked against the float64 reference first; the baselines'
errors against the same reference are printed beside ours. ``--sweep`` first times launch-config
variants of our kernels at the largest token count (tuning data, not results). ``--smoke`` runs tiny shapes on the CPU
interpreter to check this script itself.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from tritonspec.nn.experts import EXPERTS_NAME, register_experts  # noqa: E402
from tritonspec.ops import moe as moe_mod  # noqa: E402
from tritonspec.ops.moe import moe_experts_ref  # noqa: E402
from tuning import override  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.float32 if SMOKE else torch.bfloat16

# (name, transformers config class, experts class path, config kwargs: hidden, intermediate, experts, top-k)
CASES = [
    ("qwen3-30b-a3b", "Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts",
     dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
    ("mixtral-8x7b", "MixtralConfig", "transformers.models.mixtral.modeling_mixtral:MixtralExperts",
     dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)),
    ("gpt-oss-20b", "GptOssConfig", "transformers.models.gpt_oss.modeling_gpt_oss:GptOssExperts",
     dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)),
]
TOKENS = [16, 512, 4096] if not SMOKE else [3]
SMOKE_SIZES = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=16, num_experts=4, num_local_experts=4,
                   num_experts_per_tok=2)


def _experts(case):
    import importlib
    import transformers
    name, config_cls, path, sizes = case
    if SMOKE:
        sizes = {k: SMOKE_SIZES.get(k, v) for k, v in sizes.items()}
    cfg = getattr(transformers, config_cls)(**sizes)
    mod, cls = path.split(":")
    torch.manual_seed(0)
    experts = getattr(importlib.import_module(mod), cls)(cfg).to(DEV)
    with torch.no_grad():
        for n, p in experts.named_parameters():  # HF leaves them uninitialized: draw fan-in scaled weights
            fan_in = p.shape[-1] if not getattr(experts, "is_transposed", False) or p.dim() < 3 else p.shape[-2]
            p.copy_(torch.randn_like(p) * fan_in ** -0.5 if p.dim() == 3 else torch.randn_like(p) * 0.1)
    experts = experts.to(DT)
    top_k = sizes["num_experts_per_tok"]
    intermediate = sizes.get("moe_intermediate_size", sizes.get("intermediate_size"))
    return experts, cfg, top_k, sizes["hidden_size"], intermediate


def _inputs(T, H, E, k):
    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, H, device=DEV, generator=g).to(DT).requires_grad_()
    logits = torch.randn(T, E, device=DEV, generator=g)
    w, ids = logits.softmax(-1).topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).requires_grad_()
    return x, ids, w


def bench(fn):
    if SMOKE:
        fn()
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return ms, ms, ms
    return tuple(triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=[0.5, 0.2, 0.8]))


def _reference_error(experts, x, ids, w, dout, impl):
    """max |impl - float64 reference| of the output and of dx, relative to the reference's max."""
    experts.config._experts_implementation = impl
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = experts(xl, ids, wl)
    out.backward(dout)
    kw = dict(gate_up_bias=experts.gate_up_proj_bias.double() if experts.has_bias else None,
              down_bias=experts.down_proj_bias.double() if experts.has_bias else None,
              layout="concatenated" if experts.is_concatenated else "interleaved_transposed",
              activation="gpt_oss" if hasattr(experts, "limit") else "silu", clamp=getattr(experts, "limit", None))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = moe_experts_ref(x64, ids, w64, experts.gate_up_proj.double(), experts.down_proj.double(), **kw)
    ref.backward(dout.double())
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    return rel(out.detach(), ref.detach()), rel(xl.grad, x64.grad)


_BIG = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
VARIANTS = {
    "default": {},
    "k64 s3": {"moe_up": dict(BLOCK_K=64, num_stages=3), "moe_rows": dict(BLOCK_K=64, num_stages=3),
               "moe_weight_grad": dict(num_stages=3)},
    "big": {"moe_up": dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3), "moe_rows": _BIG,
            "moe_weight_grad": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3)},
    "big m128": {"moe_up": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3), "moe_rows": _BIG,
                 "moe_weight_grad": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3)},
    "big s4": {"moe_up": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
               "moe_rows": dict(_BIG, num_warps=4, num_stages=4),
               "moe_weight_grad": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)},
}


def sweep():
    """fwd and fwd+bwd ms of each variant, per case, at the largest and smallest token counts."""
    lines = ["| case | T | variant | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|"]
    for case in CASES:
        experts, cfg, k, H, I = _experts(case)
        experts.config._experts_implementation = EXPERTS_NAME
        for T in (TOKENS[0], TOKENS[-1]):
            x, ids, w = _inputs(T, H, experts.num_experts, k)
            dout = torch.randn(T, H, device=DEV).to(DT)
            for name, variant in VARIANTS.items():
                def fwd():
                    with torch.no_grad():
                        experts(x, ids, w)

                def fb():
                    x.grad = w.grad = None
                    experts.zero_grad(set_to_none=True)
                    experts(x, ids, w).backward(dout)
                try:
                    with override(moe_mod, variant):
                        tf, tb = bench(fwd)[0], bench(fb)[0]
                except Exception as e:  # noqa: BLE001
                    print(f"# sweep {case[0]} {T} {name}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                lines.append(f"| {case[0]} | {T} | {name} | {tf:.3f} | {tb:.3f} |")
                print(lines[-1], flush=True)
        if not SMOKE:
            torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args(argv)
    register_experts()
    sweep_table = sweep() if args.sweep else ""
    impls = [EXPERTS_NAME, "grouped_mm", "batched_mm"]
    rows = []
    for case in CASES:
        experts, cfg, k, H, I = _experts(case)
        E = experts.num_experts
        for T in TOKENS:
            x, ids, w = _inputs(T, H, E, k)
            dout = torch.randn(T, H, device=DEV).to(DT)
            errs = {}
            for impl in impls:
                try:
                    errs[impl] = _reference_error(experts, x, ids, w, dout, impl)
                except Exception as e:  # noqa: BLE001
                    print(f"# {case[0]} T={T} {impl}: {type(e).__name__}: {str(e)[:200]}")
            ours = errs.get(EXPERTS_NAME)
            base = errs.get("grouped_mm")
            if ours is None or (base is not None and ours[0] > 2 * base[0] + 1e-2):
                raise SystemExit(f"{case[0]} T={T}: our error {ours} vs grouped_mm {base}")
            flops = 2 * T * k * 3 * H * I
            for impl in errs:
                experts.config._experts_implementation = impl
                for mode in ("fwd", "fwd+bwd"):
                    if mode == "fwd":
                        def call():
                            with torch.no_grad():
                                experts(x, ids, w)
                    else:
                        def call():
                            x.grad = w.grad = None
                            experts.zero_grad(set_to_none=True)
                            experts(x, ids, w).backward(dout)
                    try:
                        t = bench(call)
                    except Exception as e:  # noqa: BLE001
                        print(f"# {case[0]} T={T} {impl} {mode}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    f = flops if mode == "fwd" else 3 * flops
                    rows.append(dict(case=case[0], T=T, impl=impl, mode=mode, ms=t[0], p20=t[1], p80=t[2],
                                     tflops=f / (t[0] * 1e-3) / 1e12, err=errs[impl][0], derr=errs[impl][1]))
        if not SMOKE:
            torch.cuda.empty_cache()
    speed = {(r["case"], r["T"], r["mode"]): r["ms"] for r in rows if r["impl"] == EXPERTS_NAME}
    name = torch.cuda.get_device_name() if not SMOKE else "cpu (interpreter)"
    head = (f"# MoE experts, {name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today()}\n\n| case | T | impl | mode | ms (p20-p80) | TFLOP/s | ours faster | out err | dx err |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ratio = r["ms"] / speed[(r["case"], r["T"], r["mode"])] if (r["case"], r["T"], r["mode"]) in speed else float("nan")
        lines.append(f"| {r['case']} | {r['T']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} ({r['p20']:.3f}-{r['p80']:.3f}) "
                     f"| {r['tflops']:.0f} | {ratio:.2f}x | {r['err']:.1e} | {r['derr']:.1e} |")
    table = "\n".join(lines) + (f"\n\nLaunch-config sweep (ours):\n\n{sweep_table}" if sweep_table else "")
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")


if __name__ == "__main__":
    main()
