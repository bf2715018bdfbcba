"""``tritonspec check --kernels``: ops recorded on meta tensors, compiled with Triton's own binder for a
target, and each binary held to the target's declared limits.

The whole check (every kernel, model, target) takes minutes and runs once in CI (tests/run.sh); here
one kernel at one shape, for a CUDA target, shows the parts work and fail for the right reasons."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import tritonspec
from tritonspec import CheckTarget, kernel_check, kernel_table
from tritonspec.text_tables import parse_tables

LLAMA = kernel_check.MODELS[0]
SM90 = ("cuda", 90, 32)


def test_every_kernel_with_ops_has_a_case_and_cases_name_declared_kernels():
    with_ops = {k.name for k in kernel_table.KERNELS.values() if k.ops}
    assert with_ops <= set(kernel_check.CASES), with_ops - set(kernel_check.CASES)
    assert set(kernel_check.CASES) <= set(kernel_table.KERNELS)


# The ops' kernels are interpreted functions in this session (TRITON_INTERPRET=1), so whatever compiles
# them runs in a fresh process without the interpreter. PRELUDE registers a vendor spec there:
# spec(name, table, **limits) -> its CheckTarget.
PRELUDE = """
import json, re, sys
import tritonspec
from tritonspec import CheckTarget, ConfigTable, kernel_check
from helpers import make_spec
LLAMA = kernel_check.MODELS[0]
RMSNORM = {"rmsnorm": kernel_check.CASES["rmsnorm"]}
def spec(name, table=None, **limits):
    target = CheckTarget(name + "90", ("cuda", 90, 32), **limits)
    exports = dict(backend_info=tritonspec.BackendInfo(runs="emulated", check_targets=(target,)))
    if table is not None:
        exports["kernel_config"] = ConfigTable(table)
    tritonspec.register_spec(name, make_spec(name, **exports))
    return target
"""


def _compiled(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc


def test_recording_runs_nothing_and_sees_the_backends_launch_configs():
    """The ops' launches are recorded, not run (meta tensors have no data), with the selected backend's
    configs: the vendor's 2 warps reach the compile's options; Triton's binder types the pointers."""
    proc = _compiled(
        """
        target = spec("kc-two-warps", {"rms_norm_fwd": lambda kernel, **problem: {"num_warps": 2}})
        compiles, failed = kernel_check.record("kc-two-warps", target, RMSNORM, [LLAMA], (16,), ("bfloat16",))
        print(json.dumps({"failed": failed, "compiles": [
            dict(name=c.name, options=c.options, signature=c.signature, shown=c.shown, used_by=c.used_by)
            for c in compiles]}))
        """
    )
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["failed"] == {}
    by_name = {c["name"]: c for c in found["compiles"]}
    assert set(by_name) >= {"_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel"}  # forward and backward
    fwd = by_name["_rms_norm_fwd_kernel"]
    assert fwd["options"]["num_warps"] == 2 and "num_warps=2" in fwd["shown"]
    assert "*bf16" in fwd["signature"].values()
    assert fwd["used_by"] == ["Llama-3-8B T=16 bfloat16 (rmsnorm)"]
    assert by_name["_rms_norm_bwd_kernel"]["options"]["num_warps"] != 2  # only the forward was overridden


def test_the_binary_is_read_and_compared_with_the_targets_limits():
    """A CUDA compile's shared memory, registers and scratch come from its cubin; within generous limits
    nothing is over, and the same binary is over a limit set one byte below what it uses."""
    proc = _compiled(
        """
        target = spec("kc-read", shared_memory=232448, registers=255)
        compiles, _ = kernel_check.record("kc-read", target, RMSNORM, [LLAMA], (16,), ("float16",))
        c = next(c for c in compiles if c.name == "_rms_norm_bwd_kernel")
        kernel_check.compile_one(c, target)
        tight = CheckTarget("tight", ("cuda", 90, 32), shared_memory=c.resources["shared_memory"] - 1)
        print(json.dumps(dict(error=c.error, used=c.resources, fits=kernel_check.over_limits(c, target),
                              tight=kernel_check.over_limits(c, tight))))
        """
    )
    found = json.loads(proc.stdout.splitlines()[-1])
    used = found["used"]
    assert found["error"] is None
    assert used["shared_memory"] > 0 and 0 < used["registers"] <= 255 and used["scratch"] >= 0
    assert found["fits"] == []
    assert found["tight"] == [f"shared_memory {used['shared_memory']} > {used['shared_memory'] - 1}"]


