"""The eager launcher that reuses compiled kernels (ops/_launch_cache.py), against stand-ins.

A stand-in JIT kernel records Triton's slow path (a miss) and hands back a stand-in compiled kernel
that records launches, so the cache key and the launch arguments are checked without a GPU.
"""
import types

import pytest
from helpers import make_spec
import torch
from triton import knobs

from tritonspec.ops import _launch_cache
from tritonspec.ops._launch_cache import CachedLauncher


class FakeCompiled:
    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(("run", args))

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("hooked", grid, args))


def _kernel_fn(X, n, Y, BLOCK: int = 4, FLAG: bool = False):  # the signature CachedLauncher reads
    pass


class FakeKernel:
    """Triton's JITFunction as CachedLauncher sees it: params, fn, and kernel[grid](...)."""

    params = [types.SimpleNamespace(name=n, is_constexpr=n.isupper() and len(n) > 1)
              for n in ("X", "n", "Y", "BLOCK", "FLAG")]
    fn = staticmethod(_kernel_fn)

    def __init__(self):
        self.misses = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.misses.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    stream_of = types.SimpleNamespace(get_current_stream=lambda device: 1234)
    monkeypatch.setattr(_launch_cache, "driver", types.SimpleNamespace(active=stream_of))
    kernel = FakeKernel()
    return CachedLauncher(kernel), kernel


def test_a_hit_calls_the_compiled_launcher_with_every_argument(launcher):
    cl, kernel = launcher
    x, y = torch.randn(64), torch.randn(64)
    cl[(3,)](x, 64, y, BLOCK=8, num_warps=4)
    assert len(kernel.misses) == 1 and kernel.compiled.launches == []  # the miss went through Triton
    cl[(3,)](x, 64, y, BLOCK=8, num_warps=4)
    assert len(kernel.misses) == 1
    # grid padded to 3-D, the driver's stream, no launch hooks, then positional args + trailing
    # params in order (BLOCK from the call, FLAG from the signature's default; num_warps is an option)
    assert kernel.compiled.launches == [
        ("run", (3, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None, x, 64, y, 8, False))]


@pytest.mark.parametrize("change", ["dtype", "int_residue", "int64", "constexpr", "option"])
def test_what_triton_specializes_on_is_a_different_key(launcher, change):
    cl, kernel = launcher
    x, y = torch.randn(64), torch.randn(64)
    cl[(1,)](x, 32, y, BLOCK=8, num_warps=4)
    args, kwargs = [x, 32, y], dict(BLOCK=8, num_warps=4)
    if change == "dtype":
        args[0] = x.double()
    elif change == "int_residue":
        args[1] = 33  # not a multiple of 16 any more
    elif change == "int64":
        args[1] = 2 ** 32 + 32  # same residue, but needs 64 bits
    elif change == "constexpr":
        kwargs["BLOCK"] = 16
    else:
        kwargs["num_warps"] = 8
    cl[(1,)](*args, **kwargs)
    assert len(kernel.misses) == 2 and kernel.compiled.launches == []


