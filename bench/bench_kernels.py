"""Benchmark RMSNorm, SwiGLU and RoPE (forward, forward+backward) against torch eager, torch.compile and
Liger-Kernel at Llama-3 8B/70B shapes, in bf16, on one GPU.

    python bench/bench_kernels.py [--out FILE.md] [--sweep] [--cudagraph] [--budget 300]

Per (op, shape, impl, mode): median / p20 / p80 time from ``triton.testing.do_bench``, achieved
bandwidth over the minimal bytes, % of the device-to-device copy bandwidth measured in the same
run, our speed-up over that impl, and the peak memory of one forward+backward above the live
inputs. Minimal bytes: forward reads each input once and writes each output once; forward+backward
is RMSNorm 5*M*N*2, SwiGLU 8*M*N*2, RoPE 4*(|q|+|k|)*2. Our outputs and gradients are checked
against the float64 references before timing. ``--sweep`` also times launch-config variants of our
kernels (tuning data, not results). ``--smoke`` runs tiny shapes on the CPU interpreter to check
this script itself.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
CUDAGRAPH = "--cudagraph" in sys.argv and not SMOKE
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from tritonspec.ops import _library, rms_norm, rope, swiglu  # noqa: E402
from harness import override, quantiles  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from numerics import assert_close  # noqa: E402  (the tests' float64 error model)

# The op modules themselves (the package re-exports functions of the same names).
rms_mod = sys.modules["tritonspec.ops.rms_norm"]
rope_mod = sys.modules["tritonspec.ops.rope"]
swiglu_mod = sys.modules["tritonspec.ops.swiglu"]

DEV = "cpu" if SMOKE else "cuda"
DT = torch.bfloat16
T0 = time.time()

try:  # Liger's PyPI wheel is pure Python
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    try:
        LIGER = importlib.metadata.version("liger_kernel")
    except importlib.metadata.PackageNotFoundError:
        LIGER = "unknown version"
    LIGER = None if SMOKE else LIGER
except Exception as e:  # noqa: BLE001
    LIGER = None
    print(f"# Liger-Kernel unavailable: {type(e).__name__}: {e}")


# -- baselines: the Hugging Face formulas ------------------------------------------------------
def hf_rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_swiglu(g, u):
    return F.silu(g) * u


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# -- timing --------------------------------------------------------------------------------------
def bench(fn, grad_to_none):
    """(median, p20, p80) in ms."""
    return quantiles(fn, smoke=SMOKE, grad_to_none=grad_to_none)


def peak_mib(fn, grad_to_none):
    """Peak allocated during one call, above what was live before it (inputs, dy)."""
    if SMOKE:
        fn()
        return float("nan")
    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in grad_to_none:
        t.grad = None
    return peak / 2**20


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB of bf16 (read + write), bytes/s."""
    n = (1 << 29) if not SMOKE else 1 << 16
    src = torch.randn(n, device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), [])[0]
    return 2 * n * 2 / (ms * 1e-3)


def _backward(out, grads):
    if isinstance(out, tuple):
        torch.autograd.backward(out, grads)
    else:
        out.backward(grads[0])


ROWS = []


