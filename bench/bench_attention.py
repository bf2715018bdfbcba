"""Attention on an H100: our Triton kernels against SDPA's FLASH and cuDNN backends, in one process.

Modes:
  --warm I/N   compile a share of the sweep's candidate configs (run N of these in parallel first:
               compilation is CPU-bound, timing must run alone afterwards)
  --sweep      time every candidate on every shape; per (head dim, causal) keep the one with the best
               summed TFLOP/s (and a correct result); write table.json
  --final      time our tuned table (or --table table.json) against FLASH and cuDNN
  --gqa        the same at grouped-query shapes of real models (Llama-3-8B, Qwen3, Llama-3.2-1B style), causal,
               with q, k, v and dO in Hugging Face's layout ((batch, seq, heads, dim) transposed); SDPA gets
               enable_gqa=True as transformers passes it
  --masked     padded (lengths uniform in [S/2, S], right-padded), packed (the same tokens in one row,
               sequences by key bounds) and sliding-window batches, causal, GQA: ours against transformers'
               SDPA path with the equivalent mask (what the model runs without us), and our unmasked
               kernels on the full shape and at the packed sequences' mean length; TFLOP/s counted on
               the (query, key) pairs the mask keeps
  --gap        at two GQA shapes, per provider: do_bench ms vs GPU-only ms (host kept ahead) and host ms
               per call, so the host latency inside each timed interval shows; our host ms per call with
               the compiled-launch cache on and off; host profiles of our passes (files in --out)
  --decode     decode steps (one query against a full KV cache, no mask, bf16, head_dim 128) at batch 1 and 8,
               GQA 32/8 and 16/4, caches of 512 to 32768 keys: ops.attention_decode (split-K) against SDPA with
               each backend (FLASH, EFFICIENT, cuDNN, MATH; enable_gqa=True, or k/v repeated beforehand where a
               backend refuses it: the table says which), the best SDPA backend kept; our GB/s of K+V read
               against 3.0 TB/s. Timed by do_bench_cudagraph (a graph of unrolled calls: no launch overhead;
               K/V rotate over copies of 256 MB or more, so L2 holds none between calls); decode.json in --out.
               ``--decode --smoke`` runs tiny shapes on the CPU interpreter, timed by the wall clock;
               ``--decode-config '{"attention_decode": {"BLOCK_N": 128, "num_stages": 3}}'`` times our kernels with
               those launch-config fields over what the backend chose (tuning data, not results)

TFLOP/s: forward 4*b*h*s*s*d (halved when causal), backward 2.5x forward. Timings are do_bench
medians (L2 flushed between runs); the backward is torch.autograd.grad on a saved graph, so it
includes the delta preprocess and (for atomic dQ) the fp32->bf16 conversion.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import itertools
import json
import os
import statistics
import sys
import time
import types

SMOKE = "--smoke" in sys.argv  # CPU smoke run of --decode: the interpreter, chosen before triton is imported
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import tritonspec  # noqa: E402
from tritonspec.ops._library import recording  # noqa: E402
from tritonspec.ops.attention import attention, causal_key_bounds, key_bounds_from_mask  # noqa: E402
from tritonspec.ops.attention_decode import attention_decode  # noqa: E402
from tritonspec_backends.nvidia.backend import spec as nvidia_spec  # noqa: E402
from tritonspec_backends.nvidia.backend.spec.configs import TABLES, h100_attention_config  # noqa: E402
from tritonspec_backends.nvidia.backend.spec.attention_sm90 import launchers as launchers_sm90  # noqa: E402

SHAPES = [(4, 32, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128), (8, 32, 2048, 64)]
CASES = [(shape, causal) for shape in SHAPES for causal in (True, False)]
# (batch, heads_q, heads_kv, seq, head_dim): a 16/4 Llama-style step's layer, Llama-3-8B (32/8 x 128),
# Qwen3 (32/4 x 128), Llama-3.2-1B style (32/8 x 64); seq 2048-8192 at 8192 tokens a batch and more
GQA_SHAPES = [
    (4, 16, 4, 2048, 128),
    (4, 32, 8, 2048, 128),
    (2, 32, 8, 4096, 128),
    (1, 32, 8, 8192, 128),
    (4, 32, 4, 2048, 128),
    (1, 32, 4, 8192, 128),
    (4, 32, 8, 2048, 64),
    (1, 32, 8, 8192, 64),
]
GQA_CASES = [(shape, True) for shape in GQA_SHAPES]


def _c(bm, bn, w, s, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, TMA=True, **kw)


# Candidates per padded head dim; all compile for sm90 without register spills (checked offline
# with ptxas -v) except where noted. The backward is swept as (dK/dV, dQ) pairs, or a dK/dV config
# with atomic dQ alone; every shape of a (head dim, causal) group sees the same candidates, so the
# table entry is the candidate with the best summed TFLOP/s over the group.
FWD = {
    128: [_c(128, 128, 8, 3), _c(128, 64, 8, 4), _c(128, 64, 8, 3)],
    64: [_c(64, 64, 4, 4), _c(128, 64, 4, 3), _c(128, 64, 4, 4), _c(64, 64, 4, 3), _c(64, 128, 4, 3)],
}
_A = dict(DQ_ATOMIC=True, DQ_TMA_REDUCE=True)
BWD = {
    128: [
        (_c(64, 64, 4, 2), _c(128, 128, 8, 2)),
        (_c(64, 64, 4, 2), _c(128, 32, 8, 3)),
        (_c(64, 64, 4, 2), _c(128, 64, 8, 3)),
        (_c(64, 64, 4, 2), _c(64, 64, 4, 2)),
        (_c(64, 128, 8, 3), _c(128, 64, 8, 3)),  # this dK/dV spills 104 bytes when causal
        (_c(64, 64, 8, 2), _c(128, 64, 8, 3)),
        (_c(64, 64, 8, 2), _c(128, 128, 8, 2)),
        (_c(128, 64, 8, 2), _c(128, 64, 8, 3)),
        (_c(64, 64, 8, 2, **_A), None),
        (_c(64, 64, 8, 2, DQ_ATOMIC=True), None),
        (_c(64, 128, 8, 2, **_A), None),
    ],  # the last one spills 392 bytes
    64: [
        (_c(64, 64, 4, 2), _c(64, 64, 4, 3)),
        (_c(32, 128, 4, 3), _c(128, 64, 4, 3)),
        (_c(64, 64, 4, 2), _c(128, 64, 4, 3)),
        (_c(32, 128, 4, 3), _c(64, 64, 4, 3)),
        (_c(64, 64, 8, 2), _c(64, 64, 4, 3)),
        (_c(64, 64, 8, 2), _c(128, 64, 4, 3)),
        (_c(64, 64, 8, 2, **_A), None),
        (_c(64, 64, 4, 2, **_A), None),
        (_c(64, 128, 8, 2, DQ_ATOMIC=True), None),
    ],
}


def bwd_override(pair):
    kv, dq = pair
    return {"attention_bwd_dkdv": kv} if dq is None else {"attention_bwd_dkdv": kv, "attention_bwd_dq": dq}


def table_to_json(tables):
    return {kern: {f"{dp},{int(causal)}": cfg for (dp, causal), cfg in t.items()} for kern, t in tables.items()}


def table_from_json(data):
    return {
        kern: {(int(key.split(",")[0]), bool(int(key.split(",")[1]))): cfg for key, cfg in t.items()}
        for kern, t in data.items()
    }


# ---------------------------------------------------------------------------------------------
def use_configs(override: dict | None = None, tables: dict | None = None, hopper_kernels=True):
    """Register an nvidia spec: the tuned table (or ``tables``), with ``override`` {kernel: cfg} on top.

    The sweep tunes the ``tl`` kernels, so ``--sweep`` leaves Hopper's own kernels out."""
    override = override or {}

    def kernel_config(kernel, device=None, **problem):
        base = h100_attention_config(kernel, tables=tables, **problem)
        if kernel in override:
            return {**(base or {}), **override[kernel]}
        return base

    mod = types.ModuleType("bench_attention_spec")
    mod.kernel_config = kernel_config
    mod.backend_info = nvidia_spec.backend_info  # it stands in for the nvidia spec: same targets and devices
    mod.__all__ = ["kernel_config", "backend_info"]
    if hopper_kernels:  # as the shipped spec: Hopper's own forward and backward kernels where they apply
        mod.attention_forward, mod.attention_backward = (
            launchers_sm90.attention_forward,
            launchers_sm90.attention_backward,
        )
        mod.__all__ += ["attention_forward", "attention_backward"]
    tritonspec.register_spec("nvidia", mod)  # re-registering also clears launch_config's memo


