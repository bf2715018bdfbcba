"""Spec selection per thread and async task, hook contracts, and backend identity read from declarations."""

import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import threading

import pytest
from helpers import compile_for, make_spec, run_together
import torch
import triton
import triton.language as tl

import tritonspec
from tritonspec import SpecContractError, SpecError
from tritonspec.specialization import resolve
from tritonspec.kernel_table import RMSNormForward


@tl.core.builtin
def exp_squared(x, _semantic=None):
    return _semantic.mul(x, x, True)


@tl.core.builtin
def exp_doubled(x, _semantic=None):
    return _semantic.add(x, x, True)


def injecting(name, fn):
    mod = make_spec(name, exp=fn, math_ext_base_func_list=["exp"])
    mod.__all__ = ["math_ext_base_func_list"]
    return mod


def _exp_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.exp(tl.load(x_ptr + offs)))


def _ttir() -> str:
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}
    return compile_for(_exp_kernel, sig, {"BLOCK": 32}).asm["ttir"]


def _op(ttir: str) -> str:
    return "mul" if "arith.mulf" in ttir else "add" if "arith.addf" in ttir else "exp" if "math.exp" in ttir else ttir


# -- per-thread selection ---------------------------------------------------------------------------


def test_threads_interleaving_enter_and_exit_keep_their_own_selection(registry):
    """The reproducer: A leaving its `with` popped B's selection, and B compiled with A's spec."""
    tritonspec.register_spec("thread_a", injecting("thread_a_spec", exp_squared))
    tritonspec.register_spec("thread_b", injecting("thread_b_spec", exp_doubled))
    step = threading.Barrier(2, timeout=120)
    seen, errors = {}, []

    def thread_a():
        with tritonspec.use_backend("thread_a"):
            step.wait()  # 1: both inside
            step.wait()  # 2: B entered after A
        seen["a after exit"] = resolve.explicit_backend()
        step.wait()  # 3: A has left
        seen["a compiles outside"] = _op(_ttir())
        step.wait()  # 4

    def thread_b():
        step.wait()  # 1
        with tritonspec.use_backend("thread_b"):
            step.wait()  # 2
            step.wait()  # 3: A left its block while B is still inside
            seen["b still selected"] = resolve.explicit_backend()
            seen["b compiles inside"] = _op(_ttir())
            step.wait()  # 4

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)
            step.abort()

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (thread_a, thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert seen == {
        "a after exit": None,
        "a compiles outside": "exp",
        "b still selected": "thread_b",
        "b compiles inside": "add",
    }


def test_concurrent_compiles_and_interpreted_runs_use_each_threads_spec(registry):
    """Many compiles and interpreted launches at once: each sees its own thread's tl injections."""
    tritonspec.register_spec("thread_a", injecting("thread_a_spec", exp_squared))
    tritonspec.register_spec("thread_b", injecting("thread_b_spec", exp_doubled))
    kernel = triton.jit(_exp_kernel)
    x = torch.rand(32) + 0.5
    expected = {"thread_a": ("mul", x * x), "thread_b": ("add", x + x), None: ("exp", torch.exp(x))}
    results = []

    def work(name):
        for _ in range(4):
            with tritonspec.use_backend(name) if name else contextlib.nullcontext():
                ttir = _ttir()
                y = torch.full((32,), float("nan"))
                kernel[(1,)](x, y, BLOCK=32)
            results.append((name, _op(ttir), y))

    run_together(work, ["thread_a", "thread_b", None])
    assert len(results) == 12
    for name, op, y in results:
        assert op == expected[name][0], name
        torch.testing.assert_close(y, expected[name][1], rtol=1e-6, atol=1e-6)


def test_async_tasks_keep_their_own_selection(registry):
    tritonspec.register_spec("task_a", make_spec("task_a_spec"))
    tritonspec.register_spec("task_b", make_spec("task_b_spec"))

    async def task(name, gate, other):
        with tritonspec.use_backend(name):
            gate.set()
            await other.wait()
            await asyncio.sleep(0)
            return resolve.explicit_backend()

    async def main():
        ga, gb = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task("task_a", ga, gb), task("task_b", gb, ga))

    assert asyncio.run(main()) == ["task_a", "task_b"]
    assert resolve.explicit_backend() is None