def run_case(op, shape, impls, inputs, grads, fwd_bytes, fb_bytes, copy_bw):
    """Time every impl on one shape (forward, forward+backward) and append result rows."""
    results = {}
    for name, fn in impls.items():
        if name.endswith("in-place bwd"):
            modes = ("fwd+bwd",)
        else:
            modes = ("fwd", "fwd+bwd")
        for mode in modes:
            if mode == "fwd":
                call = lambda fn=fn: fn(*inputs)  # noqa: E731
            else:
                call = lambda fn=fn: _backward(fn(*inputs), grads)  # noqa: E731
            try:
                leaves = [x for x in inputs if x.requires_grad]
                t = bench(call, leaves)
                mem = peak_mib(call, leaves) if mode == "fwd+bwd" else None
                # the same eager call with autograd's backward on the calling thread instead of its CUDA
                # device thread: what is left of the host cost once the thread hand-offs are gone
                one_ms = float("nan")
                if mode == "fwd+bwd":
                    with torch.autograd.set_multithreading_enabled(False):
                        one_ms = bench(call, leaves)[0]
            except Exception as e:  # noqa: BLE001
                print(f"# {op} {shape} {name} {mode}: {type(e).__name__}: {str(e)[:300]}")
                continue
            graph_ms = float("nan")
            if CUDAGRAPH:  # GPU time alone: the same calls replayed from a CUDA graph, no host overhead
                try:
                    graph_ms = triton.testing.do_bench_cudagraph(
                        call, rep=100, grad_to_none=[x for x in inputs if x.requires_grad], quantiles=[0.5]
                    )
                    graph_ms = graph_ms[0] if isinstance(graph_ms, (list, tuple)) else graph_ms
                except Exception as e:  # noqa: BLE001
                    print(f"# {op} {shape} {name} {mode} cudagraph: {type(e).__name__}: {str(e)[:200]}")
            results[(name, mode)] = (t, mem, graph_ms, one_ms)
    for (name, mode), (t, mem, graph_ms, one_ms) in results.items():
        nbytes = fwd_bytes if mode == "fwd" else fb_bytes
        ours = results.get(("tritonspec", mode))
        ROWS.append(
            dict(
                op=op,
                shape=shape,
                impl=name,
                mode=mode,
                ms=t[0],
                p20=t[1],
                p80=t[2],
                gbs=nbytes / (t[0] * 1e-3) / 1e9,
                pct=100 * nbytes / (t[0] * 1e-3) / copy_bw,
                speedup=(t[0] / ours[0][0]) if ours else float("nan"),
                mem=mem,
                graph_ms=graph_ms,
                graph_pct=100 * nbytes / (graph_ms * 1e-3) / copy_bw,
                one_ms=one_ms,
                one_pct=100 * nbytes / (one_ms * 1e-3) / copy_bw,
            )
        )
        r = ROWS[-1]
        graph = f" graph {graph_ms:.4f} ms {r['graph_pct']:5.1f}%" if CUDAGRAPH else ""
        graph += f" one-thread {one_ms:.4f} ms {r['one_pct']:5.1f}%" if mode == "fwd+bwd" else ""
        print(
            f"{op:8s} {shape:24s} {mode:8s} {name:26s} {r['ms']:8.4f} ms {r['gbs']:7.0f} GB/s {r['pct']:5.1f}% "
            f"x{r['speedup']:5.2f} mem={'' if mem is None else f'{mem:.0f} MiB'}{graph}",
            flush=True,
        )


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _compiled(fn):
    return torch.compile(fn, dynamic=False) if not SMOKE else fn


# -- verification (float64 references) ---------------------------------------------------------
def verify(op, fn, ref, inputs, names):
    """``fn(*inputs)`` and its input gradients against ``ref`` on float64 copies (outputs, then grads)."""
    leaves, leaves64 = [_leaf(t) for t in inputs], [_leaf(t.double()) for t in inputs]
    outs, refs = fn(*leaves), ref(*leaves64)
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, [g.double() for g in grads])
    got = [*outs, *(t.grad for t in leaves)]
    want = [*refs, *(t.grad for t in leaves64)]
    for name, a, b in zip(names, got, want):
        assert_close(a, b, f"{op} {name}")


# -- cases -------------------------------------------------------------------------------------
def rms_cases(copy_bw, shapes):
    for i, (m, n) in enumerate(shapes):
        x = torch.randn(m, n, device=DEV, dtype=DT)
        w = (1 + 0.1 * torch.randn(n, device=DEV)).to(DT)
        if i == 0:
            verify("rms", rms_norm, rms_mod.rms_norm_ref, [x, w], ["y", "dx", "dw"])
        x, w = _leaf(x), _leaf(w)
        dy = torch.randn_like(x)
        impls = {
            "tritonspec": lambda x, w: rms_norm(x, w),
            "tritonspec in-place bwd": lambda x, w: rms_norm(x, w, in_place_backward=True),
            "torch eager": hf_rms_norm,
            "torch.compile": _compiled(hf_rms_norm),
        }
        if LIGER:
            impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
        run_case("rmsnorm", f"{m}x{n}", impls, [x, w], [dy], 2 * m * n * 2 + n * 2, 5 * m * n * 2, copy_bw)
        del x, w, dy, impls
        torch.cuda.empty_cache() if not SMOKE else None


