"""Registry front end (LLaMA-Factory style): registration, discovery, apply_kernel contract — on small test layers."""

import logging

import pytest
from helpers import no_interpreter, tiny_model
import torch
from torch import nn

import tritonspec.nn as tnn
from tritonspec.nn import (
    KERNEL_REGISTRY,
    AutoRegisterKernelMeta,
    DeviceType,
    KernelRegistry,
    KernelType,
    MetaKernel,
    apply_available_kernels,
    apply_kernel,
    discover_kernels,
)
from tritonspec.nn import registry_kernels


@pytest.fixture(autouse=True)
def clean_registry():
    registry_kernels.sync()
    saved = {k: dict(v) for k, v in KERNEL_REGISTRY._registry.items()}
    yield
    KERNEL_REGISTRY._registry.clear()
    KERNEL_REGISTRY._registry.update(saved)


class ToyNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.weight


def _norm_fast(self, x):
    return x * self.weight + 0  # same math, different function: proves the swap without changing numbers


class ToyExperts(nn.Module):
    """Stands in for an MoE experts block: (num_experts, hidden, hidden) weights and a top-1 router."""

    def __init__(self, e, h):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, h, h))
        self.router = nn.Linear(h, e)

    def forward(self, x):
        idx = self.router(x).argmax(-1)
        return torch.stack([x[i] @ self.w[idx[i]] for i in range(x.shape[0])])


def _experts_grouped(self, x):
    idx = self.router(x).argmax(-1)
    return torch.einsum("th,thk->tk", x, self.w[idx])


def test_singleton():
    assert KernelRegistry() is KERNEL_REGISTRY


def test_register_get_and_overwrite_warns(caplog):
    KERNEL_REGISTRY.register(KernelType.MOE, DeviceType.MPS, _experts_grouped)
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.MPS) is _experts_grouped
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.XPU) is None
    with caplog.at_level(logging.WARNING, logger="tritonspec.nn.kernel_registry"):
        KERNEL_REGISTRY.register(KernelType.MOE, DeviceType.MPS, _norm_fast)
    assert "Overwriting kernel for MOE on MPS" in caplog.text
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.MPS) is _norm_fast


@pytest.mark.parametrize(
    "args, match",
    [(("no_such_kernel", DeviceType.CPU, None), "kernel_type"), ((KernelType.RMSNORM, "cpu", None), "device_type")],
)
def test_register_rejects_untyped_keys(args, match):
    with pytest.raises(TypeError, match=match):
        KERNEL_REGISTRY.register(*args)


def test_metaclass_auto_registers_unless_disabled():
    class Auto(MetaKernel):
        type = KernelType.MOE
        device = DeviceType.XPU

        @classmethod
        def apply(cls, model, **kw):
            return model

    class Manual(MetaKernel):
        type = KernelType.MOE
        device = DeviceType.NPU
        auto_register = False

        @classmethod
        def apply(cls, model, **kw):
            return model

    assert isinstance(MetaKernel, AutoRegisterKernelMeta)
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.XPU) is Auto
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.NPU) is None
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.MPS) is None  # the base never registers


def test_moe_kernel_plugs_in_without_engine_changes():
    """A MOE kernel is one more MetaKernel subclass; install, report and revert come from the engine."""

    class ToyMoEKernel(MetaKernel):
        type = KernelType.MOE
        device = DeviceType.CPU
        kernel = _experts_grouped

        @classmethod
        def apply(cls, model, **kw):
            cls.patch_forward(model, lambda path, m: isinstance(m, ToyExperts))
            return model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ToyExperts(3, 4))
    x = torch.randn(5, 4, dtype=torch.float64)
    model.double()
    ref = model(x)
    assert ToyMoEKernel in discover_kernels(model)
    apply_kernel(model, ToyMoEKernel)
    assert tnn.report(model).paths() == ["1"]
    assert model[1].forward.__func__ is _experts_grouped
    torch.testing.assert_close(model(x), ref)
    tnn.revert(model)
    assert "forward" not in vars(model[1])


