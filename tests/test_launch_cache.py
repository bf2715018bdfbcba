"""The eager launcher that reuses compiled kernels (ops/_launch_cache.py), against stand-ins.

A stand-in JIT kernel records Triton's slow path (a miss) and hands back a stand-in compiled kernel
that records launches, so the cache key and the launch arguments are checked without a GPU.

Then the key against the installed Triton's own launch path (a real JITFunction, its binder and kernel
cache for a CUDA sm90 target, only the driver, the compiler and the launch faked): random calls of every
argument kind Triton specializes on, seeded per run (the seed is printed; TRITONSPEC_TEST_SEED replays
it), must launch the binary Triton itself chooses. On a CUDA machine, the same against real compiles.
"""

import enum
import types

import pytest
from helpers import make_spec
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
import triton.language as tl
from triton.runtime.jit import JITFunction

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

    params = [
        types.SimpleNamespace(name=n, is_constexpr=n.isupper() and len(n) > 1) for n in ("X", "n", "Y", "BLOCK", "FLAG")
    ]
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
        ("run", (3, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None, x, 64, y, 8, False))
    ]


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
        args[1] = 2**32 + 32  # same residue, but needs 64 bits
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
        ("run", (3, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None, x2, 64, y2, 8, False))
    ]
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
        from tritonspec import PROVIDERS

        monkeypatch.setattr(PROVIDERS, "generation", PROVIDERS.generation + 1)
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


# -- the cache key against Triton's own binder ------------------------------------------------------
# A hit reuses the binary of an earlier call; that is sound only if Triton, given this call, would pick
# that same binary. The oracle is the installed release's own JITFunction.run: its binder (native
# specialization through the nvidia backend of a CUDA target), its cache keys and its kernel cache, with
# only the GPU faked: the driver (device, stream, target), triton.compile (one stand-in binary per
# compile Triton asks for, recording the signature, constexprs and attributes it was asked for) and the
# launch (recorded). CachedLauncher drives a real JITFunction, so a miss goes through that same code.


def _spec_kernel(X, a, b, Y, c=16, BLOCK: tl.constexpr = 8, FLAG: tl.constexpr = False, ACT: tl.constexpr = None):
    pass  # never compiled: the stand-in triton.compile records what Triton asked for


_RUNTIME = ("X", "a", "b", "Y", "c")  # _spec_kernel's runtime parameters; c has a default
_CUDA = GPUTarget("cuda", 90, 32)


class _CudaDriver:
    """The three things Triton's launch path asks the active driver."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0x5EED

    def get_current_target(self):
        return _CUDA


class _Binary:
    """A compiled kernel as Triton's launch path and CachedLauncher use it, built for one specialization."""

    def __init__(self, src, options, launches):
        self.built_for = dict(
            signature=dict(src.signature),
            constexprs=dict(src.constants),
            attrs=dict(src.attrs),
            options={k: v for k, v in options.items() if k in ("num_warps", "num_stages")},
        )
        self.function, self.packed_metadata, self._launches = object(), object(), launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self._launches.append((self, args))

    def __repr__(self):
        return f"binary{self.built_for}"


@pytest.fixture
def cuda_jit(monkeypatch):
    """Triton's real launch path for a CUDA sm90 target on this CPU; returns the list of launches."""
    import triton.compiler
    from triton.runtime import driver

    launches = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(driver, "_active", _CudaDriver())  # what driver.active returns (private in 3.6 to 3.9)
    monkeypatch.setattr(
        triton.compiler, "compile", lambda src, target=None, options=None, **_: _Binary(src, options, launches)
    )
    return launches


# Arguments: each a (kind, value) pair. Tensors are views of one buffer at chosen byte offsets, so their
# data_ptr()s are what the test asks for; the kinds say what the test meant, never what the key made of it.
_BUF = torch.zeros(1 << 16, dtype=torch.uint8)
_START = -_BUF.data_ptr() % 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int8)
_DESC_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _view(offset, dtype, numel):
    size = torch.empty((), dtype=dtype).element_size()
    return _BUF[_START + offset : _START + offset + numel * size].view(dtype)


def _tensor(rng):
    dtype = rng.choice(_DTYPES)
    size = torch.empty((), dtype=dtype).element_size()
    if rng.random() < 0.8:
        return "tensor", _view(16 * rng.randrange(64), dtype, 16)
    offset = rng.choice([o for o in range(size, 16, size)]) + 16 * rng.randrange(64)
    return "misaligned tensor", _view(offset, dtype, 16)