def swiglu_cases(copy_bw, shapes):
    for i, (m, n) in enumerate(shapes):
        g = torch.randn(m, n, device=DEV, dtype=DT)
        u = torch.randn(m, n, device=DEV, dtype=DT)
        if i == 0:
            verify("swiglu", swiglu, swiglu_mod.swiglu_ref, [g, u], ["y", "dg", "du"])
        g, u = _leaf(g), _leaf(u)
        dy = torch.randn_like(g)
        impls = {
            "tritonspec": lambda g, u: swiglu(g, u),
            "tritonspec in-place bwd": lambda g, u: swiglu(g, u, in_place_backward=True),
            "torch eager": hf_swiglu,
            "torch.compile": _compiled(hf_swiglu),
        }
        if LIGER:
            impls["liger"] = lambda g, u: LigerSiLUMulFunction.apply(g, u)
        run_case("swiglu", f"{m}x{n}", impls, [g, u], [dy], 3 * m * n * 2, 8 * m * n * 2, copy_bw)
        del g, u, dy, impls
        torch.cuda.empty_cache() if not SMOKE else None


def rope_cases(copy_bw, shapes):
    for i, (b, hq, hk, s, d) in enumerate(shapes):
        q = torch.randn(b, hq, s, d, device=DEV, dtype=DT)
        k = torch.randn(b, hk, s, d, device=DEV, dtype=DT)
        inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
        emb = torch.cat([torch.arange(s, device=DEV).float()[:, None] * inv] * 2, -1)[None].repeat(b, 1, 1)
        cos, sin = emb.cos().to(DT), emb.sin().to(DT)
        if i == 0:
            verify(
                "rope",
                lambda q, k: rope(q, k, cos, sin),
                lambda q, k: rope_mod.rope_ref(q, k, cos, sin),
                [q, k],
                ["q", "k", "dq", "dk"],
            )
        q, k = _leaf(q), _leaf(k)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        impls = {
            "tritonspec": lambda q, k: rope(q, k, cos, sin),
            "tritonspec in-place bwd": lambda q, k: rope(q, k, cos, sin, in_place_backward=True),
            "torch eager": lambda q, k: hf_rope(q, k, cos, sin),
        }
        compiled = _compiled(hf_rope)
        impls["torch.compile"] = lambda q, k: compiled(q, k, cos, sin)
        if LIGER:
            impls["liger"] = lambda q, k: LigerRopeFunction.apply(q, k, cos, sin)
        qk = (q.numel() + k.numel()) * 2
        run_case(
            "rope", f"{b}x{hq}/{hk}x{s}x{d}", impls, [q, k], [dq, dk], 2 * qk + 2 * cos.numel() * 2, 4 * qk, copy_bw
        )
        del q, k, dq, dk, impls
        torch.cuda.empty_cache() if not SMOKE else None


# -- dispatch overhead: raw launcher (eager default) vs the torch.library op ----------------------
def dispatch_overhead():
    """Microseconds per forward call on tiny inputs (CPU-bound), with grad-requiring inputs."""
    x, w = _leaf(torch.randn(4, 4096, device=DEV, dtype=DT)), _leaf(torch.randn(4096, device=DEV, dtype=DT))
    cases = {"rms_norm 4x4096": lambda: rms_norm(x, w)}
    if LIGER:
        cases["liger rms_norm 4x4096"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-6)
    cases["torch eager rms_norm 4x4096"] = lambda: hf_rms_norm(x, w)
    out = {}
    for name, fn in cases.items():
        for forced in (False, True) if name.startswith("rms_norm") else (False,):
            _library.FORCE_LIBRARY_OP = forced
            for _ in range(20):
                fn()
            if not SMOKE:
                torch.cuda.synchronize()
            n = 300 if not SMOKE else 3
            t = time.perf_counter()
            for _ in range(n):
                fn()
            if not SMOKE:
                torch.cuda.synchronize()
            label = name + (" via torch.library op" if forced else (" raw launcher" if name.startswith("rms") else ""))
            out[label] = (time.perf_counter() - t) / n * 1e6
    _library.FORCE_LIBRARY_OP = False
    for k, v in out.items():
        print(f"dispatch {k:45s} {v:7.1f} us/call")
    return out