def test_apply_kernel_rejects_non_metakernel_and_device_mismatch():
    class NotAKernel:
        type = KernelType.RMSNORM
        device = DeviceType.CPU

    class CudaOnly(MetaKernel):
        type = KernelType.RMSNORM
        device = DeviceType.CUDA
        auto_register = False

        @classmethod
        def apply(cls, model, **kw):
            raise AssertionError("must not run")

    model = nn.Sequential(ToyNorm(3))
    with pytest.raises(ValueError, match="not a MetaKernel subclass"):
        apply_kernel(model, NotAKernel)
    with pytest.raises(ValueError, match="is for device CUDA, the current device is CPU"):
        apply_kernel(model, CudaOnly)
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module"):
        apply_kernel(object(), CudaOnly)


def test_discover_skips_non_metakernel_entries():
    KERNEL_REGISTRY.register(KernelType.MOE, DeviceType.CPU, _experts_grouped)  # a bare function
    found = discover_kernels(nn.Linear(2, 2))
    assert _experts_grouped not in found
    assert all(issubclass(k, MetaKernel) and k.device == DeviceType.CPU for k in found)


def test_discover_uses_model_device_then_runtime():
    assert registry_kernels.current_device_type(nn.Linear(2, 2)) == DeviceType.CPU
    assert registry_kernels.current_device_type(nn.Linear(2, 2, device="meta")) == registry_kernels.current_device_type(
        None
    )


def test_failed_apply_is_undone():
    class HalfWay(MetaKernel):
        type = KernelType.RMSNORM
        device = DeviceType.CPU
        auto_register = False
        kernel = _norm_fast

        @classmethod
        def apply(cls, model, **kw):
            cls.patch_forward(model, lambda p, m: isinstance(m, ToyNorm))
            raise RuntimeError("dependency exploded")

    model = nn.Sequential(ToyNorm(3), ToyNorm(3))
    with pytest.raises(RuntimeError, match="exploded"):
        apply_kernel(model, HalfWay)
    assert tnn.report(model) == [] and "forward" not in vars(model[0])


def test_builtin_kernels_registered_for_cuda_and_cpu():
    for kt in (
        KernelType.RMSNORM,
        KernelType.ADD_RMSNORM,
        KernelType.SWIGLU,
        KernelType.ROPE,
        KernelType.FLASH_ATTENTION,
        KernelType.MOE,
        KernelType.MOE_ROUTER,
    ):
        for dev in (DeviceType.CUDA, DeviceType.CPU):
            k = KERNEL_REGISTRY.get_kernel(kt, dev)
            assert issubclass(k, MetaKernel) and k.type == kt and k.device == dev
    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.MPS) is None  # Triton does not run there
    from tritonspec.nn import registry_kernels

    assert KERNEL_REGISTRY.get_kernel(KernelType.MOE, DeviceType.CUDA) is registry_kernels.CudaTritonMoEExpertsKernel
    assert (
        KERNEL_REGISTRY.get_kernel(KernelType.MOE_ROUTER, DeviceType.CPU) is registry_kernels.CpuTritonMoERouterKernel
    )
    decoder = registry_kernels.CpuTritonDecoderLayerKernel
    assert KERNEL_REGISTRY.get_kernel(KernelType.ADD_RMSNORM, DeviceType.CPU) is decoder


def test_missing_dependency_returns_model_unchanged(monkeypatch):
    """Without the interpreter, Triton cannot run on CPU: every built-in CPU kernel leaves the model alone."""
    no_interpreter(monkeypatch)
    model = tiny_model("llama", torch.float32)
    before = model.config._attn_implementation
    out = apply_available_kernels(model)
    assert out is model and tnn.report(model) == []
    assert model.config._attn_implementation == before
    assert all("forward" not in vars(m) for m in model.modules())
