"""``tritonspec check --kernels``: every kernel of the kernel table, compiled for every backend target at model
shapes, and held to each target's limits.

The ops run forward and backward on meta tensors while their launches are recorded instead of run
(``tritonspec.ops._library.recording``): no device, no memory, exactly the launches the ops make, with the
launch configs the backend's ``kernel_config`` picks for the target's arch (``tritonspec.launch.for_arch``).
Each distinct launch is compiled offline the way ``JITFunction.run`` would (Triton's own binder, then
``triton.compile``) and its binary's shared memory (LDS), registers and scratch are read (``cuobjdump`` for
cubins, the AMDGCN metadata for HSACO) and compared with the limits the backend declares in its
``CheckTarget`` s. A TTIR-only target compiles but has no binary to read.

The shapes are the layers of ``MODELS`` at the ``TOKENS`` sizes (a 4096-token sequence, and the decode
steps T=1 and T=16), in bfloat16 and float16. ``CASES`` says how each kernel's ops are called there.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from . import kernel_table


@dataclass(frozen=True)
class ModelShape:
    """The layer sizes of one model that the kernels see.

    ``intermediate`` is the dense MLP's width (None: every layer is MoE); ``rope_dim`` the rotated part
    of a head (None: all of it)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int | None
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    rope_dim: int | None = None
    router: dict = field(default_factory=dict)


# From each model's Hugging Face config.json.
MODELS = (
    ModelShape("Llama-3-8B", 4096, 32, 8, 128, 128256, 14336),
    ModelShape("Qwen3-30B-A3B", 2048, 32, 4, 128, 151936, None, experts=128, top_k=8, expert_intermediate=768),
    ModelShape("Mixtral-8x7B", 4096, 32, 8, 128, 32000, None, experts=8, top_k=2, expert_intermediate=14336),
    # MLA: q and k heads of 128 + 64 rotated dims (v padded to them, as transformers does for flash
    # attention); three dense layers of 18432, then 256 routed experts.
    ModelShape(
        "DeepSeek-V3",
        7168,
        128,
        128,
        192,
        129280,
        18432,
        experts=256,
        top_k=8,
        expert_intermediate=2048,
        rope_dim=64,
        router=dict(scoring="sigmoid", n_group=8, topk_group=4, scaling_factor=2.5),
    ),
)
TOKENS = (4096, 16, 1)  # a training or prefill sequence, and two decode steps (their keys: CONTEXT)
CONTEXT = 4096  # the keys a decode step attends to
DTYPES = ("bfloat16", "float16")


# -- cases: each kernel's ops, forward and backward, on meta tensors ---------------------------------


def _meta(*shape, dtype, grad=True, layout=None):
    import torch

    t = torch.empty(*shape, device="meta", dtype=dtype)
    if layout is not None:  # e.g. Hugging Face's (batch, seq, heads, dim) seen as (batch, heads, seq, dim)
        t = t.permute(*layout)
    return t.requires_grad_(grad) if dtype.is_floating_point else t


def _backward(*outputs):
    import torch

    torch.autograd.backward([o for o in outputs], [torch.empty_like(o) for o in outputs])


def _rmsnorm(m: ModelShape, t: int, dtype):
    from .ops.rms_norm import rms_norm

    _backward(rms_norm(_meta(t, m.hidden, dtype=dtype), _meta(m.hidden, dtype=dtype)))


def _add_rmsnorm(m: ModelShape, t: int, dtype):
    from .ops.rms_norm import add_rms_norm

    x, residual, w = _meta(t, m.hidden, dtype=dtype), _meta(t, m.hidden, dtype=dtype), _meta(m.hidden, dtype=dtype)
    _backward(*add_rms_norm(x, residual, w))


def _swiglu(m: ModelShape, t: int, dtype):
    from .ops.swiglu import swiglu

    if m.intermediate is None:
        return False
    _backward(swiglu(_meta(t, m.intermediate, dtype=dtype), _meta(t, m.intermediate, dtype=dtype)))