# -- launch-config sweep (tuning data) ---------------------------------------------------------------
def sweep(budget_s):
    """Kernel-level timings of launch-config variants, most important first, until ``budget_s``."""
    lines = []

    def t(fn):
        return bench(fn, [])[0]

    def log(s):
        lines.append(s)
        print("sweep", s, flush=True)

    def over():
        return time.time() - T0 > budget_s

    rms = {}
    for m, n in [(16384, 4096), (8192, 8192)] if not SMOKE else [(8, 64)]:
        x = torch.randn(m, n, device=DEV, dtype=DT)
        w = torch.randn(n, device=DEV, dtype=DT)
        rms[(m, n)] = (x, w, torch.randn_like(x), rms_mod.rms_norm_forward(x, w, 1e-6)[2])
    for (m, n), (x, w, dy, rstd) in rms.items():
        for bm in (1, 2):
            for nw in (8, 16):
                for ppu in (2, 4, 8):
                    if over():
                        return lines
                    cfg = {"rms_norm_bwd": {"BLOCK_M": bm, "num_warps": nw, "programs_per_unit": ppu}}
                    with override(rms_mod, cfg):
                        try:
                            ms = t(lambda: rms_mod.rms_norm_backward(dy, x, w, rstd))
                        except Exception as e:  # noqa: BLE001 (out of resources)
                            log(f"rms_norm_bwd {m}x{n} {cfg}: {type(e).__name__}")
                            continue
                    log(
                        f"rms_norm_bwd {m}x{n} BLOCK_M={bm} warps={nw} ppu={ppu}: {ms:.4f} ms "
                        f"{3 * m * n * 2 / ms / 1e6:.0f} GB/s"
                    )
    b, hq, hk, s, d = (4, 32, 8, 4096, 128) if not SMOKE else (1, 4, 2, 8, 16)
    q = torch.randn(b, hq, s, d, device=DEV, dtype=DT)
    k = torch.randn(b, hk, s, d, device=DEV, dtype=DT)
    cos, sin = torch.randn(b, s, d, device=DEV, dtype=DT), torch.randn(b, s, d, device=DEV, dtype=DT)
    qk = (q.numel() + k.numel()) * 2
    for bs in (4, 8, 16):
        for bh in (4, 8):
            for nw in (4, 8):
                if over():
                    return lines
                with override(
                    rope_mod, {"rope": {"BLOCK_S": bs, "BLOCK_HQ": bh, "BLOCK_HK": min(bh, hk), "num_warps": nw}}
                ):
                    ms = t(lambda: rope_mod.rope_forward(q, k, cos, sin))
                log(
                    f"rope {b}x{hq}/{hk}x{s}x{d} BLOCK_S={bs} BLOCK_H={bh} warps={nw}: {ms:.4f} ms "
                    f"{(2 * qk + 2 * cos.numel() * 2) / ms / 1e6:.0f} GB/s"
                )
    q = k = cos = sin = None  # freed (not del: the timed lambdas above name them)
    for (m, n), (x, w, dy, rstd) in rms.items():
        for bm in (1, 2, 4):
            for nw in (4, 8, 16):
                if over():
                    return lines
                with override(rms_mod, {"rms_norm_fwd": {"BLOCK_M": bm, "num_warps": nw}}):
                    ms = t(lambda: rms_mod.rms_norm_forward(x, w, 1e-6))
                log(f"rms_norm_fwd {m}x{n} BLOCK_M={bm} warps={nw}: {ms:.4f} ms {2 * m * n * 2 / ms / 1e6:.0f} GB/s")
    del rms
    m, n = (16384, 14336) if not SMOKE else (4, 96)
    g, u = (torch.randn(m, n, device=DEV, dtype=DT) for _ in range(2))
    dy = torch.randn_like(g)
    for block in (1024, 2048, 4096, 8192):
        for nw in (4, 8):
            if over():
                return lines
            cfg = {"BLOCK_N": block, "BLOCK_M": 1, "num_warps": nw}
            with override(swiglu_mod, {"swiglu_fwd": cfg, "swiglu_bwd": cfg}):
                f = t(lambda: swiglu_mod.swiglu_forward(g, u))
                bw = t(lambda: swiglu_mod.swiglu_backward(dy, g, u))
            log(
                f"swiglu {m}x{n} BLOCK={block} warps={nw}: fwd {f:.4f} ms {3 * m * n * 2 / f / 1e6:.0f} GB/s, "
                f"bwd {bw:.4f} ms {5 * m * n * 2 / bw / 1e6:.0f} GB/s"
            )
    return lines