def _int(rng):
    kind = rng.choice(["1", "small", "/16", "int32", "int32 edge", "int64", "int64 /16", "uint64", "uint64 edge"])
    sign = rng.choice((1, -1))
    value = {
        "1": lambda: 1,
        "small": lambda: rng.randrange(-15, 16),
        "/16": lambda: 16 * sign * rng.randrange(1, 1 << 20),
        "int32": lambda: sign * rng.randrange(17, 1 << 31),
        "int32 edge": lambda: rng.choice([2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1, -(2**31) - 16]),
        "int64": lambda: sign * rng.randrange(1 << 31, 1 << 63),
        "int64 /16": lambda: 16 * sign * rng.randrange(1 << 27, 1 << 59),
        "uint64": lambda: rng.randrange(1 << 63, 1 << 64),
        "uint64 edge": lambda: rng.choice([2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1]),
    }[kind]()
    return (
        ("int 1" if value == 1 else "int /16" if value % 16 == 0 else "int", value)
        if abs(value) < 2**31
        else ("int past int32", value)
    )


def _random_descriptor(rng):
    from triton.tools.tensor_descriptor import TensorDescriptor

    dtype = rng.choice(_DESC_DTYPES)
    rows, cols = rng.choice([64, 128]), 64
    base = _view(64 * rng.randrange(16), dtype, rows * cols).view(rows, cols)
    block = [rng.choice([8, 16, 32]), rng.choice([16, 32, 64])]
    extra = dict(padding=rng.choice(["zero", "nan"]))  # Triton keys neither (it is the launcher's business)
    if "round_f32_to_tf32" in TensorDescriptor.__dataclass_fields__ and dtype == torch.float32:
        extra["round_f32_to_tf32"] = rng.random() < 0.5
    if rng.random() < 0.7:
        return "descriptor", TensorDescriptor(base, [rows, cols], [cols, 1], block, **extra)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    swizzle = rng.choice([s for s in (32, 64, 128) if s <= block[-1] * base.element_size()])
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8 * base.element_size(), rank=2)
    return "gluon descriptor", GluonDescriptor(base, [rows, cols], [cols, 1], block, layout, padding=extra["padding"])


class _Size(enum.IntEnum):
    BIG = 64


def _unknown(rng):
    """Arguments the key does not handle (Triton takes some, with its own specialization, and rejects others)."""
    return "unknown", rng.choice([(16, 1), (1, 3), _Size.BIG, tl.constexpr(4), torch.float16, "name"])


def _argument(rng, like=None):
    """A random argument, of the kind of ``like`` (an int for a bool and back) when given, else of any kind."""
    makers = {
        "tensor": _tensor,
        "int": _int,
        "bool": lambda r: ("bool", r.random() < 0.5),
        "None": lambda r: ("None", None),
        "float": lambda r: ("float", r.choice([0.0, -0.0, 1.0, 16.0, r.uniform(-1e3, 1e3), 1e300])),
        "descriptor": _random_descriptor,
    }
    family = {
        "misaligned tensor": "tensor",
        "gluon descriptor": "descriptor",
        "int 1": "int",
        "int /16": "int",
        "int past int32": "int",
        "unknown": None,
    }.get(like, like)
    if family in ("int", "bool", "None") and rng.random() < 0.5:
        family = rng.choice(["int", "bool", "None"])  # the scalars that compare equal in Python or not
    if family is None or rng.random() < 0.15:
        if rng.random() < 0.03:
            return _unknown(rng)
        family = rng.choice(list(makers))
    return makers[family](rng)


_CONSTEXPRS = {"BLOCK": [8, 16, 32, 1, True], "FLAG": [False, True, 0, 1], "ACT": [None, "relu", "gelu"]}
_OPTIONS = {"num_warps": [4, 8], "num_stages": [2, 3]}


def _first_call(rng):
    return {
        "runtime": [_argument(rng) for _ in _RUNTIME],
        "named": rng.randrange(len(_RUNTIME) + 1),
        "keywords": {},
        "positional_constexprs": 0,
        "omit_c": False,
        "grid": (1,),
    }