def tflops(shape, causal, mode, ms):
    b, h, s, d = shape[0], shape[1], shape[-2], shape[-1]  # (b, h, s, d) or GQA's (b, hq, hkv, s, d)
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (2.5 if mode == "bwd" else 1.0)
    return f / (ms * 1e-3) / 1e12


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


DTYPE = torch.bfloat16  # --dtype


def make_inputs(shape, seed=0):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda: torch.randn(b, h, s, d, device="cuda", dtype=DTYPE, generator=g)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def make_hf_inputs(shape, seed=0):
    """GQA inputs as Hugging Face hands them over: (batch, seq, heads, dim) memory, transposed."""
    b, hq, hkv, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(b, s, h, d, device="cuda", dtype=DTYPE, generator=g).transpose(1, 2)  # noqa: E731
    q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def sdpa_fn(backend, causal):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    return run


def ours_fn(causal):
    return lambda q, k, v: attention(q, k, v, causal=causal)


def time_provider(fn, q, k, v, do, rep=100):
    """(fwd ms, bwd ms, out, grads) or raises."""
    fwd_ms = bench(lambda: fn(q, k, v), rep)
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    bwd_ms = bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), rep)
    return fwd_ms, bwd_ms, out.detach(), grads


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def kernel_breakdown(fn, q, k, v, do, n=3):
    """Per-kernel GPU time (ms per call) of forward + backward, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    out = fn(q, k, v)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
    res = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and ("attn" in evt.key or "flash" in evt.key.lower()):
            res[evt.key[:60]] = round(t / n / 1000.0, 4)
    return res


def case_label(shape, causal):
    return "x".join(map(str, shape)) + (" causal" if causal else " non-causal")


def dp_of(shape):
    return 64 if shape[3] <= 64 else 128


# ---------------------------------------------------------------------------------------------
def warm_items():
    items = []
    for dp, shape in ((128, (1, 32, 4096, 128)), (64, (1, 32, 2048, 64))):
        kvs = {json.dumps(kv, sort_keys=True): kv for kv, _ in BWD[dp]}
        dqs = {json.dumps(dq, sort_keys=True): dq for _, dq in BWD[dp] if dq is not None}
        for causal in (True, False):
            items += [(shape, causal, {"attention_fwd": cfg}) for cfg in FWD[dp]]
            items += [(shape, causal, {"attention_bwd_dkdv": cfg}) for cfg in kvs.values()]
            items += [(shape, causal, {"attention_bwd_dq": cfg}) for cfg in dqs.values()]
    return items


def warm(part: int, nparts: int):
    for shape, causal, override in warm_items()[part::nparts]:
        use_configs(override, hopper_kernels=False)
        q, k, v, do = make_inputs(shape)
        try:
            out = attention(q, k, v, causal=causal)
            torch.autograd.grad(out, (q, k, v), do)
        except Exception as e:  # a candidate that fails to compile is reported by --sweep too
            print(f"warm: {case_label(shape, causal)} {override}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    torch.cuda.synchronize()


def sweep(out_dir: str):
    """Time every candidate on every shape; write sweep.json and the winning table to table.json."""
    rows = []
    score = {}  # (kernel key, dp, causal, candidate index) -> summed TFLOP/s over the group's shapes
    for shape, causal in CASES:
        dp = dp_of(shape)
        label = case_label(shape, causal)
        q, k, v, do = make_inputs(shape)
        try:
            ref_out = sdpa_fn(SDPBackend.CUDNN_ATTENTION, causal)(q, k, v)
        except RuntimeError:  # fall back to FLASH as the reference if cuDNN refuses the shape
            ref_out = sdpa_fn(SDPBackend.FLASH_ATTENTION, causal)(q, k, v)
        ref_grads = torch.autograd.grad(ref_out, (q, k, v), do)
        ref_out = ref_out.detach()

        for i, cfg in enumerate(FWD[dp]):
            use_configs({"attention_fwd": cfg}, hopper_kernels=False)
            try:
                o = attention(q, k, v, causal=causal)
                err = rel_err(o, ref_out)
                ms = bench(lambda: attention(q, k, v, causal=causal))
            except Exception as e:
                rows.append(dict(case=label, mode="fwd", cfg=cfg, error=f"{type(e).__name__}: {str(e)[:200]}"))
                score[("fwd", dp, causal, i)] = float("-inf")
                continue
            tf = tflops(shape, causal, "fwd", ms)
            rows.append(dict(case=label, mode="fwd", cfg=cfg, ms=ms, tflops=tf, err=err))
            print(f"{label:28s} fwd {tf:6.1f} TF/s err={err:.1e} {cfg}", flush=True)
            score[("fwd", dp, causal, i)] = score.get(("fwd", dp, causal, i), 0.0) + (tf if err < 2e-2 else -1e9)

        for i, pair in enumerate(BWD[dp]):
            override = bwd_override(pair)
            try:
                use_configs(override, hopper_kernels=False)
                o = attention(q, k, v, causal=causal)
                grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                err = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
                ms = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            except Exception as e:
                rows.append(dict(case=label, mode="bwd", cfg=override, error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"{label:28s} bwd FAILED {override}: {str(e)[:200]}", flush=True)
                score[("bwd", dp, causal, i)] = float("-inf")
                continue
            tf = tflops(shape, causal, "bwd", ms)
            rows.append(dict(case=label, mode="bwd", cfg=override, ms=ms, tflops=tf, err=err))
            print(f"{label:28s} bwd {tf:6.1f} TF/s err={err:.1e} {override}", flush=True)
            score[("bwd", dp, causal, i)] = score.get(("bwd", dp, causal, i), 0.0) + (tf if err < 3e-2 else -1e9)
        q = k = v = do = ref_out = ref_grads = None  # free this shape's tensors before the next
        torch.cuda.empty_cache()

    tables = {"attention_fwd": {}, "attention_bwd_dkdv": {}, "attention_bwd_dq": {}}
    for dp in (64, 128):
        for causal in (False, True):
            f = max(range(len(FWD[dp])), key=lambda i: score.get(("fwd", dp, causal, i), float("-inf")))
            b = max(range(len(BWD[dp])), key=lambda i: score.get(("bwd", dp, causal, i), float("-inf")))
            tables["attention_fwd"][(dp, causal)] = dict(FWD[dp][f], WARP_SPECIALIZE=False)
            kv, dq = BWD[dp][b]
            tables["attention_bwd_dkdv"][(dp, causal)] = {"DQ_ATOMIC": False, "DQ_TMA_REDUCE": False, **kv}
            # with atomic dQ the dQ kernel never runs; keep the current entry so the table stays complete
            current = TABLES["attention_bwd_dq"][(dp, causal)]
            tables["attention_bwd_dq"][(dp, causal)] = dq if dq is not None else current
    with open(os.path.join(out_dir, "sweep.json"), "w") as fh:
        json.dump(dict(env=env(), rows=rows, score={str(k): v for k, v in score.items()}), fh, indent=1, default=str)
    with open(os.path.join(out_dir, "table.json"), "w") as fh:
        json.dump(table_to_json(tables), fh, indent=1)
    print(json.dumps(table_to_json(tables)))
    return tables


def env():
    p = torch.cuda.get_device_properties(0)
    return dict(
        device=p.name,
        sms=p.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        dtype=str(DTYPE).removeprefix("torch."),
        date=datetime.date.today().isoformat(),
    )


def compare(out_dir: str, tables: dict | None, rounds: int = 3, gqa: bool = False):
    """Ours (tuned table, or ``tables``) vs FLASH vs cuDNN. Per shape the three are timed in
    ``rounds`` rotated rounds and the median kept: clocks drift as the GPU heats up."""
    use_configs(None, tables)
    cases, inputs = (GQA_CASES, make_hf_inputs) if gqa else (CASES, make_inputs)
    results = []
    providers = [
        ("cudnn", lambda c: sdpa_fn(SDPBackend.CUDNN_ATTENTION, c)),
        ("flash", lambda c: sdpa_fn(SDPBackend.FLASH_ATTENTION, c)),
        ("ours", ours_fn),
    ]
    for shape, causal in cases:
        label = case_label(shape, causal)
        q, k, v, do = inputs(shape, seed=1)
        row = dict(case=label, shape=shape, causal=causal)
        times = {name: ([], []) for name, _ in providers}
        outs = {}
        for r in range(rounds):
            for name, make in providers[r % 3 :] + providers[: r % 3]:
                if name in row:  # failed before
                    continue
                try:
                    fwd_ms, bwd_ms, out, grads = time_provider(make(causal), q, k, v, do)
                except Exception as e:
                    row[name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                times[name][0].append(fwd_ms)
                times[name][1].append(bwd_ms)
                outs.setdefault(name, (out, grads))
        for name, _ in providers:
            if name in row:
                continue
            fwd_ms, bwd_ms = statistics.median(times[name][0]), statistics.median(times[name][1])
            row[name] = dict(
                fwd_ms=fwd_ms,
                bwd_ms=bwd_ms,
                fwd_tflops=tflops(shape, causal, "fwd", fwd_ms),
                bwd_tflops=tflops(shape, causal, "bwd", bwd_ms),
                fwd_ms_all=times[name][0],
                bwd_ms_all=times[name][1],
            )
        if "ours" in outs and "cudnn" in outs:
            (o, g), (ro, rg) = outs["ours"], outs["cudnn"]
            row["ours"]["err_vs_cudnn"] = max([rel_err(o, ro)] + [rel_err(a, b) for a, b in zip(g, rg)])
        if gqa:  # the same calls with the host ahead of the GPU: kernels against kernels
            for name, make in providers[::2]:
                if name in outs:
                    fn = make(causal)
                    out = fn(q, k, v)
                    fwd = lambda: fn(q, k, v)  # noqa: B023, E731
                    bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: B023, E731
                    row[name]["gpu_only_ms"] = (gpu_only_ms(fwd)[0], gpu_only_ms(bwd)[0])
        try:
            row["ours_kernels_ms"] = kernel_breakdown(ours_fn(causal), q, k, v, do)
        except Exception as e:  # profiling is diagnostic only
            row["ours_kernels_ms"] = f"{type(e).__name__}: {e}"
        results.append(row)
        q = k = v = do = outs = None  # free this shape's tensors before the next
        torch.cuda.empty_cache()
    info = env()
    with open(os.path.join(out_dir, "compare_gqa.json" if gqa else "compare.json"), "w") as f:
        json.dump(
            dict(env=info, tables=None if tables is None else table_to_json(tables), results=results),
            f,
            indent=1,
            default=str,
        )
    print(f"\n{info}")
    print(table(results))


def table(results):
    heads = "hq x hkv" if len(results[0]["shape"]) == 5 else "h"
    lines = [
        f"| shape (b x {heads} x s x d) | causal | ours fwd | FLASH fwd | cuDNN fwd | ours bwd | FLASH bwd |"
        " cuDNN bwd | fwd vs cuDNN | bwd vs cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g = lambda p, m: r.get(p, {}).get(f"{m}_tflops")  # noqa: E731
        f = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
        ratio = lambda a, b: "n/a" if a is None or b is None else f"{a / b:.0%}"  # noqa: E731
        lines.append(
            f"| {'x'.join(map(str, r['shape']))} | {r['causal']} | {f(g('ours', 'fwd'))} | "
            f"{f(g('flash', 'fwd'))} | {f(g('cudnn', 'fwd'))} | {f(g('ours', 'bwd'))} | "
            f"{f(g('flash', 'bwd'))} | {f(g('cudnn', 'bwd'))} | "
            f"{ratio(g('ours', 'fwd'), g('cudnn', 'fwd'))} | {ratio(g('ours', 'bwd'), g('cudnn', 'bwd'))} |"
        )
    if any("gpu_only_ms" in r.get("ours", {}) for r in results):
        lines += [
            "",
            "GPU-only (host ahead of the GPU, L2 flushed; ms):",
            "",
            "| shape | ours fwd | cuDNN fwd | ours bwd | cuDNN bwd | fwd vs cuDNN | bwd vs cuDNN |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in results:
            o, c = r.get("ours", {}).get("gpu_only_ms"), r.get("cudnn", {}).get("gpu_only_ms")
            if o and c:
                lines.append(
                    f"| {'x'.join(map(str, r['shape']))} | {o[0]:.3f} | {c[0]:.3f} | {o[1]:.3f} | "
                    f"{c[1]:.3f} | {c[0] / o[0]:.0%} | {c[1] / o[1]:.0%} |"
                )
    return "\n".join(lines)


def gpu_only_ms(fn, n=20):
    """Median event time of ``fn`` with the host ahead of the GPU (a sleep kernel queued first), so
    no host latency lands inside the interval; also the host ms each call took meanwhile."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(n):
        flush.zero_()
        torch.cuda._sleep(10_000_000)  # ~5 ms of GPU time: the host runs ahead meanwhile
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
        e.record()
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e))
    return statistics.median(gpu), statistics.median(host)


