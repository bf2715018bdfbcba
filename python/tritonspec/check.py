"""``tritonspec check``: validate the hook table against the installed Triton, then prove it works.

1. every declared hook has an install point, and every install point applied to this Triton;
2. every spec provider loads and validates (and says where its backend really runs);
3. the kernel table: every kernel's ops and layer load, and which launch configs each backend
   sets (a table by kernel) or leaves to the kernel's default;
4. a few sample kernels compile offline for every backend target and run in the interpreter,
   checked against float64 references.
Exit status 0 only when everything that should apply did.
"""
from __future__ import annotations

import os
import sys
import traceback

import triton
import triton.language as tl

from . import install, kernel_table
from .devices import interpreting
from .hooks import HOOKS
from .launch import ConfigTable
from .registry import ALLOW_ENV, REGISTRY

# Points in tritonspec's own code (consulted by its ops, not installed into Triton).
OWN_POINTS = frozenset({"tritonspec.launch_config", "tritonspec.ops.attention"})


# -- sample kernels: plain functions, wrapped as compiled or interpreted kernels below -----------

def _scale_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + tl.exp(y), mask=mask)


def _row_sum(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.store(out_ptr + row, tl.sum(x, axis=0))


def _dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)[:, None]
    n = tl.arange(0, N)[None, :]
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n)
    tl.store(c_ptr + m * N + n, tl.dot(a, b))


def _histogram(idx_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bins = tl.load(idx_ptr + offs, mask=mask)
    tl.atomic_add(out_ptr + bins, tl.full([BLOCK], 1, tl.int32), mask=mask)


SAMPLES = {
    "scale_add": (_scale_add, {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
                               "alpha": "fp32", "BLOCK": "constexpr"}, {"BLOCK": 128}),
    "row_sum": (_row_sum, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32", "BLOCK": "constexpr"},
                {"BLOCK": 64}),
    "dot": (_dot, {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "M": "constexpr", "N": "constexpr",
                   "K": "constexpr"}, {"M": 16, "N": 16, "K": 16}),
    "histogram": (_histogram, {"idx_ptr": "*i32", "out_ptr": "*i32", "n": "i32", "BLOCK": "constexpr"},
                  {"BLOCK": 64}),
}


def _compiled(fn):
    from triton.runtime.jit import JITFunction
    return JITFunction(fn)


def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction
    if not interpreting():
        raise RuntimeError("run_samples_interpreted needs TRITON_INTERPRET=1 before triton is imported")
    return InterpretedFunction(fn)


def run_samples_interpreted() -> dict[str, str]:
    """Run every sample in the interpreter against float64 references; name -> "ok" or the error."""
    import torch
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    results = {}

    def case(name, body):
        try:
            body()
            results[name] = "ok"
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"

    def scale_add():
        n = 300
        x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
        out = torch.full((n,), float("nan"))
        _interpreted(_scale_add)[(triton.cdiv(n, 128),)](x, y, out, n, 1.5, BLOCK=128)
        ref = 1.5 * x.double() + y.double().exp()
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)

    def row_sum():
        x = torch.randn(5, 37, generator=g)
        out = torch.full((5,), float("nan"))
        _interpreted(_row_sum)[(5,)](x, out, 37, BLOCK=64)
        torch.testing.assert_close(out.double(), x.double().sum(1), rtol=1e-5, atol=1e-5)

    def dot():
        a, b = torch.randn(16, 16, generator=g).half(), torch.randn(16, 16, generator=g).half()
        c = torch.full((16, 16), float("nan"))
        _interpreted(_dot)[(1,)](a, b, c, M=16, N=16, K=16)
        torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-3, atol=1e-3)

    def histogram():
        n = 500
        idx = torch.randint(0, 17, (n,), generator=g, dtype=torch.int32)
        out = torch.zeros(17, dtype=torch.int32)
        _interpreted(_histogram)[(triton.cdiv(n, 64),)](idx, out, n, BLOCK=64)
        assert torch.equal(out, torch.bincount(idx.long(), minlength=17).int()), "histogram mismatch"

    for name, body in (("scale_add", scale_add), ("row_sum", row_sum), ("dot", dot), ("histogram", histogram)):
        case(name, body)
    return results


def compile_samples(target) -> dict[str, str]:
    """Compile every sample offline for ``target``; name -> "ok (<stages>)" or the error.

    A stage whose artifact came out empty is reported as not built, with the backend's reason
    (``metadata.not_built``), never as ok.
    """
    from triton.compiler import ASTSource
    results = {}
    for name, (fn, signature, constexprs) in SAMPLES.items():
        try:
            kernel = triton.compile(ASTSource(_compiled(fn), signature, constexprs), target=target)
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        built = [stage for stage, artifact in kernel.asm.items() if artifact]
        empty = [stage for stage, artifact in kernel.asm.items() if not artifact]
        result = "ok (" + ",".join(built) + ")"
        if empty:
            why = getattr(kernel.metadata, "not_built", None) or "empty artifact"
            result += "; " + ", ".join(f"{stage}: not built ({why})" for stage in empty)
        results[name] = result
    return results