def test_process_default_applies_to_every_thread_below_use_backend(registry):
    tritonspec.register_spec("proc_default", make_spec("proc_default_spec"))
    tritonspec.register_spec("local", make_spec("local_spec"))
    tritonspec.set_default_backend("proc_default")
    seen = {}
    t = threading.Thread(target=lambda: seen.setdefault("thread", resolve.explicit_backend()))
    t.start()
    t.join()
    with tritonspec.use_backend("local"):
        seen["inside"] = resolve.explicit_backend()
    tritonspec.set_default_backend(None)
    seen["cleared"] = resolve.explicit_backend()
    assert seen == {"thread": "proc_default", "inside": "local", "cleared": None}
    with pytest.raises(SpecError, match="set_default_backend: no spec registered for backend 'nope'"):
        tritonspec.set_default_backend("nope")


def test_the_environment_sets_the_process_default():
    code = (
        "import tritonspec; print(tritonspec.default_backend(), tritonspec.specialization.resolve.explicit_backend())"
    )
    env = dict(os.environ, TRITONSPEC_DEFAULT_BACKEND="iluvatar")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["iluvatar", "iluvatar"], proc.stderr[-2000:]


# -- hook contracts -----------------------------------------------------------------------------------


def _never(*args, **kwargs):
    raise AssertionError("not to be called")


@pytest.mark.parametrize(
    "exports,match",
    [
        (dict(num_stages_cap="2"), "hook 'num_stages_cap' is the wrong thing: expected an int >= 1, got str '2'"),
        (dict(num_stages_cap=-1), "hook 'num_stages_cap' is the wrong thing: expected an int >= 1, got int -1"),
        (dict(num_stages_cap=True), "hook .num_stages_cap. is the wrong thing: expected an int >= 1, got bool"),
        (dict(kernel_config=42), "hook 'kernel_config' must be a function, got int 42"),
        (
            dict(kernel_config=lambda kernel: None),
            r"hook 'kernel_config': expected a function callable as \(kernel, device=\)",
        ),
        (
            dict(atomic_add_int64=lambda a, b: None),
            r"hook 'atomic_add_int64': expected a function callable as \(semantic, ptr",
        ),
        (
            dict(atomic_disable_bf16="yes"),
            "hook 'atomic_disable_bf16' is the wrong thing: expected bool, got str 'yes'",
        ),
        (dict(num_stages_cap=lambda n: n), r"hook 'num_stages_cap': expected a function callable as \(\)"),
        (dict(interpreter_libdevice=3), "hook 'interpreter_libdevice' is the wrong thing: expected module"),
    ],
)
def test_a_value_of_the_wrong_kind_or_range_is_refused_naming_backend_and_hook(registry, exports, match):
    with pytest.raises(SpecContractError, match="backend 'typed' " + match):
        tritonspec.register_spec("typed", make_spec("typed_spec", **exports))


def test_a_computed_value_and_a_functions_result_are_checked_at_lookup(registry):
    tritonspec.register_spec(
        "typed",
        make_spec(
            "typed_spec",
            num_stages_cap=lambda: -1,
            kernel_config=lambda kernel, **problem: ["BLOCK_M", 4],
            get_cc=lambda: 7,
        ),
    )
    with tritonspec.use_backend("typed"):
        with pytest.raises(
            SpecContractError,
            match="backend 'typed' hook 'num_stages_cap' is the wrong thing: expected an int >= 1, got int -1",
        ):
            tritonspec.spec("num_stages_cap")
        with pytest.raises(
            SpecContractError, match="hook 'kernel_config' returned the wrong thing: expected dict or None, got list"
        ):
            tritonspec.launch_config(RMSNormForward, "cpu", RMSNormForward(BLOCK_M=1, BLOCK_N=64))
        with pytest.raises(SpecContractError, match="hook 'get_cc' returned the wrong thing: expected str or None"):
            tritonspec.spec("get_cc")
        # where Triton consults it: the error reaches the compile, naming backend and hook
        with pytest.raises(SpecContractError, match="backend 'typed' hook 'num_stages_cap'"):
            _ttir()