def host_ms(call, n=50, rounds=5):
    """Host ms per call of ``call`` with the GPU kept busy (a long sleep kernel queued first), median
    over rounds of n calls, with the compiled-launch cache on and off (Triton's own launch path)."""
    from tritonspec.ops import _library

    times = {True: [], False: []}
    try:
        for _ in range(rounds):
            for cached in (True, False):
                _library.USE_CACHED_LAUNCH = cached
                torch.cuda._sleep(400_000_000)
                t = time.perf_counter()
                for _ in range(n):
                    call()
                times[cached].append((time.perf_counter() - t) * 1e3 / n)
                torch.cuda.synchronize()
    finally:
        _library.USE_CACHED_LAUNCH = True
    return statistics.median(times[True]), statistics.median(times[False])


def gap(out_dir: str, shapes=((4, 16, 4, 2048, 128), (4, 32, 8, 2048, 64))):
    """Where do_bench's interval exceeds the GPU's own time: host latency before and between our
    kernels. GQA shapes in Hugging Face's layout, causal; writes a host profile of each pass."""
    import cProfile
    import pstats

    use_configs(None)
    rows, host = [], []
    for shape in shapes:
        q, k, v, do = make_hf_inputs(shape, seed=1)
        for name, fn in (("cudnn", sdpa_fn(SDPBackend.CUDNN_ATTENTION, True)), ("ours", ours_fn(True))):
            out = fn(q, k, v)
            bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            fwd = lambda: fn(q, k, v)  # noqa: E731
            for mode, call in (("fwd", fwd), ("bwd", bwd)):
                g, h = gpu_only_ms(call)
                rows.append((case_label(shape, True), name, mode, bench(call), g, h))
                if name == "ours":
                    host.append((case_label(shape, True), mode, *host_ms(call)))
                    torch.cuda._sleep(200_000_000)  # the GPU stays busy: the profile sees the host alone
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(20):
                        call()
                    prof.disable()
                    torch.cuda.synchronize()
                    path = os.path.join(out_dir, f"host_{mode}_{case_label(shape, True).split()[0]}.txt")
                    with open(path, "w") as fh:
                        stats = pstats.Stats(prof, stream=fh)
                        stats.sort_stats("tottime").print_stats(30)
                        stats.sort_stats("cumulative").print_stats(40)
        q = k = v = do = out = None  # free this shape's tensors before the next
    print(env())
    print("| case | provider | pass | do_bench ms | GPU-only ms | host ms/call |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} |")
    print("\nOur host ms per call, GPU busy (median of 5 x 50 calls), compiled-launch cache on / off:\n")
    print("| case | pass | cached | Triton's launch path |\n|---|---|---|---|")
    for r in host:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} |")