def kernel_rows(providers: dict) -> tuple[list, list]:
    """(rows, failures) for the kernel table: each kernel's ops and layer load, and per launch config
    which backends set it in their ``ConfigTable`` (or only say so at run time, through a function)."""
    rows, failures = [], []
    tables = {name: p.get("kernel_config") for name, p in providers.items()}
    for kernel in kernel_table.KERNELS.values():
        try:
            for op in kernel.ops:
                kernel.op(op)
            if kernel.layer is not None:
                kernel.layer.load()
            status = "ok"
        except Exception as e:
            status = f"FAILED: {type(e).__name__}: {e}"
            failures.append(f"kernel {kernel.name}: {status}")
        layer = ", ".join(kernel.layer.names) if kernel.layer else "-"
        for cfg in kernel.configs or (None,):
            set_by = [b for b, t in tables.items() if isinstance(t, ConfigTable) and cfg and cfg.kernel in t.entries]
            opaque = [b for b, t in tables.items() if t is not None and not isinstance(t, ConfigTable)]
            rows.append([kernel.name, ", ".join(kernel.ops), f"{kernel.site}: {layer}", cfg.kernel if cfg else "-",
                         ", ".join(set_by + [f"{b} (a function)" for b in opaque]) or "default", status])
    return rows, failures


def provider_rows() -> tuple[dict, list, list]:
    """(providers, rows, failures) for the providers table: each backend's provider, where it comes from,
    what it specializes, and whether its compiled kernels are cached across processes (and if not, why)."""
    providers, rows, failures = {}, [], []
    allow = os.environ.get(ALLOW_ENV)
    for name in REGISTRY.names():
        conflict = REGISTRY.conflict(name)
        if conflict is not None:
            failures.append(conflict)
            for c in REGISTRY.candidates(name):
                rows.append([name, "CONFLICT", f"entry point of {c.label}", c.value, "-"])
            continue
        try:
            p = REGISTRY.get(name)
            if p is None:
                rows.append([name, f"not allowed by {ALLOW_ENV}={allow!r}", "", "", ""])
                continue
            providers[name] = p
            lists = [f"{n}[{', '.join(getattr(p.module, n))}]" for n in sorted(p.exports) if n.endswith("_func_list")]
            cache = "shared" if p.digest.cacheable else f"not cached across processes: {p.digest.reason}"
            rows.append([name, p.info.runs, p.source, ", ".join(p.hooks + lists) or "-", cache])
        except Exception as e:
            failures.append(f"spec provider {name}: {e}")
            rows.append([name, "FAILED", str(e), "", ""])
    return providers, rows, failures


def _table(rows, header) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv=None) -> int:
    from triton.backends.compiler import GPUTarget
    # Say what FP fusion is (Triton 3.9 otherwise warns on stderr in the middle of the tables).
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    failures = []
    print(f"tritonspec check: triton {triton.__version__}, python {sys.version.split()[0]}")
    if not install.is_active():
        print(f"hooks are disabled (TRITONSPEC_DISABLE={os.environ.get('TRITONSPEC_DISABLE')}): nothing to check")
        return 1
    __import__("triton.runtime.interpreter")  # installs the interpreter point

    # 1. providers
    providers, rows, problems = provider_rows()
    failures += problems
    print("\nSpec providers\n" + _table(rows, ["backend", "runs", "from", "spec functions", "compile cache"]))

    # 2. hook table vs install points
    points = {p.name: p for p in install.INSTALL_POINTS}
    rows = []
    for hook in HOOKS.values():
        if hook.point in OWN_POINTS:
            status = "installed"
        elif hook.point not in points:
            status = f"failed: no install point {hook.point!r}"
        else:
            status = install.STATUS.get(hook.point, "pending")
        ok = status == "installed" or status.startswith("n/a")
        if not ok:
            failures.append(f"hook {hook.name}: {status}")
        by = [b for b, p in providers.items() if p.get(hook.name) is not None]
        applies = "interpreter only" if hook.interpreter_only else "compiled + interpreted"
        rows.append([hook.name, hook.point, "yes" if status == "installed" else status, applies,
                     ", ".join(by) or "-"])
    for name, point in points.items():
        if not any(h.point == name for h in HOOKS.values()):
            status = install.STATUS.get(name, "pending")
            if not (status == "installed" or status.startswith("n/a")):
                failures.append(f"install point {name}: {status}")
            rows.append(["-", name, "yes" if status == "installed" else status, "", point.doc])
    print("\nHook points\n" + _table(rows, ["hook", "point", "installed", "applies to", "specialized by"]))

    # 3. the kernel table
    rows, problems = kernel_rows(providers)
    failures += problems
    print("\nKernels\n" + _table(rows, ["kernel", "ops", "replaces", "launch config", "set by", "loads"]))

    # 4. sample kernels: offline compile per backend target, then the interpreter
    rows = []
    for name, p in providers.items():
        target = p.info.check_target
        if target is None:
            continue
        for kernel, result in compile_samples(GPUTarget(*target)).items():
            rows.append([name, ":".join(map(str, target)), kernel, result])
            if not result.startswith("ok"):
                failures.append(f"compile {kernel} for {name}: {result}")
    for kernel, result in _interpret_in_subprocess().items():
        rows.append(["interpreter", "cpu", kernel, result])
        if result != "ok":
            failures.append(f"interpret {kernel}: {result}")
    print("\nSample kernels\n" + _table(rows, ["backend", "target", "kernel", "result"]))

    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall checks passed")
    return 0


def _interpret_in_subprocess() -> dict[str, str]:
    """The interpreter must be chosen before triton.language is imported: run it in a fresh process."""
    import json
    import subprocess
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import json, tritonspec.check as c; print(json.dumps(c.run_samples_interpreted()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"interpreter": f"subprocess failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