def test_a_vendor_tile_too_big_for_its_target_fails_the_check_by_name():
    """A vendor table asking RMSNorm's backward for 16-row tiles on a target with 4 KB of shared memory: the
    check exits 1, its table says over, and the failure names kernel, backend, target, resource and both
    numbers (the binary's, and the declared limit)."""
    proc = _compiled(
        """
        spec("kc-too-big", {"rms_norm_bwd": lambda kernel, **problem: {"BLOCK_M": 16}}, shared_memory=4096)
        sys.exit(kernel_check.run(backends=["kc-too-big"], cases=RMSNORM, models=[LLAMA], tokens=(4096,),
                                  dtypes=("bfloat16",)))
        """
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    rows = {r[0]: r for r in parse_tables(out)["Kernel resources: kc-too-big (emulated)"]}
    assert rows["_rms_norm_bwd_kernel"][-1] == "1 over"
    assert rows["_rms_norm_fwd_kernel"][-1] == "ok"
    failure = re.search(r"_rms_norm_bwd_kernel on kc-too-big kc-too-big90: shared_memory (\d+) > 4096; (.*)", out)
    assert failure, out
    assert int(failure.group(1)) > 4096
    assert "BLOCK_M=16" in failure.group(2) and "Llama-3-8B T=4096 bfloat16 (rmsnorm)" in out
    summary = [line for line in out.splitlines() if line.startswith("kernel resources:")]
    compiles = sum(int(r[2]) for r in rows.values())
    assert summary == [f"kernel resources: {compiles} compiles, 1 over a target's limits"]


def test_a_case_that_cannot_run_is_reported_by_name():
    proc = _compiled(
        """
        target = spec("kc-broken")
        def broken(model, tokens, dtype):
            raise ValueError("no such layer")
        compiles, failed = kernel_check.record("kc-broken", target, {"broken": broken}, [LLAMA], (1,), ("float16",))
        print(json.dumps(dict(n=len(compiles), failed=failed)))
        """
    )
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == {"n": 0, "failed": {"broken: Llama-3-8B T=1 float16": "ValueError: no such layer"}}


def test_the_interpreter_is_refused_with_a_reason():
    target = CheckTarget("x", SM90)
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET"):
        kernel_check.record("nvidia", target)


def test_check_targets_are_validated_and_the_old_single_target_still_works():
    with pytest.raises(TypeError, match="shared_memory must be an int"):
        CheckTarget("x", SM90, shared_memory=-1)
    with pytest.raises(TypeError, match="target must be GPUTarget's"):
        CheckTarget("x", ("cuda", 90))
    with pytest.warns(FutureWarning, match="check_targets"):
        info = tritonspec.BackendInfo(check_target=SM90)
    assert [t.target for t in info.check_targets] == [SM90]


def test_meta_tensors_need_no_memory_at_deepseek_scale():
    """The experts' weights of DeepSeek-V3 (256 x 4096 x 7168 in bf16, 15 GB) cost nothing to record."""
    deepseek = next(m for m in kernel_check.MODELS if m.name == "DeepSeek-V3")
    from tritonspec.ops._library import recording
    from tritonspec.specialization.resolve import use_backend

    with use_backend("nvidia"), recording() as launches:
        kernel_check.CASES["moe"](deepseek, 16, torch.bfloat16)
    assert {launch.kernel.fn.__name__ for launch in launches} >= {"_moe_up_kernel", "_moe_rows_kernel"}


def test_plans_made_for_one_arch_or_before_a_recording_are_dropped():
    """An eager LaunchPlan holds the configs it was made with and relaunches without reaching launch(): plans are
    dropped when ``for_arch`` or ``recording`` begins and ends, so neither sees, nor leaves behind, another's."""
    from tritonspec.launch import for_arch
    from tritonspec.ops._library import PlanCache, recording

    plans = PlanCache()
    plans["device's own"] = object()
    with for_arch(80):
        assert dict(plans) == {}
        plans["sm80's"] = object()
    assert dict(plans) == {}
    plans["device's own"] = object()
    with recording():
        assert dict(plans) == {}