def probe():
    """Does the driver accept 4-D TMA descriptors over a transposed (HF) layout? (tma_ok refuses it.)"""
    A = importlib.import_module("tritonspec.ops.attention")  # the module, even if ops re-exports the function
    use_configs(None, hopper_kernels=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda: torch.randn(2, 333, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)  # noqa
    q, k, v, do = mk(), mk(), mk(), mk()
    o_ptr, lse = A.attention_forward(q, k, v, True, 128**-0.5)
    g_ptr = A.attention_backward(do, q, k, v, o_ptr, lse, True, 128**-0.5)
    saved = A.tma_ok
    A.tma_ok = lambda *t: True
    try:
        o_tma, lse = A.attention_forward(q, k, v, True, 128**-0.5)
        g_tma = A.attention_backward(do, q, k, v, o_tma, lse, True, 128**-0.5)
        torch.cuda.synchronize()
        print(
            "strided TMA ok; max diff vs pointer path:",
            max((a.float() - b.float()).abs().max().item() for a, b in zip((o_tma, *g_tma), (o_ptr, *g_ptr))),
        )
    except Exception as e:
        print(f"strided TMA rejected: {type(e).__name__}: {str(e)[:500]}")
    finally:
        A.tma_ok = saved


# (batch, heads_q, heads_kv, seq, head_dim, window): the padded / packed shapes, and a Mistral-style
# 4096-token window over 16k-token sequences
MASKED_SHAPES = [(4, 32, 8, 4096, 128, None), (8, 32, 8, 2048, 64, None), (1, 32, 8, 16384, 128, 4096)]


def _sdpa_masked(mask):
    """transformers' SDPA attention function with a dense bool mask: what a model runs without us."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def run(q, k, v):
        module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True, training=False)
        return sdpa_attention_forward(module, q, k, v, mask)[0].transpose(1, 2)

    return run


def masked(rounds: int = 3):
    """--masked: see the module docstring."""
    use_configs()  # the nvidia spec as it ships
    print(json.dumps(env()))
    rows = []
    for b, hq, hkv, s, d, window in MASKED_SHAPES:
        g = torch.Generator().manual_seed(s + b)
        cases = []
        if window is None:
            lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
            pos = torch.arange(s)
            # transformers' mask: padding keys masked; our mask function also empties the padding queries
            keep = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
            padded = key_bounds_from_mask((keep & (pos[None, :, None] < lengths[:, None, None])).cuda())
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
            packed = causal_key_bounds(cu_seqlens=cu)
            total = int(lengths.sum())
            cases += [("padded", (b, hq, hkv, s, d), padded, keep[:, None].cuda())]
            cases += [("packed", (1, hq, hkv, total, d), packed, None)]
        else:
            bounds = causal_key_bounds(seq_len=s, window=window, device="cuda").expand(2, b, s).contiguous()
            pos = torch.arange(s, device="cuda")
            keep = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
            cases += [(f"window {window}", (b, hq, hkv, s, d), bounds, keep[None, None].expand(b, 1, s, s))]
        for label, shape, bounds, mask in cases:
            q, k, v, do = make_hf_inputs(shape)
            pairs = int((bounds[1] - bounds[0]).clamp_min(0).sum())
            flops = 4.0 * hq * d * pairs
            providers = [("ours", lambda q, k, v, bounds=bounds: attention(q, k, v, key_bounds=bounds))]
            if mask is not None:
                providers.append(("SDPA+mask", _sdpa_masked(mask)))
            times = {name: [] for name, _ in providers}
            outs = {}
            for _ in range(rounds):
                for name, fn in providers:
                    fwd, bwd, out, grads = time_provider(fn, q, k, v, do)
                    times[name].append((fwd, bwd))
                    outs[name] = (out, grads)
            row = dict(case=label, shape="x".join(map(str, shape)), real_pairs=pairs)
            for name in times:
                fwd = statistics.median(t[0] for t in times[name])
                bwd = statistics.median(t[1] for t in times[name])
                row[name] = dict(
                    fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9, bwd_tflops=2.5 * flops / bwd / 1e9
                )
            if "SDPA+mask" in outs:
                real = bounds[1] > bounds[0]  # (b, s): queries that see a key
                got, want = outs["ours"][0].transpose(1, 2)[real], outs["SDPA+mask"][0].transpose(1, 2)[real]
                row["err_vs_sdpa"] = rel_err(got, want)
            if label == "packed":  # our unmasked causal kernels on the padded shape, per real pair: as shipped
                full = make_hf_inputs((b, hq, hkv, s, d))  # (Hopper's own), and the portable ones
                full_flops = 4.0 * hq * d * b * s * (s + 1) / 2
                for name, hopper in (("unmasked", True), ("unmasked tl", False)):
                    use_configs(None, None, hopper_kernels=hopper)
                    fwd, bwd, _, _ = time_provider(lambda q, k, v: attention(q, k, v, causal=True), *full)
                    row[name] = dict(
                        fwd_ms=fwd,
                        bwd_ms=bwd,
                        fwd_tflops=full_flops / fwd / 1e9,
                        bwd_tflops=2.5 * full_flops / bwd / 1e9,
                    )
                use_configs()
                # and our unmasked causal kernels at the packed sequences' mean length (b of them): causal
                # attention's TFLOP/s grow with the length, so this is the packed batch's own yardstick
                n = int(lengths.float().mean())
                fwd, bwd, _, _ = time_provider(
                    lambda q, k, v: attention(q, k, v, causal=True), *make_hf_inputs((b, hq, hkv, n, d))
                )
                mean_flops = 4.0 * hq * d * b * n * (n + 1) / 2
                row["mean length"] = dict(
                    fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=mean_flops / fwd / 1e9, bwd_tflops=2.5 * mean_flops / bwd / 1e9
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    print(f"\n{'case':<12} {'shape':<18} {'provider':<11} {'fwd ms':>8} {'TF/s':>6} {'bwd ms':>8} {'TF/s':>6}")
    for row in rows:
        for name in ("ours", "SDPA+mask", "unmasked", "unmasked tl", "mean length"):
            if name in row:
                r = row[name]
                print(
                    f"{row['case']:<12} {row['shape']:<18} {name:<11} {r['fwd_ms']:8.3f} {r['fwd_tflops']:6.0f} "
                    f"{r['bwd_ms']:8.3f} {r['bwd_tflops']:6.0f}"
                )
        if "SDPA+mask" in row:
            sp = row["SDPA+mask"]
            print(
                f"{'':<12} {'':<18} {'speedup':<11} {sp['fwd_ms'] / row['ours']['fwd_ms']:8.2f}x {'':>6} "
                f"{sp['bwd_ms'] / row['ours']['bwd_ms']:8.2f}x   err {row['err_vs_sdpa']:.1e}"
            )


# --decode: (batch) x (heads_q, heads_kv) x cache lengths, head_dim 128, one query a step over the whole cache
DECODE_BATCHES = (1, 8)
DECODE_HEADS = ((32, 8), (16, 4))
DECODE_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DECODE_HEAD_DIM = 128
HBM_TBS = 3.0  # the yardstick for our K+V bytes: an H100's measured copy bandwidth (NOTES.md)
ROTATE_BYTES = 256 * 2**20  # K/V copies a timed graph cycles through: over 5x an H100's 50 MB of L2
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
# --decode --smoke: the same code on the CPU interpreter at sizes it runs in seconds
SMOKE_BATCHES, SMOKE_HEADS, SMOKE_LENGTHS, SMOKE_HEAD_DIM = (1, 2), ((4, 1), (8, 2)), (64, 1100), 32


def _decode_ms(fn) -> float:
    """GPU ms per call: median of do_bench_cudagraph's replays; --smoke: one wall-clock call after a warm one."""
    if SMOKE:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _rotating(make, copies):
    """A call that runs ``make(i)``'s function on copy ``i`` round robin: each call of a captured graph reads
    other K/V than the one before."""
    calls = [make(i) for i in range(copies)]
    turn = itertools.count()
    return lambda: calls[next(turn) % copies]()


def _sdpa_decode(backend: str, q, k, v):
    """SDPA with one backend: ``(fn(q, k, v), how GQA is passed)``, or raises where the backend refuses. GQA goes
    in as enable_gqa=True; a backend that refuses it gets k and v repeated to heads_q beforehand (untimed)."""
    be = getattr(SDPBackend, backend)
    group = q.shape[1] // k.shape[1]

    def native(q, k, v):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1)

    try:
        native(q, k, v)
        return native, "enable_gqa" if group > 1 else "-"
    except RuntimeError:
        if group == 1:
            raise

    def repeated(q, k, v):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v)

    repeated(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    return repeated, "repeated k/v"


def decode(out_dir: str, config: dict | None = None):
    """--decode: see the module docstring; ``config`` ({kernel: fields}) overrides our launch configs."""
    if config:
        from harness import override  # bench/harness.py: this script's directory is on sys.path

        with override(sys.modules["tritonspec.ops.attention_decode"], config):
            return _decode(out_dir, config)
    return _decode(out_dir, None)


def _decode(out_dir: str, config: dict | None):
    dev = "cpu" if SMOKE else "cuda"
    dtype = torch.bfloat16
    batches, heads, lengths, d = (
        (SMOKE_BATCHES, SMOKE_HEADS, SMOKE_LENGTHS, SMOKE_HEAD_DIM)
        if SMOKE
        else (DECODE_BATCHES, DECODE_HEADS, DECODE_LENGTHS, DECODE_HEAD_DIM)
    )
    info = dict(device="cpu (smoke run: interpreter, wall clock)", torch=torch.__version__) if SMOKE else env()
    info["decode_config"] = config
    print(json.dumps(info), flush=True)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for b, (hq, hkv), s in itertools.product(batches, heads, lengths):
        group = hq // hkv
        kv_bytes = 2 * b * hkv * s * d * dtype.itemsize
        copies = 1 if SMOKE else max(1, -(-ROTATE_BYTES // kv_bytes))
        q = torch.randn(b, hq, 1, d, device=dev, dtype=dtype, generator=g)
        ks = [torch.randn(b, hkv, s, d, device=dev, dtype=dtype, generator=g) for _ in range(copies)]
        vs = [torch.randn(b, hkv, s, d, device=dev, dtype=dtype, generator=g) for _ in range(copies)]
        row = dict(batch=b, heads_q=hq, heads_kv=hkv, cache=s, head_dim=d, kv_bytes=kv_bytes, copies=copies)
        with torch.no_grad():
            with recording() as launched:
                attention_decode(q, ks[0], vs[0])
            row["splits"] = next(x.grid[1] for x in launched if x.kernel.fn.__name__ == "_decode_partial_kernel")
            ref = F.scaled_dot_product_attention(
                q.float(), ks[0].float(), vs[0].float(), enable_gqa=group > 1
            )  # fp32 math, the yardstick
            row["ours_err"] = rel_err(attention_decode(q, ks[0], vs[0]), ref)
            row["ours_us"] = 1e3 * _decode_ms(_rotating(lambda i: lambda: attention_decode(q, ks[i], vs[i]), copies))
            row["sdpa"] = {}
            for backend in SDPA_BACKENDS:
                try:
                    fn, how = _sdpa_decode(backend, q, ks[0], vs[0])
                    if how == "repeated k/v":
                        kr = [k.repeat_interleave(group, 1) for k in ks]
                        vr = [v.repeat_interleave(group, 1) for v in vs]
                    else:
                        kr, vr = ks, vs
                    us = 1e3 * _decode_ms(_rotating(lambda i: lambda: fn(q, kr[i], vr[i]), copies))  # noqa: B023
                    row["sdpa"][backend] = dict(us=us, gqa=how, err=rel_err(fn(q, kr[0], vr[0]), ref))
                    kr = vr = None
                except Exception as e:  # a backend that refuses the shape (or CUDA graphs) is skipped, and said so
                    row["sdpa"][backend] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        timed = {n: r for n, r in row["sdpa"].items() if "us" in r}
        if timed:
            best = min(timed, key=lambda n: timed[n]["us"])
            row["best_sdpa"], row["best_sdpa_us"] = best, timed[best]["us"]
        row["ours_gbs"] = kv_bytes / (row["ours_us"] * 1e-6) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        q = ks = vs = None  # free this shape's tensors before the next
        if not SMOKE:
            torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode.json"), "w") as fh:
        json.dump(dict(env=info, rows=rows), fh, indent=1)
    print(decode_table(rows))


def decode_table(rows) -> str:
    short = {"FLASH_ATTENTION": "FLASH", "EFFICIENT_ATTENTION": "EFFICIENT", "CUDNN_ATTENTION": "cuDNN", "MATH": "MATH"}
    lines = [
        "| batch | heads q/kv | cache | splits | us ours | us best SDPA | best SDPA (GQA as) | SDPA / ours |"
        f" ours GB/s (K+V) | of {HBM_TBS:.1f} TB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = r.get("best_sdpa")
        sdpa = "n/a" if best is None else f"{r['best_sdpa_us']:.1f}"
        which = "all failed" if best is None else f"{short[best]} ({r['sdpa'][best]['gqa']})"
        ratio = "n/a" if best is None else f"{r['best_sdpa_us'] / r['ours_us']:.2f}x"
        lines.append(
            f"| {r['batch']} | {r['heads_q']}/{r['heads_kv']} | {r['cache']} | {r['splits']} | {r['ours_us']:.1f} | "
            f"{sdpa} | {which} | {ratio} | {r['ours_gbs']:.0f} | {r['ours_gbs'] / (HBM_TBS * 1e3):.0%} |"
        )
    skipped = sorted({f"{short[n]}: {x['error']}" for r in rows for n, x in r["sdpa"].items() if "error" in x}, key=len)
    if skipped:
        lines += ["", "SDPA backends skipped (first error of each kind):"] + [f"- {e}" for e in skipped[:8]]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", metavar="I/N")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--final", action="store_true")
    ap.add_argument("--gqa", action="store_true")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--gap", action="store_true")
    ap.add_argument("--masked", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="with --decode: tiny shapes on the CPU interpreter")
    ap.add_argument("--decode-config", type=json.loads, help="with --decode: {kernel: launch-config fields}, JSON")
    ap.add_argument("--table", help="table.json from --sweep to use instead of the nvidia spec's TABLES")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="of q, k, v and dO")
    args = ap.parse_args(argv)
    if args.smoke and not args.decode:
        ap.error("--smoke goes with --decode")
    global DTYPE
    DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    tables = None
    if args.table:
        with open(args.table) as fh:
            tables = table_from_json(json.load(fh))
    if args.warm:
        i, n = map(int, args.warm.split("/"))
        warm(i, n)
    elif args.sweep:
        sweep(args.out)
    elif args.final or args.gqa:
        compare(args.out, tables, gqa=args.gqa)
    elif args.probe:
        probe()
    elif args.gap:
        gap(args.out)
    elif args.masked:
        masked()
    elif args.decode:
        decode(args.out, args.decode_config)
    else:
        ap.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