def test_an_injector_list_given_as_a_string_is_refused(registry):
    spec = make_spec("string_list_spec", exp=exp_squared, math_ext_base_func_list="exp")
    spec.__all__ = ["math_ext_base_func_list"]
    with pytest.raises(SpecError, match="math_ext_base_func_list must be a list of names, got str 'exp'"):
        tritonspec.register_spec("strlist", spec)
    spec = make_spec("not_callable_spec", exp=1.5, math_ext_base_func_list=["exp"])
    spec.__all__ = ["math_ext_base_func_list"]
    with pytest.raises(SpecError, match="names 'exp' but not_callable_spec.exp is not a function"):
        tritonspec.register_spec("notfn", spec)


@pytest.mark.parametrize(
    "op,override,match",
    [
        ("rms_norm", {"BLOCK_M": 0}, "kernel_config\\('rms_norm_fwd'\\): BLOCK_M=0 must be >= 1"),
        ("swiglu", {"BLOCK_N": 48}, "kernel_config\\('swiglu_fwd'\\): BLOCK_N=48 must be a power of two"),
        (
            "rope",
            {"BLOCK_N": 48},
            "kernel_config\\('rope'\\): unknown launch parameter 'BLOCK_N'.*'rope' takes .*BLOCK_S",
        ),
        ("rope", {"BLOCK_S": 48}, "kernel_config\\('rope'\\): BLOCK_S=48 must be a power of two"),
        (
            "rms_norm",
            {"BLOKC_N": 64},
            "kernel_config\\('rms_norm_fwd'\\): unknown launch parameter 'BLOKC_N'; did you mean 'BLOCK_N'",
        ),
        ("rms_norm", {"num_warps": 6}, "kernel_config\\('rms_norm_fwd'\\): num_warps=6 must be a power of two"),
        ("swiglu", {"num_stages": "2"}, "kernel_config\\('swiglu_fwd'\\): num_stages='2' must be an int, not str"),
    ],
)
def test_bad_launch_configs_fail_before_the_launch_naming_backend_kernel_and_key(registry, op, override, match):
    from tritonspec import ops

    tritonspec.register_spec("badcfg", make_spec("badcfg_spec", kernel_config=lambda kernel, **p: dict(override)))
    x = torch.randn(3, 64)
    calls = {
        "rms_norm": lambda: ops.rms_norm(x, torch.ones(64)),
        "swiglu": lambda: ops.swiglu(x, x),
        "rope": lambda: ops.rope(
            torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 3, 16), torch.randn(1, 3, 16)
        ),
    }
    with tritonspec.use_backend("badcfg"):
        with pytest.raises(tritonspec.LaunchConfigError, match="backend 'badcfg' " + match):
            calls[op]()


# -- backend identity ---------------------------------------------------------------------------------


def test_device_types_and_targets_come_from_the_backends_declarations(registry):
    assert resolve.backend_for_device("npu:0") == "ascend"  # not "npu": ascend's op hooks are consulted
    assert resolve.backend_for_device("cpu") == "cpu"
    seen = []

    def kernel_config(kernel, **problem):
        seen.append(problem["device"])
        return {"BLOCK_N": 64}

    tile = RMSNormForward(BLOCK_N=8, BLOCK_M=1)

    info = tritonspec.BackendInfo(runs="emulated", targets=("toygpu",), devices=("xpu",))
    tritonspec.register_spec("toy", make_spec("toy_spec", backend_info=info, kernel_config=kernel_config))
    assert resolve.backend_for_device(torch.device("xpu", 1)) == "toy"
    assert resolve.backend_for_target("toygpu") == "toy"
    assert tritonspec.launch_config(RMSNormForward, "xpu:1", tile).BLOCK_N == 64
    assert seen == [torch.device("xpu", 1)]
    clash = tritonspec.BackendInfo(runs="emulated", devices=("xpu",))
    tritonspec.register_spec("toy2", make_spec("toy2_spec", backend_info=clash))
    with pytest.raises(SpecError, match="device type 'xpu' is claimed by backends toy, toy2"):
        resolve.backend_for_device("xpu:0")