def _mutate(rng, call):
    """The next call of a walk: the last one with one thing changed."""
    call = dict(call, runtime=list(call["runtime"]), keywords=dict(call["keywords"]))
    what = rng.choice(["argument"] * 6 + ["keyword", "keyword", "named", "positional_constexprs", "omit_c", "grid"])
    if what == "argument":
        i = rng.randrange(len(_RUNTIME))
        call["runtime"][i] = _argument(rng, like=call["runtime"][i][0])
    elif what == "keyword":
        name, values = rng.choice(list(_CONSTEXPRS.items()) + list(_OPTIONS.items()))
        if name in call["keywords"] and rng.random() < 0.3:
            del call["keywords"][name]  # a constexpr left to its default, an option to Triton's
        else:
            call["keywords"][name] = rng.choice(values)
        order = list(call["keywords"].items())
        rng.shuffle(order)
        call["keywords"] = dict(order)
    elif what == "named":  # how many runtime arguments go by name (the last ones)
        call["named"] = rng.randrange(len(_RUNTIME) + 1)
    elif what == "positional_constexprs":
        call["positional_constexprs"] = 0 if call["positional_constexprs"] else rng.randrange(1, 3)
    elif what == "omit_c":
        call["omit_c"] = not call["omit_c"]
    else:
        call["grid"] = rng.choice([(1,), (2, 3), (4, 1, 1)])
    return call


def _arguments(call):
    """(args, kwargs) for the call: runtime arguments positionally then by name (in a shuffled-once order),
    constexprs positionally if asked (every runtime argument is then positional), keywords."""
    values = [v for _, v in call["runtime"]]
    names = list(_RUNTIME)
    if call["positional_constexprs"]:  # (every runtime argument is then passed, c too)
        constexprs = [call["keywords"].get(n, d) for n, d in (("BLOCK", 8), ("FLAG", False))]
        args = tuple(values) + tuple(constexprs[: call["positional_constexprs"]])
        return args, {k: v for k, v in call["keywords"].items() if k not in ("BLOCK", "FLAG")[: len(args) - 5]}
    if call["omit_c"]:
        values, names = values[:-1], names[:-1]
    split = max(0, len(values) - call["named"])
    named = dict(zip(names[split:], values[split:]))
    return tuple(values[:split]), {**dict(reversed(named.items())), **call["keywords"]}


def _describe(call):
    args, kwargs = _arguments(call)
    kinds = {name: kind for name, (kind, _) in zip(_RUNTIME, call["runtime"])}
    return (
        f"args={[_short(a) for a in args]} kwargs={ {k: _short(v) for k, v in kwargs.items()} } "
        f"grid={call['grid']} kinds={kinds}"
    )


def _short(a):
    if isinstance(a, torch.Tensor):
        return f"tensor({a.dtype}, data_ptr % 16 = {a.data_ptr() % 16})"
    if hasattr(a, "block_shape"):
        return f"{type(a).__module__.split('.')[1]} descriptor({a.base.dtype}, {a.block_shape})"
    return repr(a)


def _outcome(launch, launches):
    """(binary, launch arguments) of one launch, or the exception it raised."""
    before = len(launches)
    try:
        launch()
    except Exception as e:  # noqa: BLE001 - Triton rejects some arguments; both paths must then fail alike
        return type(e)
    assert len(launches) == before + 1
    binary, args = launches[-1]
    return binary, args[:6], args[9:]  # grid, stream, function, metadata; then every kernel argument


def _same_arguments(mine, triton_s):
    """The runtime arguments are the call's own; a constexpr (which the launcher skips) may be another value
    that Triton's own cache takes for the same (1 for True: Triton looks its key up by ==, not by type)."""
    n = len(_RUNTIME)
    return (
        len(mine) == len(triton_s)
        and mine[n:] == triton_s[n:]
        and all(
            a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b)
            for a, b in zip(mine[:n], triton_s[:n])
        )
    )


