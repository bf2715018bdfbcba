"""Where the host time of one eager forward+backward goes (cProfile), per op and shape.

The eager fwd+bwd rows of bench_kernels.py are host-bound at Llama sizes; this prints, for each
case, the wall time per iteration, how many compiled kernels each cached launcher holds (a growing
count means cache misses), and the top functions by own time.
    python bench/profile_eager.py [--iters 200]
"""
import argparse
import cProfile
import pstats
import time

import torch

from tritonspec.ops import _library, rms_norm, rope


def cases():
    dev, bf = "cuda", torch.bfloat16
    for m, n in ((16384, 4096), (8192, 8192)):
        x = torch.randn(m, n, device=dev, dtype=bf, requires_grad=True)
        w = torch.randn(n, device=dev, dtype=bf, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=bf)
        yield f"rms_norm {m}x{n}", lambda x=x, w=w, dy=dy: rms_norm(x, w).backward(dy)
    for b, hq, s in ((4, 32, 4096), (1, 64, 8192)):
        q = torch.randn(b, hq, s, 128, device=dev, dtype=bf, requires_grad=True)
        k = torch.randn(b, 8, s, 128, device=dev, dtype=bf, requires_grad=True)
        cos = torch.randn(b, s, 128, device=dev, dtype=bf)
        sin = torch.randn(b, s, 128, device=dev, dtype=bf)
        dq, dk = torch.randn_like(q), torch.randn_like(k)

        def step(q=q, k=k, cos=cos, sin=sin, dq=dq, dk=dk):
            qe, ke = rope(q, k, cos, sin)
            torch.autograd.backward((qe, ke), (dq, dk))
        yield f"rope {b}x{hq}/8x{s}x128", step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    for name, step in cases():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        host = (time.perf_counter() - t0) / args.iters * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.iters * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            step()
        prof.disable()
        torch.cuda.synchronize()
        held = {k: len(v.compiled) for k, v in _library._cached_launchers.items()}
        print(f"\n== {name}: host {host:.3f} ms/iter (issue), wall {wall:.3f} ms/iter; "
              f"compiled kernels per launcher {sorted(held.values())}")
        pstats.Stats(prof).strip_dirs().sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
