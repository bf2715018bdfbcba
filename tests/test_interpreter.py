"""Interpreted kernels under the layer: libdevice served, ``tl`` stock again after every grid, no per-helper cost.

Stock Triton re-patches ``tl`` on every ``@jit`` helper call of an interpreted kernel and never restores
those patches; the layer gives them to the grid's scope, each attribute once, and serves libdevice once
per grid. Counting what a grid patches and looks up (not timing it) keeps a per-helper-call cost from
coming back: ``bench/interpreter_overhead.py`` times it.
"""

import contextlib
import os
import types

import pytest
from helpers import make_spec, run_together
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter
from triton.language.extra import libdevice
from triton.language.extra.cuda import libdevice as cuda_libdevice
from triton.language.extra.hip import libdevice as hip_libdevice

import tritonspec

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tests: interpreted kernels (TRITON_INTERPRET=1)"
)


@triton.jit
def _soft_sign(x):
    return libdevice.tanh(x) + tl.where(x > 0, x, tl.exp(x) - 1.0)


@triton.jit
def _centered(x, N: tl.constexpr):
    return x - tl.sum(x, axis=0) / N


@triton.jit
def _helper_loop(x_ptr, out_ptr, ITERS: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    acc = tl.zeros((N,), dtype=tl.float32)
    for i in range(ITERS):
        x = tl.load(x_ptr + (tl.program_id(0) * ITERS + i) * N + offs)
        acc += _centered(_soft_sign(x.to(tl.float16).to(tl.float32)), N)
    tl.store(out_ptr + tl.program_id(0) * N + offs, acc)


def _helper_loop_ref(x: torch.Tensor) -> torch.Tensor:
    h = x.half().double()
    s = torch.tanh(h) + torch.where(h > 0, h, torch.exp(h) - 1)
    return (s - s.mean(-1, keepdim=True)).sum(1)


@triton.jit
def _refuse(x, N: tl.constexpr):
    tl.static_assert(N < 0, "refused by the helper")
    return x


@triton.jit
def _fails_in_a_helper(x_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, _refuse(_centered(tl.load(x_ptr + offs), N), N))


def _run_helper_loop(gen, programs: int, iters: int, n: int = 16):
    x = torch.randn(programs, iters, n, generator=gen)
    out = torch.full((programs, n), float("nan"))
    _helper_loop[(programs,)](x, out, ITERS=iters, N=n)
    torch.testing.assert_close(out.double(), _helper_loop_ref(x), rtol=1e-5, atol=1e-5)


LIBDEVICE_MODULES = (libdevice, cuda_libdevice, hip_libdevice)


@pytest.fixture
def restored_scopes(monkeypatch):
    """The number of changes of every interpreter patch scope restored with changes."""
    sizes = []
    restore = interpreter._LangPatchScope.restore

    def counting_restore(scope):
        if scope._changes:
            sizes.append(len(scope._changes))
        restore(scope)

    monkeypatch.setattr(interpreter._LangPatchScope, "restore", counting_restore)
    return sizes


def test_a_grid_patches_once_however_many_helpers_it_calls(gen, registry, restored_scopes):
    from tritonspec_backends.cpu.language.cpu import libdevice as cpu_libdevice

    lookups = []

    def interpreter_libdevice():
        lookups.append(1)
        return cpu_libdevice

    tritonspec.register_spec(
        "counting_libdevice", make_spec("counting_libdevice_spec", interpreter_libdevice=interpreter_libdevice)
    )
    counts = {}
    with tritonspec.use_backend("counting_libdevice"):
        for programs, iters in ((1, 1), (3, 6)):  # 1 and 18 iterations, each calling 3 @jit helpers
            restored_scopes.clear()
            lookups.clear()
            _run_helper_loop(gen, programs, iters)
            counts[programs, iters] = list(restored_scopes), len(lookups)
    # one scope per grid restoring the same attributes, one libdevice lookup per grid
    assert counts[1, 1] == counts[3, 6] and counts[1, 1][1] == 1 and len(counts[1, 1][0]) == 1, counts


def _namespaces():
    core = tl.core
    return [tl, core, tl.math, core.tensor, core.dtype, core.condition, core.tensor_descriptor_base, *LIBDEVICE_MODULES]


def _snapshot() -> dict:
    return {(ns, name): obj for ns in _namespaces() for name, obj in vars(ns).items()}


def _changed(before: dict) -> list:
    after = _snapshot()
    return sorted(
        f"{getattr(ns, '__name__', ns)}.{name}"
        for (ns, name) in before.keys() | after.keys()
        if before.get((ns, name), "absent") is not after.get((ns, name), "absent")
    )


def test_tl_and_libdevice_are_stock_after_a_grid_with_helpers(gen):
    _run_helper_loop(gen, 1, 1)  # the first launch may import modules
    before = _snapshot()
    _run_helper_loop(gen, 2, 3)
    assert _changed(before) == []
    with pytest.raises(Exception, match="refused by the helper"):  # a grid failing in a helper restores too
        _fails_in_a_helper[(2,)](torch.randn(4, generator=gen), N=4)
    assert _changed(before) == []


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _soft_sign(tl.load(x_ptr + offs)))


def test_threads_each_get_their_backends_libdevice(gen, registry):
    """A thread selecting a backend whose libdevice ``tanh`` is ``exp`` gets exp; the others keep the cpu one."""
    from tritonspec_backends.cpu.language.cpu import libdevice as cpu_libdevice

    swapped = types.ModuleType("swapped_libdevice")
    swapped.tanh = cpu_libdevice.exp
    tritonspec.register_spec("swapped_libdevice", make_spec("swapped_libdevice_spec", interpreter_libdevice=swapped))
    x = torch.randn(16, generator=gen)
    rest = torch.where(x > 0, x, torch.exp(x) - 1)
    expected = {"swapped_libdevice": torch.exp(x) + rest, None: torch.tanh(x) + rest}
    results = []

    def work(backend):
        for _ in range(3):
            out = torch.full((16,), float("nan"))
            with tritonspec.use_backend(backend) if backend else contextlib.nullcontext():
                _tanh_kernel[(1,)](x, out, N=16)
            results.append((backend, out))

    run_together(work, list(expected))
    assert len(results) == 6
    for backend, out in results:
        torch.testing.assert_close(out, expected[backend], rtol=1e-6, atol=1e-6, msg=str(backend))


def test_libdevice_modules_changed_between_grids_are_served_and_put_back(gen, monkeypatch):
    """What a grid serves and restores follows changes made to either module between grids."""
    from tritonspec_backends.cpu.language.cpu import libdevice as cpu_libdevice

    x = torch.randn(16, generator=gen)
    rest = torch.where(x > 0, x, torch.exp(x) - 1)

    def run():
        out = torch.full((16,), float("nan"))
        _tanh_kernel[(1,)](x, out, N=16)
        return out

    torch.testing.assert_close(run(), torch.tanh(x) + rest, rtol=1e-6, atol=1e-6)
    replaced = object()
    monkeypatch.setattr(libdevice, "tanh", replaced)  # the stock module changed: put back what it holds now
    torch.testing.assert_close(run(), torch.tanh(x) + rest, rtol=1e-6, atol=1e-6)
    assert libdevice.tanh is replaced
    monkeypatch.setattr(cpu_libdevice, "tanh", cpu_libdevice.exp)  # the backend's changed: serve it
    torch.testing.assert_close(run(), torch.exp(x) + rest, rtol=1e-6, atol=1e-6)
    assert libdevice.tanh is replaced
