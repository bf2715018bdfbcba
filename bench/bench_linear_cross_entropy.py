"""The fused LM head + cross-entropy on an H100: ours against Liger-Kernel's, torch.compile and eager.

Each provider computes ``cross_entropy(hidden @ weight.T, labels)`` (mean over the non-ignored tokens; 5% of
the labels are ``-100``) and its gradients for hidden and weight, bf16 inputs:
  ours          tritonspec.ops.linear_cross_entropy as it ships
  ours-liger-chunk  the same with Liger's chunk size (next_pow2(N / ceil(V / H)) tokens): Liger's peak, for
                the trade-off
  liger         Liger-Kernel's LigerFusedLinearCrossEntropyLoss (if importable)
  compile       torch.compile of F.linear + F.cross_entropy on fp32 logits (transformers' ForCausalLMLoss)
  eager         the same, eager
Time: fwd+bwd, do_bench median (grads reset to None each call), 3 rounds in rotated provider order, the median
of the rounds. Peak: ``max_memory_allocated`` over one fwd+bwd, less what was allocated before (inputs).

Usage: python bench/bench_linear_cross_entropy.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from harness import emit

lce = importlib.import_module("tritonspec.ops.linear_cross_entropy")  # the module (tritonspec.ops binds the function)

CASES = [(8192, 4096, 128256), (8192, 4096, 151936)]  # (tokens, hidden, vocab): Llama-3's and Qwen3's vocab


def _eager(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)


def providers():
    out = {"ours": lambda h, w, y: lce.linear_cross_entropy(h, w, y)}

    def liger_chunk(h, w, y):
        saved = lce.chunk_tokens
        v, hd = w.shape
        lce.chunk_tokens = lambda n: min(n, triton.next_power_of_2(triton.cdiv(n, triton.cdiv(v, hd))))
        try:
            return lce.linear_cross_entropy(h, w, y)
        finally:
            lce.chunk_tokens = saved

    out["ours-liger-chunk"] = liger_chunk
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda h, w, y: liger(w, h, y)
    except ImportError as e:
        print(f"liger: not importable ({e})", flush=True)
    out["compile"] = torch.compile(_eager)
    out["eager"] = _eager
    return out


def inputs(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < 0.05] = -100
    return hidden, weight, labels


def fwd_bwd(fn, h, w, y):
    h.grad = w.grad = None
    loss = fn(h, w, y)
    loss.backward()
    return loss


def peak_bytes(fn, h, w, y):
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, h, w, y)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    provs = providers()
    rows = []
    for n, hdim, v in CASES:
        h, w, y = inputs(n, hdim, v)
        ref = fwd_bwd(_eager, h, w, y).detach()
        ref_grads = (h.grad.clone(), w.grad.clone())
        res = {}
        for name, fn in provs.items():
            try:
                loss = fwd_bwd(fn, h, w, y).detach()
                err = max(rel_err(loss, ref), rel_err(h.grad, ref_grads[0]), rel_err(w.grad, ref_grads[1]))
                res[name] = dict(err=err, peak=peak_bytes(fn, h, w, y), times=[])
            except Exception as e:  # a provider that cannot run this case is reported, not fatal
                print(f"{name} {n}x{hdim}x{v}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            torch.cuda.empty_cache()
        names = list(res)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res[name]["times"].append(
                    triton.testing.do_bench(
                        lambda: fwd_bwd(provs[name], h, w, y), warmup=5, rep=200, grad_to_none=[h, w]
                    )
                )
                torch.cuda.empty_cache()
        for name in names:
            res[name]["ms"] = statistics.median(res[name]["times"])
            print(
                f"{n}x{hdim}x{v} {name}: {res[name]['ms']:.2f} ms, peak {res[name]['peak'] / 2**20:.0f} MiB, "
                f"err {res[name]['err']:.1e}",
                flush=True,
            )
        rows.append(((n, hdim, v), res))
        h = w = y = ref_grads = None  # free the case before the next one
        torch.cuda.empty_cache()

    p = torch.cuda.get_device_properties(0)
    lines = [
        f"Device: {p.name}; torch {torch.__version__}, triton {triton.__version__}; bf16; "
        f"{datetime.date.today()}; fwd+bwd ms (median of {args.rounds} rounds) and peak MiB above the inputs.",
        "",
        "| tokens x hidden x vocab | provider | fwd+bwd ms | vs liger | peak MiB | vs liger "
        "| max rel. error vs eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, res in rows:
        lg = res.get("liger")
        for name, r in res.items():
            t = f"{r['ms'] / lg['ms']:.2f}x" if lg else "n/a"
            m = f"{r['peak'] / lg['peak']:.3f}x" if lg else "n/a"
            lines.append(
                f"| {'x'.join(map(str, shape))} | {name} | {r['ms']:.2f} | {t} | {r['peak'] / 2**20:.0f} | "
                f"{m} | {r['err']:.1e} |"
            )
    table = "\n".join(lines) + "\n"
    emit(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