def test_launch_configs_are_memoized_per_device(registry):
    """One host, two GPU generations: a config chosen for one device is never reused for the other."""

    def kernel_config(kernel, device, **problem):
        return {"BLOCK_N": 128 if device.index == 1 else 32}

    info = tritonspec.BackendInfo(runs="real", devices=("xpu",))
    tritonspec.register_spec("twogen", make_spec("twogen_spec", backend_info=info, kernel_config=kernel_config))
    tile = RMSNormForward(BLOCK_N=8, BLOCK_M=1)
    assert [tritonspec.launch_config(RMSNormForward, f"xpu:{i}", tile).BLOCK_N for i in (0, 1, 0, 1)] == [
        32,
        128,
        32,
        128,
    ]


def test_nvidia_tiles_follow_each_devices_capability(monkeypatch):
    from tritonspec_backends.nvidia.backend.spec import configs

    monkeypatch.setattr(configs, "_device_capability", lambda index: {0: 75, 1: 90}[index])
    slow = configs.kernel_config("rms_norm_fwd", device=torch.device("cuda", 0), N=1024)
    fast = configs.kernel_config("rms_norm_fwd", device=torch.device("cuda", 1), N=1024)
    assert slow == {"num_warps": 4} and fast is None


def test_no_backend_is_spelled_in_the_core():
    """Vendor names, device types and targets live in each backend's own package only."""
    root = pathlib.Path(__file__).parents[1]
    # "cpu" is also torch's device type for the interpreter, which the core may name.
    vendors = [
        p.parents[2].name
        for p in (root / "third_party").glob("*/backend/spec/__init__.py")
        if p.parents[2].name != "cpu"
    ]
    for path in (
        "python/tritonspec/specialization/resolve.py",
        "python/tritonspec/specialization/check.py",
        "python/tritonspec/launch.py",
        "python/tritonspec/specialization/providers.py",
        "setup.py",
    ):
        source = (root / path).read_text()
        for name in vendors + ["npu", "Ascend910B3", "gfx942"]:
            assert f'"{name}"' not in source and f"'{name}'" not in source, (path, name)


def test_a_backward_run_on_another_thread_uses_its_forwards_selection(registry):
    """Autograd runs CUDA backwards on a device thread, where this thread's use_backend is not in
    scope: each op's backward carries its forward's selection (the eager path and the library op)."""
    from tritonspec.ops import _library, rms_norm

    seen = []

    def kernel_config(kernel, **problem):
        seen.append((kernel, threading.current_thread().name))
        return None

    tritonspec.register_spec("carried", make_spec("carried_spec", kernel_config=kernel_config))
    for library, n in ((False, 40), (True, 48)):  # another size each: launch configs are memoized
        seen.clear()
        _library.FORCE_LIBRARY_OP = library
        try:
            x = torch.randn(3, n, requires_grad=True)
            with tritonspec.use_backend("carried"):
                y = rms_norm(x, torch.ones(n))
            t = threading.Thread(target=lambda: y.sum().backward(), name="autograd-elsewhere")
            t.start()
            t.join()
        finally:
            _library.FORCE_LIBRARY_OP = False
        assert ("rms_norm_fwd", "MainThread") in seen and ("rms_norm_bwd", "autograd-elsewhere") in seen, seen
        torch.testing.assert_close(
            x.grad.double(),
            torch.autograd.functional.vjp(
                lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6),
                x.detach().double(),
                torch.ones(3, n, dtype=torch.float64),
            )[1],
            rtol=1e-5,
            atol=1e-5,
        )