@pytest.mark.parametrize("dns", [False, True], ids=["specialized", "do_not_specialize"])
def test_a_cache_hit_launches_the_binary_tritons_binder_chooses(cuda_jit, dns):
    """For every kind of argument Triton specializes on: random walks of calls, each changing one thing of
    the last (an argument, a constexpr or option, how arguments are passed, the grid). Each call goes
    through CachedLauncher and then through Triton's own launch path; both must launch the same binary with
    the same arguments, and whenever two calls have the same cache key Triton must choose one binary for
    both. The key must be None (Triton's path) exactly where the contract says: a misaligned tensor, a
    constexpr passed positionally, a runtime argument left to its default while others go by keyword, an
    argument of another type."""
    from helpers import py_random

    rng = py_random()
    options = dict(do_not_specialize=["a"], do_not_specialize_on_alignment=["X"]) if dns else {}
    kernel = JITFunction(_spec_kernel, **options)
    cl = CachedLauncher(kernel)
    by_key, hits = {}, {}
    for _ in range(40):
        call = _first_call(rng)
        for _ in range(60):
            call = _mutate(rng, call)
            args, kwargs = _arguments(call)
            pos, kw = cl._positional(args, kwargs) if kwargs else (args, kwargs)
            key = None if pos is None else cl._key(pos, kw, torch.cuda.current_device())
            omitted = call["omit_c"] and not call["positional_constexprs"]
            kinds = {kind for kind, _ in call["runtime"][: 4 if omitted else 5]}
            # a runtime argument left to its default takes Triton's path when keywords are passed; with
            # none, the call is keyed like any other (the default is fixed) and checked below like any other
            must_take_tritons_path = bool(
                call["positional_constexprs"] or (omitted and kwargs) or kinds & {"misaligned tensor", "unknown"}
            )
            assert (key is None) == must_take_tritons_path, _describe(call)
            hit = key is not None and key in cl.compiled
            mine = _outcome(lambda: cl[call["grid"]](*args, **kwargs), cuda_jit)
            triton_s = _outcome(lambda: kernel[call["grid"]](*args, **kwargs), cuda_jit)
            if isinstance(triton_s, type):
                assert mine is triton_s and not hit, _describe(call)
                continue
            assert mine[0] is triton_s[0], (
                f"the cache launched {mine[0]} where Triton chooses {triton_s[0]} for {_describe(call)}; "
                f"the key was first made by {by_key.get(key, (None, 'no call'))[1]}"
            )
            assert mine[1] == triton_s[1] and _same_arguments(mine[2], triton_s[2]), _describe(call)
            if key is not None:
                first = by_key.setdefault(key, (triton_s[0], _describe(call)))
                assert first[0] is triton_s[0], f"{_describe(call)} and {first[1]}: one key, two binaries"
            if hit:
                for kind in kinds | {f"{k}={v!r}" for k, v in kwargs.items() if k in _CONSTEXPRS}:
                    hits[kind] = hits.get(kind, 0) + 1
    # not vacuous: every kind of argument was reused from the cache, for keyword constexprs too
    kinds = {
        "tensor",
        "int 1",
        "int /16",
        "int",
        "int past int32",
        "None",
        "bool",
        "float",
        "descriptor",
        "gluon descriptor",
        "BLOCK=32",
        "FLAG=True",
        "ACT='relu'",
    }
    assert kinds <= set(hits), sorted(kinds - set(hits))


def test_a_callable_grid_and_a_runtime_parameter_after_a_constexpr_take_tritons_path(cuda_jit):
    kernel = JITFunction(_spec_kernel)
    cl = CachedLauncher(kernel)
    x = _view(0, torch.float32, 16)
    for _ in range(2):
        cl[lambda meta: (1,)](x, 16, 32, x, 16, BLOCK=16)
    assert cl.compiled == {} and len(cuda_jit) == 2

    def late_runtime(X, BLOCK: tl.constexpr, n):
        pass

    late = CachedLauncher(JITFunction(late_runtime))
    assert late._positional((x,), dict(BLOCK=16, n=16)) == (None, None)
    for _ in range(2):
        late[(1,)](x, BLOCK=16, n=16)
    assert late.compiled == {} and len(cuda_jit) == 4


_EDGES = [
    0,
    False,
    1,
    True,
    None,
    -1,
    15,
    16,
    -16,
    17,
    48,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    -(2**31) - 16,
    2**31 + 16,
    2**63 - 16,
    2**63 - 1,
    2**63,
    2**63 + 16,
    2**64 - 16,
    2**64 - 1,
    -(2**63),
    0.0,
    -0.0,
    1.0,
    16.0,
]


def test_scalars_at_the_edges_share_a_key_only_where_triton_shares_a_binary(cuda_jit):
    """Every pair of edge scalars (bool against 0 and 1, each int32/int64/uint64 boundary), in each runtime
    parameter: one key only where Triton's launch path picks one binary."""
    kernel = JITFunction(_spec_kernel)
    cl = CachedLauncher(kernel)
    x = _view(0, torch.float32, 16)
    for slot in range(len(_RUNTIME)):
        seen = {}
        for value in _EDGES:
            args = [x, 16, 32, x, 16]
            args[slot] = value
            binary = _outcome(lambda: kernel[(1,)](*args), cuda_jit)[0]
            first, first_binary = seen.setdefault(cl._key(tuple(args), {}, 0), (value, binary))
            assert first_binary is binary, (
                f"{_RUNTIME[slot]}={value!r} has the key of {_RUNTIME[slot]}={first!r}, "
                f"but Triton builds {binary} for it and {first_binary} for the other"
            )


