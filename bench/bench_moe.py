"""Benchmark the MoE experts (``moe_experts``) against the MoE paths a user can pick, at the expert shapes of
real MoE models, in bf16, on one GPU.

    python bench/bench_moe.py [--cases qwen3-30b-a3b,...] [--out FILE.md] [--sweep] [--smoke]

Each case builds the model family's transformers experts module (Qwen3-MoE, Mixtral, DeepSeek-V3,
GPT-OSS) with random weights and routes random tokens with a softmax top-k router. Implementations:
``tritonspec``, ``grouped_mm`` (``torch._grouped_mm``, transformers' default) and ``batched_mm``
(transformers' batched matmul over each token's experts), switched the way users switch them
(``config._experts_implementation``); Liger-Kernel's ``LigerFusedMoEFunction`` on the same
weights when it is importable ([gate; up] layouts); and, at decode sizes, our forward replayed from a
CUDA graph of a 48-layer decode step, per layer (how decode runs once launches cost more than the GPU's
work; grouped_mm and Liger's host synchronization cannot be captured). Per (case, tokens, impl, mode):
median / p20 / p80 of ``triton.testing.do_bench``, TFLOP/s over the useful FLOPs (forward ``2*T*k*3*H*I``,
backward twice that), the peak memory of one forward+backward above what was allocated before it, and at
decode sizes (T <= 16) the ratio to the weight-read floor (the chosen experts' weights read once at the
card's measured copy speed). Outputs and dx are checked first against the float64 reference where it fits
in memory, else against grouped_mm.
``--sweep`` first times launch-config variants of our kernels (tuning data, not results). ``--smoke``
runs tiny shapes on the CPU interpreter to check this script itself.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from tritonspec.nn.experts import EXPERTS_NAME, register_experts  # noqa: E402
from tritonspec.ops import moe as moe_mod  # noqa: E402
from tritonspec.ops.moe import moe_experts_ref  # noqa: E402
from harness import override, quantiles  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.float32 if SMOKE else torch.bfloat16

# (name, transformers config class, experts class path, config kwargs: hidden, intermediate, experts, top-k)
CASES = [
    (
        "qwen3-30b-a3b",
        "Qwen3MoeConfig",
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeExperts",
        dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    ),
    (
        "mixtral-8x7b",
        "MixtralConfig",
        "transformers.models.mixtral.modeling_mixtral:MixtralExperts",
        dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2),
    ),
    (
        "deepseek-v3",
        "DeepseekV3Config",
        "transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3Experts",
        dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8),
    ),
    (
        "gpt-oss-20b",
        "GptOssConfig",
        "transformers.models.gpt_oss.modeling_gpt_oss:GptOssExperts",
        dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4),
    ),
]
TOKENS = [16, 512, 4096] if not SMOKE else [3]
# the token counts of each case's table rows (the issue's: prefill/training batches and decode)
DECODE = [16, 8, 4, 2, 1]
TOKENS_OF = {
    "qwen3-30b-a3b": [32768, 8192, 4096, 128, *DECODE],
    "mixtral-8x7b": [4096, *DECODE],
    "deepseek-v3": [4096, *DECODE],
    "gpt-oss-20b": [4096, 1],
}
ANCHORS = ("grouped_mm", "batched_mm")  # transformers' experts implementations, switched by config
SMOKE_SIZES = dict(
    hidden_size=32,
    moe_intermediate_size=16,
    intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
)


def _experts(case):
    import importlib
    import transformers

    name, config_cls, path, sizes = case
    if SMOKE:
        sizes = {k: SMOKE_SIZES.get(k, v) for k, v in sizes.items()}
    cfg = getattr(transformers, config_cls)(**sizes)
    mod, cls = path.split(":")
    torch.manual_seed(0)
    with torch.device("meta"):  # built in bf16 on the GPU directly: DeepSeek-V3's experts are 22 GiB in bf16
        experts = getattr(importlib.import_module(mod), cls)(cfg)
    experts = experts.to(DT).to_empty(device=DEV)
    with torch.no_grad():
        for n, p in experts.named_parameters():  # draw fan-in scaled weights in place
            fan_in = p.shape[-1] if not getattr(experts, "is_transposed", False) or p.dim() < 3 else p.shape[-2]
            p.normal_(0.0, fan_in**-0.5 if p.dim() == 3 else 0.1)
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
    return quantiles(fn, smoke=SMOKE, warmup=10, rep=60)


def _module_call(experts, impl):
    """The experts module itself, switched the way users switch it (``config._experts_implementation``)."""

    def call(experts, x, ids, w):
        experts.config._experts_implementation = impl
        return experts(x, ids, w)

    return call


def _error(experts, fn, x, ids, w, dout, against_float64, baseline):
    """(max |out - ref| / max |ref|, the same for dx, what ref is): the float64 reference where it fits in
    memory, else grouped_mm's bf16 result."""
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(experts, xl, ids, wl)
    out.backward(dout)
    experts.zero_grad(set_to_none=True)
    if against_float64:
        kw = dict(
            gate_up_bias=experts.gate_up_proj_bias.double() if experts.has_bias else None,
            down_bias=experts.down_proj_bias.double() if experts.has_bias else None,
            layout="concatenated" if experts.is_concatenated else "interleaved_transposed",
            activation="gpt_oss" if hasattr(experts, "limit") else "silu",
            clamp=getattr(experts, "limit", None),
        )
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = moe_experts_ref(x64, ids, w64, experts.gate_up_proj.double(), experts.down_proj.double(), **kw)
        ref.backward(dout.double())
        ref_dx, what = x64.grad, "float64"
    else:
        xb = x.detach().requires_grad_()
        ref = baseline(experts, xb, ids, w.detach())
        ref.backward(dout)
        experts.zero_grad(set_to_none=True)
        ref_dx, what = xb.grad.double(), "grouped_mm"
    rel = lambda a, b: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()  # noqa: E731
    return rel(out.detach(), ref.detach()), rel(xl.grad, ref_dx), what