def _descriptor(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def test_tma_descriptors_are_keyed_by_what_triton_specializes_on(launcher):
    """dtype and block shape (and a Gluon descriptor's layout) pick the kernel; a hit hands each call's
    own descriptor to the launcher, which encodes its base, shape and strides."""
    cl, kernel = launcher
    x, y = torch.randn(64, 32), torch.randn(128, 32)
    cl[(1,)](_descriptor(x, [16, 32]), 64, y)
    d = _descriptor(y, [16, 32])  # another tensor and shape, same dtype and block: a hit
    cl[(1,)](d, 64, y)
    assert len(kernel.misses) == 1 and kernel.compiled.launches[-1][1][9] is d
    cl[(1,)](_descriptor(x, [32, 32]), 64, y)  # another block shape
    cl[(1,)](_descriptor(x.double(), [16, 32]), 64, y)  # another dtype
    assert len(kernel.misses) == 3
    # a plan holds neither the descriptor (it holds its tensor) nor the tensor: each call hands both
    plan = cl.plan((1,), (d, 64, y), {})
    assert plan.args[0] is None and plan.args[2] is None
    d2, y2 = _descriptor(torch.randn(32, 32), [16, 32]), torch.randn(128, 32)
    assert plan(d2, y2)
    launched = kernel.compiled.launches[-1][1][9:12]
    assert launched[0] is d2 and launched[1] == 64 and launched[2] is y2
    bad = _descriptor(torch.randn(32, 32), [16, 32])
    bad.base = torch.randn(32 * 32 + 1)[1:].view(32, 32)  # 4 bytes past a 16-byte boundary
    assert not plan(bad, y2)


def test_a_constexpr_passed_positionally_takes_tritons_path(launcher):
    """BLOCK=16 and BLOCK=32 would share an int key; positional constexprs are never cached."""
    cl, kernel = launcher
    x, y = torch.randn(64), torch.randn(64)
    for block in (16, 32, 16):
        cl[(1,)](x, 64, y, block)
    assert len(kernel.misses) == 3 and kernel.compiled.launches == []


def test_a_misaligned_tensor_always_takes_tritons_path(launcher):
    cl, kernel = launcher
    x, y = torch.randn(65), torch.randn(64)
    for _ in range(3):
        cl[(1,)](x[1:], 64, y)  # 4 bytes past a 16-byte boundary
    assert len(kernel.misses) == 3 and kernel.compiled.launches == []


def test_no_launch_hook_is_set_by_default():
    """Triton keeps empty hook chains; the direct launch is the default only if they count as unset."""
    assert not _launch_cache._hooked(knobs.runtime.launch_enter_hook)
    assert not _launch_cache._hooked(knobs.runtime.launch_exit_hook)


@pytest.mark.parametrize("how", ["chain", "plain"])
def test_a_launch_hook_sees_every_launch(launcher, monkeypatch, how):
    """With a profiler's launch hook set, hits go through CompiledKernel[grid], which calls it."""
    cl, kernel = launcher
    x, y = torch.randn(64), torch.randn(64)
    cl[(2, 2)](x, 64, y)
    if how == "chain":
        chain = knobs.runtime.launch_enter_hook
        hook = lambda *a: None  # noqa: E731
        chain.add(hook)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    try:
        cl[(2, 2)](x, 64, y)
    finally:
        if how == "chain":
            chain.remove(hook)
    assert kernel.compiled.launches == [("hooked", (2, 2, 1), (x, 64, y, 4, False))]


def _planned(launcher):
    cl, kernel = launcher
    x, y = torch.randn(64), torch.randn(64)
    cl[(3,)](x, 64, y, BLOCK=8, num_warps=4)  # a miss: compiles through Triton
    plan = cl.plan((3,), (x, 64, y), dict(BLOCK=8, num_warps=4))
    assert plan is not None
    return plan, kernel


def test_a_plan_relaunches_with_new_tensors_and_the_recorded_arguments(launcher):
    plan, kernel = _planned(launcher)
    x2, y2 = torch.randn(64), torch.randn(64)
    assert plan(x2, y2)
    assert kernel.compiled.launches == [
        ("run", (3, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None, x2, 64, y2, 8, False))]
    assert len(kernel.misses) == 1


def test_no_plan_for_a_call_that_took_tritons_path(launcher):
    cl, kernel = launcher
    x, y = torch.randn(65), torch.randn(64)
    cl[(1,)](x[1:], 64, y)  # misaligned: never cached
    assert cl.plan((1,), (x[1:], 64, y), {}) is None
    cl[(1,)](x[:64], 64, y, 16)  # a positional constexpr: never cached
    assert cl.plan((1,), (x[:64], 64, y, 16), {}) is None


@pytest.mark.parametrize("change", ["misaligned", "device", "spec", "hook"])
def test_a_plan_declines_what_it_may_not_reuse(launcher, monkeypatch, change):
    """The op then takes its ordinary path, which re-specializes as Triton would."""
    plan, kernel = _planned(launcher)
    x2, y2 = torch.randn(65), torch.randn(64)
    x2 = x2[1:] if change == "misaligned" else x2[:64]
    if change == "device":
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    elif change == "spec":  # another selection (the registry's generation is part of it)
        from tritonspec import REGISTRY
        monkeypatch.setattr(REGISTRY, "generation", REGISTRY.generation + 1)
    elif change == "hook":
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    assert plan(x2, y2) is False
    assert kernel.compiled.launches == []


def test_a_plan_keeps_no_tensor_of_the_recorded_call_alive(launcher):
    import weakref
    cl, kernel = launcher
    x, y = torch.randn(64), torch.randn(64)
    cl[(1,)](x, 64, y)
    plan = cl.plan((1,), (x, 64, y), {})
    gone = weakref.ref(x)
    kernel.misses.clear()  # the stand-in's record of the miss holds x too
    del x
    assert gone() is None and plan is not None


def test_an_ops_plan_cache_is_bounded_and_dropped_with_the_spec_registry(monkeypatch, registry):
    """Dropped when the registry changes; a plan made under another selection declines (see above)."""
    import tritonspec
    from tritonspec.ops._library import PlanCache
    monkeypatch.setattr(PlanCache, "LIMIT", 3)
    plans = PlanCache()
    for shape in range(3):
        plans[shape] = "plan"
    plans[0] = "replaced"  # an existing key never starts it over
    assert len(plans) == 3
    plans[3] = "plan"  # full: starts over with the new entry
    assert dict(plans) == {3: "plan"}
    tritonspec.register_spec("plan-cache-test", make_spec("plan_cache_spec"))
    assert plans == {}


def test_plans_are_not_used_while_cached_launches_are_off(monkeypatch):
    """USE_CACHED_LAUNCH=False means Triton's launch path everywhere: an op's recorded plans stay unused."""
    from tritonspec.ops import _library
    plans = _library.PlanCache()
    plans["problem"] = "plan"
    assert plans.get("problem") == "plan"
    monkeypatch.setattr(_library, "USE_CACHED_LAUNCH", False)
    assert plans.get("problem") is None