def _rope(m: ModelShape, t: int, dtype):
    from .ops.rope import rope

    d = m.rope_dim or m.head_dim
    q = _meta(1, t, m.heads, d, dtype=dtype, layout=(0, 2, 1, 3))
    k = _meta(1, t, m.kv_heads, d, dtype=dtype, layout=(0, 2, 1, 3))
    cos, sin = _meta(1, t, d, dtype=dtype, grad=False), _meta(1, t, d, dtype=dtype, grad=False)
    _backward(*rope(q, k, cos, sin))


def _attention(m: ModelShape, t: int, dtype):
    from .ops.attention import attention

    keys = max(t, CONTEXT)
    q = _meta(1, t, m.heads, m.head_dim, dtype=dtype, layout=(0, 2, 1, 3))
    k = _meta(1, keys, m.kv_heads, m.head_dim, dtype=dtype, layout=(0, 2, 1, 3))
    v = _meta(1, keys, m.kv_heads, m.head_dim, dtype=dtype, layout=(0, 2, 1, 3))
    _backward(attention(q, k, v, causal=t == keys))
    if t == keys:  # padded, packed or windowed batches (key bounds), with GPT-OSS's sinks
        import torch

        bounds, sinks = _meta(2, 1, t, dtype=torch.int32), _meta(m.heads, dtype=torch.float32)
        _backward(attention(q, k, v, key_bounds=bounds, sinks=sinks))


def _attention_decode(m: ModelShape, t: int, dtype):
    """Forward only (inference): decode steps against CONTEXT keys of a static cache (full, by a dense mask, by
    key bounds with GPT-OSS's sinks), and a short cache (one split: the partial kernel writes the output)."""
    import torch

    from .ops.attention_decode import MAX_QUERIES, attention_decode

    if t > MAX_QUERIES:
        return False
    q = _meta(1, t, m.heads, m.head_dim, dtype=dtype, layout=(0, 2, 1, 3), grad=False)
    k, v = (_meta(1, m.kv_heads, CONTEXT, m.head_dim, dtype=dtype, grad=False) for _ in range(2))
    mask = torch.empty(1, 1, t, CONTEXT, device="meta", dtype=torch.bool)
    bounds, sinks = torch.empty(2, 1, t, device="meta", dtype=torch.int32), _meta(m.heads, dtype=torch.float32)
    with torch.no_grad():
        attention_decode(q, k, v)
        attention_decode(q, k, v, mask=mask)
        attention_decode(q, k, v, key_bounds=bounds, sinks=sinks)
        attention_decode(q, k[:, :, :256], v[:, :, :256])


def _linear_cross_entropy(m: ModelShape, t: int, dtype):
    """Forward only: its kernel writes the gradients in the forward; the backward scales them on the host."""
    import torch

    from .ops.linear_cross_entropy import linear_cross_entropy

    labels = torch.empty(t, device="meta", dtype=torch.int64)
    linear_cross_entropy(_meta(t, m.hidden, dtype=dtype), _meta(m.vocab, m.hidden, dtype=dtype), labels)


def _moe(m: ModelShape, t: int, dtype):
    import torch

    from .ops.moe import moe_experts
    from .ops.moe_decode import MAX_TOKENS as DECODE_TOKENS

    if not m.experts:
        return False
    e, i = m.experts, m.expert_intermediate
    ids = torch.empty(t, m.top_k, device="meta", dtype=torch.int64)
    weights = _meta(t, m.top_k, dtype=torch.float32)
    x, gate_up, down = (
        _meta(t, m.hidden, dtype=dtype),
        _meta(e, 2 * i, m.hidden, dtype=dtype),
        _meta(e, m.hidden, i, dtype=dtype),
    )
    _backward(moe_experts(x, ids, weights, gate_up, down))
    if t <= DECODE_TOKENS:  # inference at decode sizes: the two decode kernels
        with torch.no_grad():
            moe_experts(x, ids, weights, gate_up, down)