# -- on a GPU: the binary a hit launches is the CompiledKernel Triton's own launch returns ---------------


def _gpu_kernel(Out, X, a, b, flag, scale, Y, desc, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    v = tl.load(X + offs).to(tl.float32) * scale + (a % 1000) + (b % 1000) + flag
    if Y is not None:
        v += tl.load(Y + offs).to(tl.float32)
    if desc is not None:
        v += tl.sum(tl.sum(desc.load([0, 0]).to(tl.float32), axis=1), axis=0)
    if TWICE:
        v = v * 2
    tl.store(Out + offs, v)


def _gpu_reference(X, a, b, flag, scale, Y, desc, BLOCK, TWICE=False):
    v = X[:BLOCK].double() * scale + (a % 1000) + (b % 1000) + flag
    if Y is not None:
        v += Y[:BLOCK].double()
    if desc is not None:
        v += desc.base[: desc.block_shape[0], : desc.block_shape[1]].double().sum()
    return (v * 2 if TWICE else v).float()


@pytest.mark.gpu
def test_a_hit_launches_the_compiled_kernel_triton_chooses_on_gpu():
    """Each argument kind varied in turn from a base call: CachedLauncher's cached CompiledKernel for the
    call is the very object ``kernel[grid]`` returns for it, and the kernel computes with the call's values."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = "cuda"
    kernel = JITFunction(_gpu_kernel)
    cl = CachedLauncher(kernel)
    gen = torch.Generator(device=dev).manual_seed(0)
    buf = torch.randn(4096, device=dev, generator=gen)
    x, y, out = buf[:128], buf[256:384], torch.empty(128, device=dev)
    tile = torch.randn(64, 64, device=dev, generator=gen)
    base = dict(X=x, a=16, b=32, flag=True, scale=0.5, Y=y, desc=None)
    variants = [
        dict(a=48),
        dict(a=1),
        dict(a=17),
        dict(a=2**31 + 16),
        dict(b=0),
        dict(b=2**63 + 16),
        dict(flag=False),
        dict(flag=1),
        dict(flag=0),
        dict(scale=2.0),
        dict(Y=None),
        dict(X=x.half()),
        dict(X=buf[4:132]),
        dict(X=buf[1:129]),
        dict(Y=buf[512:640]),
    ]
    if torch.cuda.get_device_capability()[0] >= 9:  # host TMA descriptors
        variants += [
            dict(desc=TensorDescriptor.from_tensor(tile, [16, 32])),
            dict(desc=TensorDescriptor.from_tensor(tile[16:], [16, 32])),
            dict(desc=TensorDescriptor.from_tensor(tile, [32, 32])),
            dict(desc=TensorDescriptor.from_tensor(tile.half(), [16, 32])),
        ]
    calls = [({**base, **v}, kw) for v in [{}] + variants for kw in (dict(BLOCK=32), dict(BLOCK=64, TWICE=True))]
    binaries = set()
    for named, kw in calls:
        values = list(named.values())
        # runtime arguments positionally, and the last three by name; constexprs by keyword
        args, kwargs = (out, *values[:4]), {**dict(zip(["scale", "Y", "desc"], values[4:])), **kw}
        for _ in range(2):  # a miss (through Triton) or, for the same key, a hit; then a hit
            out.fill_(float("nan"))
            cl[(1,)](*args, **kwargs)
            expected = _gpu_reference(**named, **kw)
            torch.testing.assert_close(out[: kw["BLOCK"]], expected, rtol=1e-5, atol=1e-3)
        pos, kw2 = cl._positional(args, kwargs)
        key = cl._key(pos, kw2, torch.cuda.current_device())
        described = ({k: _short(v) for k, v in named.items()}, kw)
        assert (key is None) == (named["X"].data_ptr() % 16 != 0), described
        compiled = kernel[(1,)](*args, **kwargs)
        if key is not None:
            assert cl.compiled[key][0] is compiled, described
        binaries.add(compiled.hash)
    assert len(binaries) > 10  # the variants reached distinct binaries, not one
