"""The kernel table: one declaration per kernel, read by the registry, kernelize, the YAML rules,
the vendors' launch-config tables and ``tritonspec check``.

The proof is a toy kernel declared here: a few lines of Triton, its op, its hub-style layer, its
launch-config type and one table entry, and nothing else of tritonspec edited. Every front end
then finds it.
"""

from dataclasses import dataclass
from typing import ClassVar

import pytest
from helpers import make_spec
import torch
import triton
import triton.language as tl
from torch import nn

import tritonspec
from tritonspec import kernel_table
from tritonspec.devices import interpreting
from tritonspec.kernel_table import Kernel, Layer, LaunchConfig
from tritonspec.launch import ConfigTable, launch_config

pytestmark = pytest.mark.skipif(not interpreting(), reason="interpreter tests: CPU tensors need TRITON_INTERPRET=1")


# -- the toy kernel: y = x * weight (the weight broadcast over the last dim) -------------------------


@dataclass(frozen=True, kw_only=True)
class ToyScaleConfig(LaunchConfig):
    kernel: ClassVar[str] = "toy_scale"
    BLOCK: int = 64


@triton.jit
def _toy_scale_kernel(X, W, Y, n, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * tl.load(W + offs % N, mask=mask), mask=mask)


LAUNCHES = []