def _moe_router(m: ModelShape, t: int, dtype):
    """Training runs torch's ops (nothing to record); inference the fused kernel where no group limit applies:
    each scoring at the model's experts, sigmoid with a correction bias and no groups (Kimi-K2's n_group=1)."""
    import torch

    from .ops.moe_routing import moe_route

    if not m.experts:
        return False
    logits = _meta(t, m.experts, dtype=dtype)
    weights, _ = moe_route(logits, m.top_k, **m.router)
    _backward(weights)
    bias = _meta(m.experts, dtype=torch.float32, grad=False)
    with torch.no_grad():
        moe_route(logits, m.top_k, **m.router)  # the model's router (DeepSeek-V3's groups: torch's ops)
        moe_route(logits, m.top_k, scoring="softmax", renormalize=False)
        moe_route(logits, m.top_k, scoring="topk_softmax")
        moe_route(logits, m.top_k, scoring="sigmoid", correction_bias=bias, scaling_factor=2.5)


# kernel table name -> fn(model, tokens, dtype): run the kernel's ops (False: the model has no such layer)
CASES: dict[str, Callable] = {
    "rmsnorm": _rmsnorm,
    "add_rmsnorm": _add_rmsnorm,
    "swiglu": _swiglu,
    "rope": _rope,
    "flash_attention": _attention,
    "flash_decoding": _attention_decode,
    "linear_cross_entropy": _linear_cross_entropy,
    "moe": _moe,
    "moe_router": _moe_router,
}


# -- recording and compiling -----------------------------------------------------------------------


@dataclass
class Compile:
    """One distinct compile: a Triton kernel with its signature, constexprs and options for one target,
    where it came from, and what its binary uses."""

    kernel: object  # the JITFunction
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    shown: str  # the constexprs and options, as a reader wants them
    used_by: list = field(default_factory=list)  # "Llama-3-8B T=16 bfloat16 (rmsnorm)"
    resources: dict | None = None
    error: str | None = None


def record(backend: str, target, cases: dict | None = None, models=MODELS, tokens=TOKENS, dtypes=DTYPES):
    """Every distinct compile the ops ask for at the model shapes, with ``backend`` selected and its launch
    configs chosen for ``target`` (a ``CheckTarget``); and the cases that failed to run (name -> error)."""
    import torch

    from . import devices
    from .devices import interpreting
    from .launch import for_arch
    from .ops._library import recording
    from .specialization.resolve import use_backend
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    if interpreting():
        raise RuntimeError(
            "tritonspec check --kernels compiles the ops' kernels, which TRITON_INTERPRET=1 makes interpreted "
            "functions: run it without TRITON_INTERPRET"
        )
    gpu_target = GPUTarget(*target.target)
    compiler = make_backend(gpu_target)
    compiles: dict = {}
    failures: dict = {}
    units, devices.META_COMPUTE_UNITS = devices.META_COMPUTE_UNITS, target.units or devices.META_COMPUTE_UNITS
    try:
        with use_backend(backend), for_arch(gpu_target.arch):
            for name, case in (CASES if cases is None else cases).items():
                for model in models:
                    for t in tokens:
                        for dtype in dtypes:
                            where = f"{model.name} T={t} {dtype}"
                            with recording() as launches:
                                try:
                                    case(model, t, getattr(torch, dtype))
                                except Exception as e:
                                    failures[f"{name}: {where}"] = f"{type(e).__name__}: {e}"
                                    continue
                            for launch in launches:
                                try:
                                    c = _bind(compiler, launch)
                                except Exception as e:  # Triton's binder refused an argument
                                    failures[f"{name}: {where}: {_name(launch.kernel)}"] = f"{type(e).__name__}: {e}"
                                    continue
                                c = compiles.setdefault(_key(c), c)
                                if f"{where} ({name})" not in c.used_by:
                                    c.used_by.append(f"{where} ({name})")
    finally:
        devices.META_COMPUTE_UNITS = units
    return list(compiles.values()), failures


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))


