"""What installing tritonspec costs a process that does not use it: ``import triton`` and the first compiles.

Each measurement runs in a fresh process, with the layer off (``TRITONSPEC_DISABLE=1``: stock
Triton) and on, in interleaved rounds; the table gives medians and the spread over rounds.
- import: ``import triton`` (Triton's backend discovery imports our backends, which activate the layer);
- first compiles: two offline sm90 compiles of two small kernels (``triton.compile`` to cubin, a fresh
  cache dir per process), the first a process makes, with and without torch imported beforehand (the
  nvidia spec is loaded by the first CUDA compile; it must not pull in torch or tritonspec.ops).
Targets (the issue that asked for this): import <= +30 ms, first compiles <= +5 %. No GPU needed.

    python bench/spec_overhead.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
if {torch}:
    import torch
t1 = time.perf_counter()
import triton
t2 = time.perf_counter()
result = {{"import_ms": (t2 - t1) * 1e3}}
if {compile}:
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    def scale_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, alpha * tl.load(x_ptr + offs, mask=mask) + tl.exp(tl.load(y_ptr + offs, mask=mask)),
                 mask=mask)

    def dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m = tl.arange(0, M)[:, None]
        n = tl.arange(0, N)[None, :]
        k = tl.arange(0, K)
        c = tl.dot(tl.load(a_ptr + m * K + k[None, :]), tl.load(b_ptr + k[:, None] * N + n))
        tl.store(c_ptr + m * N + n, c)

    target = GPUTarget("cuda", 90, 32)
    t3 = time.perf_counter()
    triton.compile(ASTSource(JITFunction(scale_add), {{"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32",
                   "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"}}, {{"BLOCK": 128}}), target=target)
    triton.compile(ASTSource(JITFunction(dot), {{"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32",
                   "M": "constexpr", "N": "constexpr", "K": "constexpr"}}, {{"M": 64, "N": 64, "K": 64}}),
                   target=target)
    result["compile_ms"] = (time.perf_counter() - t3) * 1e3
    result["loaded"] = sorted(m for m in ("torch", "tritonspec.ops") if m in sys.modules)
print(json.dumps(result))
"""


def run(disable: bool, torch_first: bool, compile_: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(
            os.environ, TRITONSPEC_DISABLE="1" if disable else "0", TRITON_CACHE_DIR=tmp, TRITON_DEFAULT_FP_FUSION="1"
        )
        env.pop("TRITON_INTERPRET", None)
        script = os.path.join(tmp, "child.py")  # @jit functions must live in a file
        with open(script, "w") as f:
            f.write(CHILD.format(torch=torch_first, compile=compile_))
        proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):8.1f} [{q[0]:.1f}-{q[2]:.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    import triton

    cases = [
        ("import triton", False, False, "import_ms"),
        ("2 sm90 compiles, torch not imported", False, True, "compile_ms"),
        ("2 sm90 compiles, torch imported first", True, True, "compile_ms"),
    ]
    rows = []
    for name, torch_first, compile_, key in cases:
        times = {True: [], False: []}
        loaded = set()
        for _ in range(args.rounds):
            for disable in (True, False):  # interleaved: drifts in machine load hit both alike
                r = run(disable, torch_first, compile_)
                times[disable].append(r[key])
                if not disable:
                    loaded.update(r.get("loaded", []))
        stock, ours = statistics.median(times[True]), statistics.median(times[False])
        extra = [] if torch_first else sorted(loaded)
        rows.append(
            (
                name,
                summary(times[True]),
                summary(times[False]),
                ours - stock,
                (ours / stock - 1) * 100,
                ", ".join(extra) or "-",
            )
        )
    print(
        f"triton {triton.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"{args.rounds} rounds; ms, median [quartiles]"
    )
    print(
        f"{'case':40s} {'stock (disabled)':>22s} {'tritonspec':>22s} {'delta ms':>9s} {'delta %':>8s}  "
        "pulled in by the layer"
    )
    for name, stock, ours, delta, pct, extra in rows:
        print(f"{name:40s} {stock:>22s} {ours:>22s} {delta:+9.1f} {pct:+7.1f}%  {extra}")


if __name__ == "__main__":
    main()