_BIG = dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
VARIANTS = {
    "default": {},
    "k64 s3": {
        "moe_up": dict(BLOCK_K=64, num_stages=3),
        "moe_rows": dict(BLOCK_K=64, num_stages=3),
        "moe_weight_grad": dict(num_stages=3),
    },
    "big": {
        "moe_up": dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
        "moe_rows": _BIG,
        "moe_weight_grad": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
    },
    "big m128": {
        "moe_up": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
        "moe_rows": _BIG,
        "moe_weight_grad": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
    },
    "big s4": {
        "moe_up": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
        "moe_rows": dict(_BIG, num_warps=4, num_stages=4),
        "moe_weight_grad": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    },
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


def _liger():
    """Liger-Kernel's fused MoE (``LigerFusedMoEFunction``), when importable: an anchor for [gate; up] weights."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None
    return lambda experts, x, ids, w: LigerFusedMoEFunction.apply(
        x, experts.gate_up_proj, experts.down_proj, ids.int(), w
    )


STEP_LAYERS = 48  # a decode step's layers in the graph (Qwen3-30B-A3B's depth)
COPIES = 8  # distinct experts modules it cycles over, where they fit


def _layers(experts):
    """``STEP_LAYERS`` experts modules for a decode-step graph, cycling over ``COPIES`` copies of ``experts``
    (distinct weights: no layer finds the one before's in L2) where they fit in a quarter of the GPU's memory,
    else ``experts`` itself each time (DeepSeek-V3: its chosen experts' weights alone are many times L2)."""
    size = sum(p.numel() * p.element_size() for p in experts.parameters())
    if SMOKE or COPIES * size > 0.25 * torch.cuda.get_device_properties(0).total_memory:
        return [experts] * STEP_LAYERS
    copies = [experts] + [copy.deepcopy(experts) for _ in range(COPIES - 1)]
    return [copies[i % COPIES] for i in range(STEP_LAYERS)]


def _graphed(fn, layers):
    """``fn(experts)`` for each of ``layers`` captured in one CUDA graph, as a decode step runs once launches cost
    more than the GPU's work; the replay's time per layer (a lone layer's replay would also time the graph's
    own launch, which a step of many layers pays once)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(layers[0])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for experts in layers:
            fn(experts)
    return graph.replay, len(layers)


def _copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), the weight-read floor's speed."""
    if SMOKE:
        return 1e9
    a = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    return 2 * a.numel() / (bench(lambda: b.copy_(a))[0] * 1e-3)


def _versions() -> str:
    import importlib.metadata as md

    found = []
    for dist in ("transformers", "liger-kernel"):
        try:
            found.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join([f"torch {torch.__version__}", f"triton {triton.__version__}", *found])


def _peak_mib(call):
    """Peak memory of one call above what was allocated before it (MiB)."""
    if SMOKE:
        return float("nan")
    call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def block_rows(tokens=(4096, 32768)):
    """The whole Qwen3-MoE block (router + experts) as transformers runs it in a model (grouped_mm experts)
    against the same block after ``kernelize`` (our router and experts): fwd and fwd+bwd ms, peak MiB of
    fwd+bwd."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    import tritonspec.nn as tnn

    cfg = transformers.Qwen3MoeConfig(
        **(
            dict(
                hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True
            )
            if not SMOKE
            else dict(SMOKE_SIZES, norm_topk_prob=True)
        )
    )
    cfg._experts_implementation = "grouped_mm"  # what a model built by from_pretrained / from_config runs
    torch.manual_seed(0)
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(cfg)
    block = block.to(DT).to_empty(device=DEV)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    lines = ["| block | T | impl | fwd ms | fwd+bwd ms | peak MiB fwd+bwd |", "|---|---|---|---|---|---|"]
    for T in tokens if not SMOKE else (3,):
        x = torch.randn(1, T, cfg.hidden_size, device=DEV).to(DT).requires_grad_()
        dout = torch.randn_like(x)
        for impl in ("transformers", "tritonspec"):
            if impl == "tritonspec":
                tnn.kernelize(block, mode=tnn.Mode.TRAINING, device=DEV if SMOKE else "cuda")

            def fwd():
                with torch.no_grad():
                    block(x)

            def fb():
                x.grad = None
                block.zero_grad(set_to_none=True)
                block(x).backward(dout)

            tf, tb = bench(fwd)[0], bench(fb)[0]
            lines.append(f"| qwen3-30b-a3b | {T} | {impl} | {tf:.3f} | {tb:.3f} | {_peak_mib(fb):.0f} |")
            print(lines[-1], flush=True)
        tnn.revert(block)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", help="comma-separated token counts for every case (default: each case's own)")
    ap.add_argument("--block", action="store_true", help="also the whole Qwen3-MoE block, as shipped vs kernelized")
    ap.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names (default: all; none: no experts rows): " + ", ".join(c[0] for c in CASES),
    )
    args = ap.parse_args(argv)
    register_experts()
    sweep_table = sweep() if args.sweep else ""
    block_table = block_rows() if args.block else ""
    liger = _liger()
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    rows = []
    bandwidth = _copy_bandwidth()
    for case in cases:
        experts, cfg, k, H, I = _experts(case)
        E = experts.num_experts
        own = [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS_OF.get(case[0], TOKENS)
        for T in own if not SMOKE else TOKENS:
            x, ids, w = _inputs(T, H, E, k)
            dout = torch.randn(T, H, device=DEV).to(DT)
            impls = {n: _module_call(experts, n) for n in (EXPERTS_NAME, *ANCHORS)}
            if liger is not None and experts.is_concatenated and not experts.has_bias:
                impls["liger"] = liger
            # float64 reference where it fits in memory (weights 4x in float64); else ours against grouped_mm
            fits = SMOKE or E * 3 * H * I * 8 * 2 < 0.25 * torch.cuda.get_device_properties(0).total_memory
            errs = {}
            for impl, fn in impls.items():
                try:
                    errs[impl] = _error(experts, fn, x, ids, w, dout, fits, impls["grouped_mm"])
                except Exception as e:  # noqa: BLE001
                    print(f"# {case[0]} T={T} {impl}: {type(e).__name__}: {str(e)[:200]}")
            ours, base = errs.get(EXPERTS_NAME), errs.get("grouped_mm")
            if ours is None or (base is not None and ours[0] > 2 * base[0] + 1e-2):
                raise SystemExit(f"{case[0]} T={T}: our error {ours} vs grouped_mm {base}")
            flops = 2 * T * k * 3 * H * I
            variants = [(impl, mode) for impl in errs for mode in ("fwd", "fwd+bwd")]
            if T <= 128 and not SMOKE:
                variants.append((EXPERTS_NAME + " (CUDA graph)", "fwd"))
            for impl, mode in variants:
                fn = impls[impl.split()[0]]
                if mode == "fwd":

                    def call(experts=experts, fn=fn):
                        with torch.no_grad():
                            fn(experts, x, ids, w)
                else:

                    def call(fn=fn, experts=experts):
                        x.grad = w.grad = None
                        experts.zero_grad(set_to_none=True)
                        fn(experts, x, ids, w).backward(dout)

                try:
                    timed, per = _graphed(call, _layers(experts)) if "graph" in impl else (call, 1)
                    t = [ms / per for ms in bench(timed)]
                    peak = _peak_mib(call) if mode == "fwd+bwd" else float("nan")
                except Exception as e:  # noqa: BLE001
                    print(f"# {case[0]} T={T} {impl} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                f = flops if mode == "fwd" else 3 * flops
                err = errs[impl.split()[0]]
                # the weight-read floor: the chosen experts' weights once, at this card's copy speed
                floor = ids.unique().numel() * 3 * H * I * 2 / bandwidth * 1e3 if mode == "fwd" and T <= 16 else None
                rows.append(
                    dict(
                        case=case[0],
                        T=T,
                        impl=impl,
                        mode=mode,
                        ms=t[0],
                        p20=t[1],
                        p80=t[2],
                        tflops=f / (t[0] * 1e-3) / 1e12,
                        err=err[0],
                        derr=err[1],
                        ref=err[2],
                        peak=peak,
                        floor=floor,
                    )
                )
                print(rows[-1], flush=True)
        del experts
        if not SMOKE:
            torch.cuda.empty_cache()
    speed = {(r["case"], r["T"], r["mode"]): r["ms"] for r in rows if r["impl"] == EXPERTS_NAME}
    name = torch.cuda.get_device_name() if not SMOKE else "cpu (interpreter)"
    head = (
        f"# MoE experts, {name}, {_versions()}, {datetime.date.today()}; copy {bandwidth / 1e12:.2f} TB/s\n\n"
        "| case | T | impl | mode | ms (p20-p80) | TFLOP/s | ours faster | / floor | peak MiB | out err | dx err "
        "| against |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        key = (r["case"], r["T"], r["mode"])
        ratio = r["ms"] / speed[key] if key in speed else float("nan")
        lines.append(
            f"| {r['case']} | {r['T']} | {r['impl']} | {r['mode']} | {r['ms']:.4g} "
            f"({r['p20']:.4g}-{r['p80']:.4g}) | {r['tflops']:.0f} | {ratio:.2f}x | "
            f"{'-' if r['floor'] is None else format(r['ms'] / r['floor'], '.2f') + 'x'} | {r['peak']:.0f} "
            f"| {r['err']:.1e} | {r['derr']:.1e} | {r['ref']} |"
        )
    table = (
        "\n".join(lines)
        + (f"\n\nWhole MoE block:\n\n{block_table}" if block_table else "")
        + (f"\n\nLaunch-config sweep (ours):\n\n{sweep_table}" if sweep_table else "")
    )
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")


if __name__ == "__main__":
    main()