def _bind(compiler, launch) -> Compile:
    """What ``JITFunction.run`` would compile for this launch: Triton's own binder and argument packing."""
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, compiler)
    kwargs = dict(launch.kwargs)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(compiler, kwargs, bound, specialization, options)
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if kwargs.get(k) is not None}
    params = kernel.params
    shown = {params[p[0]].name: v for p, v in constexprs.items() if len(p) == 1 and params[p[0]].is_constexpr}
    return Compile(
        kernel,
        _name(kernel),
        signature,
        constexprs,
        attrs,
        options.__dict__,
        ", ".join(f"{k}={v}" for k, v in {**shown, **opts}.items()),
    )


def _key(c: Compile):
    return (
        id(c.kernel),
        tuple(c.signature.items()),
        tuple((k, repr(v)) for k, v in c.constexprs.items()),
        tuple((k, repr(v)) for k, v in c.attrs.items()),
        tuple((k, repr(v)) for k, v in c.options.items()),
    )


def compile_one(c: Compile, target) -> None:
    """Compile ``c`` for ``target`` and read its binary's resources into ``c`` (or its error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        binary = triton.compile(
            ASTSource(c.kernel, c.signature, c.constexprs, c.attrs), target=GPUTarget(*target.target), options=c.options
        )
    except Exception as e:
        first = str(e).strip().splitlines()
        c.error = f"{type(e).__name__}: {first[0] if first else ''}"
        return
    c.resources = resources(binary)


def resources(binary) -> dict:
    """Shared memory (bytes), registers per thread and scratch per thread (bytes) of a compiled kernel,
    as far as its binary tells: ``{}`` when there is none (TTIR only)."""
    asm = binary.asm
    shared = int(getattr(binary.metadata, "shared", 0) or 0)
    if asm.get("cubin"):
        usage = _cuobjdump(asm["cubin"])
        return {
            "shared_memory": max(shared, usage.get("SHARED", 0)),
            "registers": usage.get("REG", 0),
            "scratch": usage.get("STACK", 0) + usage.get("LOCAL", 0),
        }
    if asm.get("amdgcn"):
        text = asm["amdgcn"]

        def read(pattern):
            return max((int(v) for v in re.findall(pattern, text)), default=0)

        return {
            "shared_memory": max(shared, read(r"\.group_segment_fixed_size:\s+(\d+)")),
            "registers": read(r"\.vgpr_count:\s+(\d+)") + read(r"\.agpr_count:\s+(\d+)"),
            "scratch": read(r"; ScratchSize: (\d+)"),
        }
    return {}


def _cuobjdump(cubin: bytes) -> dict:
    from triton import knobs

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", path], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    return {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}


LIMITS = ("shared_memory", "registers", "scratch")


def over_limits(c: Compile, target) -> list[str]:
    """What ``c`` uses beyond ``target``'s declared limits, one line each."""
    found = []
    for resource in LIMITS:
        limit, used = getattr(target, resource), (c.resources or {}).get(resource)
        if limit is not None and used is not None and used > limit:
            found.append(f"{resource} {used} > {limit}")
    return found


# -- the report ----------------------------------------------------------------------------------------


def compile_all(jobs: list) -> None:
    """``compile_one`` for every (compile, target) in ``jobs``, in one process per CPU (fork: the workers inherit
    the recorded kernels). Compiles are independent, and a few hundred take minutes on one core."""
    global _JOBS
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, len(jobs))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for c, target in jobs:
            _compile_quietly(c, target)
        return
    _JOBS = jobs
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for (c, _), (used, error) in zip(jobs, pool.imap(_compile_job, range(len(jobs)), chunksize=2)):
                c.resources, c.error = used, error
    finally:
        _JOBS = []