# -- report --------------------------------------------------------------------------------------
def markdown(copy_bw, device, dispatch, sweep_lines) -> str:
    liger = LIGER or "not available"
    out = [
        f"# Kernel benchmarks: RMSNorm, SwiGLU, RoPE ({'SMOKE RUN, CPU interpreter' if SMOKE else 'bf16'})",
        "",
        f"- device: {device}",
        f"- torch {torch.__version__}, triton {triton.__version__}, Liger-Kernel {liger}",
        f"- date: {datetime.date.today().isoformat()}; command: `python bench/bench_kernels.py`",
        f"- measured copy bandwidth (1 GiB bf16 device-to-device, read+write): {copy_bw / 1e12:.2f} TB/s",
        "- time: `triton.testing.do_bench` median (p20-p80) over ~100 ms of runs; forward runs with "
        "grad-requiring inputs (the training forward)",
        "- GB/s and % copy over minimal bytes; speed-up = impl time / tritonspec time (>1: tritonspec faster);",
        "  peak = max allocated during one forward+backward above the live inputs and output gradient",
        "- one-thread autograd: the same eager call under `torch.autograd.set_multithreading_enabled(False)`",
        "  (the backward runs on the calling thread, not on autograd's CUDA device thread)",
        "- `tritonspec in-place bwd`: `in_place_backward=True` (gradient written into the incoming gradient,",
        "  or into gate/up for SwiGLU) -- the memory model Liger uses by default for RMSNorm and SwiGLU",
        "",
    ]
    for op in ("rmsnorm", "swiglu", "rope"):
        rows = [r for r in ROWS if r["op"] == op]
        if not rows:
            continue
        gh = " CUDA-graph ms (% copy) |" if CUDAGRAPH else ""
        out += [
            f"## {op}",
            "",
            "| shape | mode | impl | median ms (p20-p80) | GB/s | % copy | tritonspec speed-up "
            f"| peak MiB | one-thread autograd ms (% copy) |{gh}",
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if CUDAGRAPH else ""),
        ]
        for r in rows:
            mem = "" if r["mem"] is None else f"{r['mem']:.0f}"
            one = "" if r["mode"] == "fwd" else f"{r['one_ms']:.4f} ({r['one_pct']:.1f})"
            g = f" {one} |" + (f" {r['graph_ms']:.4f} ({r['graph_pct']:.1f}) |" if CUDAGRAPH else "")
            out.append(
                f"| {r['shape']} | {r['mode']} | {r['impl']} | {r['ms']:.4f} ({r['p20']:.4f}-{r['p80']:.4f}) "
                f"| {r['gbs']:.0f} | {r['pct']:.1f} | {r['speedup']:.2f} | {mem} |{g}"
            )
        out.append("")
    if dispatch:
        out += ["## Eager dispatch cost (tiny inputs, CPU-bound, us per forward call)", ""]
        out += [f"- {k}: {v:.1f} us" for k, v in dispatch.items()]
        out.append("")
    if sweep_lines:
        out += ["## Launch-config sweep (tuning data)", "", "```"] + sweep_lines + ["```", ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds after which optional parts are skipped")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--cudagraph",
        action="store_true",
        help="also time each call replayed from a CUDA graph (GPU time without host overhead)",
    )
    ap.add_argument("--ops", default="rmsnorm,swiglu,rope")
    args = ap.parse_args()
    device = "CPU (interpreter)" if SMOKE else torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    print(
        f"# {device}; torch {torch.__version__}; triton {triton.__version__}; liger {LIGER}; "
        f"copy {copy_bw / 1e12:.2f} TB/s",
        flush=True,
    )
    ops = args.ops.split(",")
    if SMOKE:
        rms_shapes, swiglu_shapes, rope_shapes = [(8, 64)], [(8, 96)], [(1, 4, 2, 8, 16)]
    else:
        rms_shapes = [(16384, 4096), (8192, 8192), (32768, 8192)]
        swiglu_shapes = [(16384, 14336), (16384, 28672)]
        rope_shapes = [(4, 32, 8, 4096, 128), (1, 64, 8, 8192, 128)]
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def write(dispatch=None, sweep_lines=()):  # after every part, so a timeout keeps what ran
        if not args.out:
            return
        with open(args.out, "w") as f:
            f.write(markdown(copy_bw, device, dispatch, list(sweep_lines)))

    for name, cases, shapes in (
        ("rmsnorm", rms_cases, rms_shapes),
        ("swiglu", swiglu_cases, swiglu_shapes),
        ("rope", rope_cases, rope_shapes),
    ):
        if name in ops:
            cases(copy_bw, shapes)
            write()
    dispatch = dispatch_overhead()
    write(dispatch)
    sweep_lines = sweep(args.budget) if args.sweep else []
    write(dispatch, sweep_lines)
    print(f"# done in {time.time() - T0:.0f} s" + (f"; tables in {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()
