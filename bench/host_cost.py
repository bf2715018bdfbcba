"""Host microseconds per call of each piece of an eager forward+backward (tiny inputs, GPU idle).

Eager fwd+bwd of RMSNorm and RoPE at Llama sizes sits close to the host's limit (bench/RESULTS.md, section 1). This
splits the host time into PyTorch's floor (an autograd Function that does nothing, an allocation, a
raw launch of an already compiled kernel) and each layer of ours, so the next change aims at the
largest piece. Inputs are tiny so the GPU never becomes the bottleneck. Also prints a timeline of
one fwd+bwd (forward, hand-off to autograd's device thread, our backward, hand-off back) and the
torch profiler's per-op host time.
    python bench/host_cost.py [--shapes]   (--shapes: also eager fwd+bwd at the Llama shapes, launch
    plans on and off, and with autograd running the backward on the calling thread)
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from tritonspec.launch import launch_config
from tritonspec.ops import _library, rms_norm, rope

rms_mod = sys.modules["tritonspec.ops.rms_norm"]
rope_mod = sys.modules["tritonspec.ops.rope"]
DEV, BF = "cuda", torch.bfloat16


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / n * 1e6


class Nothing(torch.autograd.Function):
    """The floor of any Python autograd op: no allocation, no launch."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def leaf(t):
    return t.requires_grad_(True)


class _NoStore(dict):
    def __setitem__(self, key, value):
        pass


@contextlib.contextmanager
def plans_off():
    """The ops' eager LaunchPlans disabled (every call takes the launch config + cached-launcher path)."""
    saved = rms_mod._FWD_PLANS, rms_mod._BWD_PLANS, rope_mod._PLANS
    rms_mod._FWD_PLANS, rms_mod._BWD_PLANS, rope_mod._PLANS = _NoStore(), _NoStore(), _NoStore()
    try:
        yield
    finally:
        rms_mod._FWD_PLANS, rms_mod._BWD_PLANS, rope_mod._PLANS = saved