def toy_scale(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    cfg = launch_config(ToyScaleConfig, x.device, ToyScaleConfig(), N=x.shape[-1])
    LAUNCHES.append(cfg.BLOCK)
    x = x.contiguous()
    y = torch.empty_like(x)
    _toy_scale_kernel[(triton.cdiv(x.numel(), cfg.BLOCK),)](
        x, weight, y, x.numel(), x.shape[-1], BLOCK=cfg.BLOCK, **cfg.options
    )
    return y


class ToyScaleLayer(nn.Module):
    """The hub-style layer: no __init__, reads ``weight`` from the module it replaces."""

    weight: torch.Tensor

    def forward(self, x):
        return toy_scale(x, self.weight)


TOY = Kernel(
    "toy_scale",
    __name__,
    ("toy_scale",),
    "module",
    Layer("ToyScale", ToyScaleLayer, classes=("ToyScale",)),
    (ToyScaleConfig,),
)


# -- a model with a place for it ------------------------------------------------------------------------


class ToyScale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.weight


def _model():
    return nn.Sequential(nn.Linear(8, 24), ToyScale(24), nn.ReLU(), ToyScale(24))


def _reference(model, x):
    lin, s1, _, s2 = model
    h = torch.relu((x.double() @ lin.weight.double().T + lin.bias.double()) * s1.weight.double())
    return h * s2.weight.double()


@pytest.fixture
def toy():
    kernel_table.declare(TOY)  # the one entry: nothing else of tritonspec knows the toy kernel
    LAUNCHES.clear()
    yield TOY
    kernel_table.withdraw(TOY.name)
    from tritonspec.nn import registry_kernels

    registry_kernels.sync()


def _check_replaced(model, report):
    x = torch.randn(5, 8)
    LAUNCHES.clear()
    torch.testing.assert_close(model(x).double(), _reference(model, x), rtol=1e-5, atol=1e-5)
    assert len(LAUNCHES) == 2  # both ToyScale modules ran the Triton kernel
    assert sorted(c.path for c in report) == ["1", "3"]


def test_kernelize_picks_up_a_declared_kernel(toy):
    from tritonspec import nn as tnn

    model = _model()
    tnn.kernelize(model, mode=tnn.Mode.INFERENCE, device="cpu")
    _check_replaced(model, tnn.report(model))
    assert "ToyScale" in tnn.kernelizer.mapping_snapshot()


def test_the_registry_picks_up_a_declared_kernel(toy):
    from tritonspec import nn as tnn
    from tritonspec.nn import registry_kernels

    model = _model()
    found = tnn.discover_kernels(model)
    assert registry_kernels.CpuTritonToyScaleKernel in found
    assert registry_kernels.CpuTritonToyScaleKernel.type == "toy_scale"
    tnn.apply_available_kernels(model)
    _check_replaced(model, [c for c in tnn.report(model) if c.kernel.endswith("ToyScaleLayer.forward")])


def test_yaml_rules_pick_up_a_declared_kernel(toy):
    from tritonspec import nn as tnn

    model = _model()
    report = tnn.apply_rules(model, "- match: {kernel: toy_scale}\n  replace: {kernel: toy_scale}\n")
    _check_replaced(model, report)


def test_check_and_vendor_tables_pick_up_a_declared_kernel(toy, registry):
    from tritonspec.specialization import check

    rows, failures = check.kernel_rows(registry.providers())
    assert ["toy_scale", "toy_scale", "module: ToyScale", "toy_scale", "default", "ok"] in rows and not failures
    # a backend may now tune it, as data checked against the table
    table = ConfigTable({"toy_scale": lambda kernel, **problem: {"BLOCK": 16}})
    tritonspec.register_spec("toy-vendor", make_spec("toy_vendor_spec", kernel_config=table))
    with tritonspec.use_backend("toy-vendor"):
        x = torch.randn(3, 24)
        w = torch.randn(24)
        torch.testing.assert_close(toy_scale(x, w).double(), x.double() * w.double())
    assert LAUNCHES == [16]


def test_check_lists_the_moe_layers(registry):
    """The MoE experts and router are module-site layers like the others (no site of their own)."""
    from tritonspec.specialization import check

    rows, failures = check.kernel_rows(registry.providers())
    assert not failures
    sites = {row[0]: (row[1], row[2]) for row in rows}
    assert sites["moe"] == ("moe_experts", "module: MoEExperts")
    assert sites["moe_router"] == ("moe_route", "module: MoERouter")
    assert set(kernel_table.SITES) == {"module", "function", "attention"}


def test_withdrawn_and_undeclared_kernels_are_gone_everywhere():
    from tritonspec import nn as tnn
    from tritonspec.nn import registry_kernels

    assert "toy_scale" not in kernel_table.KERNELS
    assert not hasattr(registry_kernels, "CpuTritonToyScaleKernel")
    with pytest.raises(tritonspec.LaunchConfigError, match="'toy_scale' is not a declared kernel"):
        ConfigTable({"toy_scale": lambda kernel, **problem: None})
    with pytest.raises(tnn.RuleError, match="rule 0: replace.kernel: 'toy_scale' is not a declared kernel"):
        tnn.load_rules("- match: {name: x}\n  replace: {kernel: toy_scale}\n")


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(name="rmsnorm"), "kernel 'rmsnorm' is already declared"),
        (
            dict(layer=Layer("RMSNorm", ToyScaleLayer)),
            "layer name 'RMSNorm' of kernel 'toy2' already belongs to 'rmsnorm'",
        ),
        (
            dict(configs=(kernel_table.RMSNormForward,)),
            "launch config 'rms_norm_fwd' of kernel 'toy2' is already declared",
        ),
    ],
)
def test_a_declaration_that_clashes_is_refused(bad, match):
    fields = dict(
        name="toy2", module=__name__, ops=("toy_scale",), site="module", layer=Layer("Toy2", ToyScaleLayer), configs=()
    )
    with pytest.raises(ValueError, match=match):
        kernel_table.declare(Kernel(**{**fields, **bad}))
    assert "toy2" not in kernel_table.KERNELS


def test_every_front_end_reads_the_same_declarations():
    """The ops package, the hub layers and the registry types come from the table."""
    from tritonspec import ops
    from tritonspec.nn import KernelType
    from tritonspec.nn.hub import LAYER_NAMES

    for kernel in kernel_table.KERNELS.values():
        assert KernelType(kernel.name) == kernel.name
        for op in kernel.ops:
            assert getattr(ops, op) is kernel.op(op)
        if kernel.layer is not None and kernel.layer.load().__module__ == "tritonspec.nn.hub.layers":
            assert kernel.layer.name in LAYER_NAMES
    assert set(ops.__all__) == {op for k in kernel_table.KERNELS.values() for op in k.ops}