_JOBS: list = []


def _compile_job(i: int):
    c, target = _JOBS[i]
    _compile_quietly(c, target)
    return c.resources, c.error


def _compile_quietly(c: Compile, target) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # a backend's compiler may print its tools' logs
        compile_one(c, target)


def run(backends=None, cases=None, models=MODELS, tokens=TOKENS, dtypes=DTYPES) -> int:
    """Print a table per backend, then the summary line; the exit status (0: every case ran, every compile
    succeeded and fits its target). ``backends`` (names) and ``cases`` (a ``CASES``-like dict) narrow it;
    ``TRITONSPEC_ALLOWED_BACKENDS`` narrows the command line's."""
    from .text_tables import WIDTH, section, wrap
    from .specialization.providers import PROVIDERS

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    problems = [
        f"kernel {k.name}: no case in tritonspec.kernel_check.CASES, so it is not checked"
        for k in kernel_table.KERNELS.values()
        if cases is None and k.ops and k.name not in CASES
    ]
    recorded = []  # (backend, provider, target, compiles)
    for backend in PROVIDERS.names() if backends is None else backends:
        provider = PROVIDERS.get(backend)
        if provider is None:
            continue
        for target in provider.info.check_targets:
            compiles, failed = record(backend, target, cases, models, tokens, dtypes)
            problems += [f"{backend} {target.name}: {case}: {error}" for case, error in failed.items()]
            recorded.append((backend, provider, target, compiles))
    compile_all([(c, target) for _, _, target, compiles in recorded for c in compiles])

    total = over = 0
    tables: dict = {}
    for backend, provider, target, compiles in recorded:
        total += len(compiles)
        by_kernel: dict = {}
        for c in compiles:
            by_kernel.setdefault(c.name, []).append(c)
        rows = tables.setdefault(backend, (provider, []))[1]
        for name, group in by_kernel.items():
            rows.append(_row(name, group, target))
            for c in group:
                if c.error:
                    problems.append(f"{name} on {backend} {target.name}: compile failed ({c.error}); {_where(c)}")
                for excess in over_limits(c, target):
                    over += 1
                    problems.append(f"{name} on {backend} {target.name}: {excess}; {_where(c)}")
    for backend, (provider, rows) in tables.items():
        section(
            f"Kernel resources: {backend} ({provider.info.runs})",
            rows,
            ["kernel", "target", "compiles", "shared KB", "registers", "scratch B", "result"],
            keep=(0, 1),
        )
    if problems:
        print("\nFAILED:")
        for p in problems:
            print("\n".join(("  " if i == 0 else "    ") + ln for i, ln in enumerate(wrap(p, WIDTH - 4))))
    print(f"\nkernel resources: {total} compiles, {over} over a target's limits")
    return 1 if problems else 0


def _where(c: Compile) -> str:
    more = f" and {len(c.used_by) - 1} more" if len(c.used_by) > 1 else ""
    return f"{c.shown}; at {c.used_by[0]}{more}"


def _row(name: str, group: list, target) -> list:
    def most(resource):
        values = [c.resources[resource] for c in group if c.resources and resource in c.resources]
        return max(values) if values else None

    def cell(resource, scale=1):
        used, limit = most(resource), getattr(target, resource)
        if used is None:
            return "-"
        shown = lambda v: f"{v / scale:.4g}"  # noqa: E731  (KB with their fraction: 64.25 is over 64)
        return shown(used) + ("" if limit is None else f" / {shown(limit)}")

    failed = sum(1 for c in group if c.error)
    over = sum(1 for c in group if over_limits(c, target))
    if failed or over:
        result = ", ".join(x for x in (f"{failed} failed" if failed else "", f"{over} over" if over else "") if x)
    elif all(not c.resources for c in group):
        result = "compiles (no binary)"
    else:
        result = "ok"
    return [name, target.name, len(group), cell("shared_memory", 1024), cell("registers"), cell("scratch"), result]