def main():
    rows = {}
    x = leaf(torch.randn(4, 4096, device=DEV, dtype=BF))
    w = leaf(torch.randn(4096, device=DEV, dtype=BF))
    dy = torch.randn(4, 4096, device=DEV, dtype=BF)
    x0, w0 = x.detach(), w.detach()

    def fb(fn, *leaves):
        def step():
            for t in leaves:
                t.grad = None
            fn()

        return step

    rows["torch.empty(4x4096)"] = per_call_us(lambda: torch.empty((4, 4096), device=DEV, dtype=BF))
    rows["x.mul(2) no grad"] = per_call_us(lambda: x0.mul(2))
    rows["x.mul(2) fwd+bwd"] = per_call_us(fb(lambda: x.mul(2).backward(dy), x))
    rows["Nothing fwd"] = per_call_us(lambda: Nothing.apply(x))
    rows["Nothing fwd+bwd"] = per_call_us(fb(lambda: Nothing.apply(x).backward(dy), x))

    # one compiled kernel, launched three ways
    y, _, rstd = rms_mod.rms_norm_forward(x0, w0, 1e-6)
    cl = _library._cached_launchers[id(rms_mod._rms_norm_fwd_kernel)]
    compiled = next(iter(cl.compiled.values()))[0]
    # pointers, sizes, strides, eps: the kernel's parameters in order
    args = (x0, x0, y, y, w0, rstd, 4, 4096, x0.stride(0), x0.stride(0), y.stride(0), y.stride(0), 1e-6)
    config = rms_mod.RMSNormForward
    cfg = launch_config(config, x0.device, lambda: None, N=4096, dtype=str(x0.dtype))
    grid = (_library.cdiv(4, cfg.BLOCK_M), 1, 1)
    bound = args + (cfg.BLOCK_M, cfg.BLOCK_N, False, False)
    runner = compiled[grid]
    rows["CompiledKernel[grid](*args)"] = per_call_us(lambda: compiled[grid](*bound))
    rows["runner(*args) (grid bound)"] = per_call_us(lambda: runner(*bound))
    rows["CachedLauncher launch"] = per_call_us(
        lambda: cl[grid[:1]](
            *args, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, HAS_RESIDUAL=False, LOOPED=False, **cfg.options
        )
    )
    rows["JITFunction[grid] launch"] = per_call_us(
        lambda: rms_mod._rms_norm_fwd_kernel[grid[:1]](
            *args, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, HAS_RESIDUAL=False, LOOPED=False, **cfg.options
        )
    )
    rows["kernel_config hit"] = per_call_us(
        lambda: launch_config(config, x0.device, lambda: None, N=4096, dtype=str(x0.dtype))
    )
    rows["rms_norm_forward (allocs+launch)"] = per_call_us(lambda: rms_mod.rms_norm_forward(x0, w0, 1e-6))
    rows["rms_norm_backward (allocs+2 launches)"] = per_call_us(lambda: rms_mod.rms_norm_backward(dy, x0, w0, rstd))
    rows["rms_norm no grad"] = per_call_us(lambda: rms_norm(x0, w0))
    rows["rms_norm fwd (grad)"] = per_call_us(lambda: rms_norm(x, w))
    rms_fb = fb(lambda: rms_norm(x, w).backward(dy), x, w)
    rows["rms_norm fwd+bwd"] = per_call_us(rms_fb)
    with torch.autograd.set_multithreading_enabled(False):
        rows["Nothing fwd+bwd, autograd on one thread"] = per_call_us(fb(lambda: Nothing.apply(x).backward(dy), x))
        rows["rms_norm fwd+bwd, autograd on one thread"] = per_call_us(rms_fb)
    with plans_off():
        rows["rms_norm fwd+bwd, no launch plans"] = per_call_us(rms_fb)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        liger = fb(lambda: LigerRMSNormFunction.apply(x, w, 1e-6).backward(dy), x, w)
        rows["liger rms_norm fwd+bwd"] = per_call_us(liger)
    except ImportError:
        pass

    q = leaf(torch.randn(1, 4, 16, 128, device=DEV, dtype=BF))
    k = leaf(torch.randn(1, 2, 16, 128, device=DEV, dtype=BF))
    cos, sin = torch.randn(1, 16, 128, device=DEV, dtype=BF), torch.randn(1, 16, 128, device=DEV, dtype=BF)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    rows["rope no grad"] = per_call_us(lambda: rope(q.detach(), k.detach(), cos, sin))
    rope_fb = fb(lambda: torch.autograd.backward(rope(q, k, cos, sin), (dq, dk)), q, k)
    rows["rope fwd+bwd"] = per_call_us(rope_fb)
    with plans_off():
        rows["rope fwd+bwd, no launch plans"] = per_call_us(rope_fb)

    # the ladder from PyTorch's floor to the full op
    class FwdOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y, _, rstd = rms_mod.rms_norm_forward(x, w, 1e-6)
            ctx.save_for_backward(x, w, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            return dy, None

    class Direct(FwdOnly):
        @staticmethod
        def backward(ctx, dy):
            x, w, rstd = ctx.saved_tensors
            return rms_mod.rms_norm_backward(dy, x, w, rstd)

    rows["FwdOnly fwd+bwd (bwd returns dy)"] = per_call_us(fb(lambda: FwdOnly.apply(x, w).backward(dy), x, w))
    rows["Direct fwd+bwd (no checks/views)"] = per_call_us(fb(lambda: Direct.apply(x, w).backward(dy), x, w))
    rows["Direct fwd+bwd via autograd.grad"] = per_call_us(lambda: torch.autograd.grad(Direct.apply(x, w), (x, w), dy))

    # timeline of one fwd+bwd: forward, hand-off to autograd's device thread, our backward body,
    # hand-off back (means over many iterations, us)
    marks = {"fwd": 0.0, "to_bwd": 0.0, "bwd_body": 0.0, "bwd_kernels": 0.0, "back": 0.0}
    stamp = {}

    class Probe(FwdOnly):
        @staticmethod
        def backward(ctx, dy):
            t1 = time.perf_counter()
            x, w, rstd = ctx.saved_tensors
            t_k = time.perf_counter()
            out = rms_mod.rms_norm_backward(dy, x, w, rstd)
            t2 = time.perf_counter()
            stamp.update(t1=t1, t2=t2, tk=t2 - t_k)
            return out

    n_probe = 1000
    for i in range(n_probe + 50):
        x.grad = w.grad = None
        t0 = time.perf_counter()
        y = Probe.apply(x, w)
        tf = time.perf_counter()
        y.backward(dy)
        t3 = time.perf_counter()
        if i >= 50:
            marks["fwd"] += tf - t0
            marks["to_bwd"] += stamp["t1"] - tf
            marks["bwd_body"] += stamp["t2"] - stamp["t1"]
            marks["bwd_kernels"] += stamp["tk"]
            marks["back"] += t3 - stamp["t2"]
    torch.cuda.synchronize()
    print("timeline us: " + ", ".join(f"{k} {v / n_probe * 1e6:.1f}" for k, v in marks.items()))

    # where the host time of our fwd+bwd goes, per thread (the backward runs on autograd's device thread)
    from torch.profiler import ProfilerActivity, profile

    step = fb(lambda: rms_norm(x, w).backward(dy), x, w)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(200):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    print("\n| piece | host us/call |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    if "--shapes" in sys.argv:
        llama_shapes()


def llama_shapes():
    """Eager fwd+bwd at the issue's RMSNorm and RoPE shapes, % of copy bandwidth, with and without
    the ops' launch plans (Liger's RMSNorm has no plans: its two columns show the host's drift)."""
    import triton

    def bench(fn, leaves):
        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")

    src = torch.randn(1 << 29, device=DEV, dtype=BF)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / (bench(lambda: dst.copy_(src), []) * 1e-3)
    src = dst = None  # free 2 GiB before the cases
    print(f"\ncopy {copy_bw / 1e12:.2f} TB/s")
    cases = []
    for m, n in ((16384, 4096), (8192, 8192), (32768, 8192)):
        x = leaf(torch.randn(m, n, device=DEV, dtype=BF))
        w = leaf(torch.randn(n, device=DEV, dtype=BF))
        dy = torch.randn(m, n, device=DEV, dtype=BF)
        cases.append((f"rms_norm {m}x{n}", lambda x=x, w=w, dy=dy: rms_norm(x, w).backward(dy), [x, w], 5 * m * n * 2))
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            cases.append(
                (
                    f"liger rms_norm {m}x{n}",
                    lambda x=x, w=w, dy=dy: LigerRMSNormFunction.apply(x, w, 1e-6).backward(dy),
                    [x, w],
                    5 * m * n * 2,
                )
            )
        except ImportError:
            pass
    for b, hq, s in ((4, 32, 4096), (1, 64, 8192)):
        q = leaf(torch.randn(b, hq, s, 128, device=DEV, dtype=BF))
        k = leaf(torch.randn(b, 8, s, 128, device=DEV, dtype=BF))
        cos, sin = torch.randn(b, s, 128, device=DEV, dtype=BF), torch.randn(b, s, 128, device=DEV, dtype=BF)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        cases.append(
            (
                f"rope {b}x{hq}/8x{s}x128",
                lambda q=q, k=k, c=cos, s_=sin, dq=dq, dk=dk: torch.autograd.backward(rope(q, k, c, s_), (dq, dk)),
                [q, k],
                4 * (q.numel() + k.numel()) * 2,
            )
        )
    # "one thread": torch.autograd.set_multithreading_enabled(False), so the backward runs on the
    # calling thread instead of autograd's CUDA device thread (no wake-up of another thread and back)
    variants = {
        "launch plans on": contextlib.nullcontext,
        "plans off": plans_off,
        "plans on, autograd on one thread": lambda: torch.autograd.set_multithreading_enabled(False),
    }
    print("| case | " + " | ".join(f"fwd+bwd % of copy, 5 rounds, {v}" for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name, fn, leaves, nbytes in cases:
        pct = {v: [] for v in variants}
        for _ in range(5):  # interleaved, so every column sees the same host
            for v, ctx in variants.items():
                with ctx():
                    pct[v].append(100 * nbytes / (bench(fn, leaves) * 1e-3) / copy_bw)
        print(f"| {name} | " + " | ".join(" / ".join(f"{p:.1f}" for p in pct[v]) for v in variants) + " |")


if __name__ == "__main__":
    main()
