"""kernelize front end (Hugging Face kernels style): modes, devices, mappings, layer validation, repositories."""

import json
import logging
import sys
import time

import pytest
import torch
from torch import nn

import tritonspec.nn as tnn
from tritonspec.nn import (
    CUDAProperties,
    Device,
    HubUnavailableError,
    LayerRepository,
    LocalLayerRepository,
    Mode,
    kernelize,
    register_kernel_mapping,
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
)
from tritonspec.nn import kernelizer as kz

CALLS = []  # which replacement forward ran (pure layers may not keep state of their own)


@use_kernel_forward_from_hub("ToyNorm")
class ToyNorm(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dtype=torch.float64))
        self.eps = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _layer(tag, *, has_backward=True, can_torch_compile=False):
    """A pure layer computing ToyNorm's function and recording ``tag`` in CALLS."""

    def forward(self, x):
        CALLS.append(tag)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    return type(
        f"Layer_{tag}",
        (nn.Module,),
        {"forward": forward, "has_backward": has_backward, "can_torch_compile": can_torch_compile},
    )


class Repo:
    """A repository that hands out an in-memory layer (the protocol is just ``load()``)."""

    def __init__(self, layer):
        self.layer = layer

    def load(self):
        return self.layer

    def __str__(self):
        return f"Repo({self.layer.__name__})"


@pytest.fixture(autouse=True)
def scoped_mapping():
    CALLS.clear()
    with use_kernel_mapping({}):  # every test's registrations vanish with the context
        yield


def _run(model, x):
    CALLS.clear()
    return model(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(ToyNorm(), nn.Sequential(ToyNorm()))


# ------------------------------------------------------------------------------------------------ modes
def test_mode_combinations():
    assert Mode.TRAINING | Mode.TORCH_COMPILE in kz.MODE_FALLBACK_PRIORITY
    with pytest.raises(ValueError, match="mutually exclusive"):
        Mode.INFERENCE | Mode.TRAINING
    with pytest.raises(ValueError, match="FALLBACK cannot be combined"):
        Mode.FALLBACK | Mode.TRAINING


@pytest.mark.parametrize(
    "mode, match",
    [
        (Mode.FALLBACK, "only be used in kernel mappings"),
        (Mode.TORCH_COMPILE, "must contain Mode.INFERENCE or Mode.TRAINING"),
        ("training", "expected a tritonspec.nn.Mode"),
    ],
)
def test_kernelize_rejects_bad_modes(mode, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kernelize(_model(), mode=mode)


I, T, C, F = Mode.INFERENCE, Mode.TRAINING, Mode.TORCH_COMPILE, Mode.FALLBACK
# huggingface/kernels documents this order ("The kernelize function will attempt to use the following
# registered kernels").
DOCUMENTED = {I: [I, I | C, T, T | C, F], I | C: [I | C, T | C, F], T: [T, T | C, F], T | C: [T | C, F]}
ALL_MODES = [I, I | C, T, T | C, F]


@pytest.mark.parametrize("mode", list(DOCUMENTED), ids=str)
@pytest.mark.parametrize("drop", range(5))
def test_mode_fallback_priority_matches_seed(mode, drop):
    """Register a compile-capable, backward-capable layer for every mode but the first `drop` of the
    documented order; kernelize must pick the first remaining one of that order."""
    registered = {m: _layer(f"m{ALL_MODES.index(m)}", can_torch_compile=True) for m in ALL_MODES}
    for m in DOCUMENTED[mode][:drop]:
        registered.pop(m)
    expected = next((m for m in DOCUMENTED[mode] if m in registered), None)
    model = _model()
    with use_kernel_mapping({"ToyNorm": {"cpu": {m: Repo(layer) for m, layer in registered.items()}}}):
        kernelize(model, mode=mode, device="cpu")
    x = torch.randn(2, 4, dtype=torch.float64)
    _run(model, x)
    if expected is None:
        assert CALLS == []
    else:
        assert CALLS == [f"m{ALL_MODES.index(expected)}"] * 2


def test_seed_example_compile_modes_use_fallback():
    mapping = {
        "ToyNorm": {
            "cpu": {
                F: Repo(_layer("fallback", can_torch_compile=True)),
                I: Repo(_layer("inference")),
                T: Repo(_layer("training")),
            }
        }
    }
    x = torch.randn(3, 4, dtype=torch.float64)
    with use_kernel_mapping(mapping):
        for mode in (I | C, T | C):
            model = kernelize(_model(), mode=mode, device="cpu")
            _run(model, x)
            assert CALLS == ["fallback", "fallback"]


# ------------------------------------------------------------------------------------------------ devices
@pytest.mark.parametrize(
    "cap, expected", [(86, "sm80_89"), (75, "sm75_89"), (89, "sm80_89"), (90, "sm90_up"), (70, None)]
)
def test_narrowest_capability_interval_wins(monkeypatch, cap, expected):
    monkeypatch.setattr(kz, "_capability", lambda: cap)
    mapping = {
        "ToyNorm": {
            Device(type="cuda", properties=CUDAProperties(min_capability=75, max_capability=89)): Repo(
                _layer("sm75_89")
            ),
            Device(type="cuda", properties=CUDAProperties(min_capability=80, max_capability=89)): Repo(
                _layer("sm80_89")
            ),
            Device(type="cuda", properties=CUDAProperties(min_capability=90, max_capability=sys.maxsize)): Repo(
                _layer("sm90_up")
            ),
        }
    }
    with use_kernel_mapping(mapping):
        model = kernelize(_model(), mode=Mode.INFERENCE, device="cuda")  # pure-Python layers run on CPU tensors
        _run(model, torch.randn(2, 4, dtype=torch.float64))
        assert CALLS == ([expected] * 2 if expected else [])
        if expected is None:
            with pytest.raises(ValueError, match="with capability 70"):
                kernelize(_model(), mode=Mode.INFERENCE, device="cuda", use_fallback=False)


def test_same_interval_replaces_previous_registration(monkeypatch):
    monkeypatch.setattr(kz, "_capability", lambda: 80)
    dev = Device(type="cuda", properties=CUDAProperties(min_capability=80, max_capability=89))
    register_kernel_mapping({"ToyNorm": {dev: Repo(_layer("old"))}})
    register_kernel_mapping({"ToyNorm": {dev: Repo(_layer("new"))}})
    assert len(kz.mapping_snapshot()["ToyNorm"]["cuda"]) == 1
    model = kernelize(_model(), mode=Mode.INFERENCE, device="cuda")
    _run(model, torch.randn(1, 4, dtype=torch.float64))
    assert CALLS == ["new", "new"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Device(type="quantum"), "unsupported device type 'quantum'"),
        (lambda: CUDAProperties(min_capability=90, max_capability=80), "min_capability .90. must be <="),
        (lambda: CUDAProperties(min_capability="80", max_capability=90), "min_capability: expected a non-negative int"),
        (lambda: Device(type="cpu", properties=CUDAProperties(80, 90)), "CUDAProperties is only supported for 'cuda'"),
        (lambda: kernelize(_model(), mode=Mode.INFERENCE, device="tpu9"), "unsupported device type 'tpu9'"),
        (lambda: kernelize(nn.ReLU(), mode=Mode.INFERENCE), "device: cannot infer the device"),
        (lambda: register_kernel_mapping({"ToyNorm": {"cpu": object()}}), r"has no load\(\)"),
        (lambda: register_kernel_mapping({"ToyNorm": {"cpu": {"training": Repo(ToyNorm)}}}), "not a valid mode"),
    ],
)
def test_bad_arguments_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


# ------------------------------------------------------------------------------------------------ mappings
def test_use_kernel_mapping_scopes_and_inherits():
    outer = kz.mapping_snapshot()
    assert {"RMSNorm", "SwiGLUMLP", "rotary_pos_emb"} <= set(outer)  # tritonspec's defaults
    with use_kernel_mapping({"ToyNorm": {"cpu": Repo(_layer("a"))}}):
        assert {"ToyNorm", "RMSNorm"} <= set(kz.mapping_snapshot())
        with use_kernel_mapping({"ToyNorm": {"cpu": Repo(_layer("b"))}}, inherit_mapping=False):
            assert set(kz.mapping_snapshot()) == {"ToyNorm"}
        assert "RMSNorm" in kz.mapping_snapshot()
    assert kz.mapping_snapshot().keys() == outer.keys()


def test_register_without_inherit_drops_defaults():
    register_kernel_mapping({"ToyNorm": {"cpu": Repo(_layer("a"))}}, inherit_mapping=False)
    assert set(kz.mapping_snapshot()) == {"ToyNorm"}


# ------------------------------------------------------------------------------------------------ layers
def test_replace_and_revert_with_logging_and_report(caplog):
    model = _model()
    x = torch.randn(2, 4, dtype=torch.float64)
    ref = model(x)
    with use_kernel_mapping({"ToyNorm": {"cpu": Repo(_layer("fast"))}}):
        with caplog.at_level(logging.INFO, logger="tritonspec.nn.kernelize"):
            assert kernelize(model, mode=Mode.TRAINING) is model
    assert "kernelize: 0 (ToyNorm) -> " in caplog.text and "kernelize: 1.0 (ToyNorm) -> " in caplog.text
    out = _run(model, x)
    assert CALLS == ["fast", "fast"]
    torch.testing.assert_close(out, ref)
    rep = tnn.report(model)
    assert rep.paths() == ["0", "1.0"] and all(c.source == "kernelize" for c in rep)
    tnn.revert(model)
    _run(model, x)
    assert CALLS == []


def test_no_backward_falls_back_in_training_and_raises_without_fallback():
    x = torch.randn(2, 4, dtype=torch.float64)
    with use_kernel_mapping({"ToyNorm": {"cpu": Repo(_layer("nobwd", has_backward=False))}}):
        model = kernelize(_model(), mode=Mode.INFERENCE)
        _run(model, x)
        assert CALLS == ["nobwd", "nobwd"]
        kernelize(model, mode=Mode.TRAINING)  # re-kernelize: the original forward comes back
        _run(model, x)
        assert CALLS == [] and tnn.report(model) == []
        with pytest.raises(ValueError, match="does not support backward"):
            kernelize(_model(), mode=Mode.TRAINING, use_fallback=False)
    with use_kernel_mapping({"ToyNorm": {"cpu": {Mode.TRAINING: Repo(_layer("liar", has_backward=False))}}}):
        with pytest.raises(ValueError, match="registered for `ToyNorm` in mode Mode.TRAINING but has no backward"):
            kernelize(_model(), mode=Mode.TRAINING)


def test_missing_mapping_falls_back_or_raises():
    model = kernelize(_model(), mode=Mode.INFERENCE)
    assert tnn.report(model) == []
    with pytest.raises(ValueError, match="no kernel mapping for layer `ToyNorm`"):
        kernelize(_model(), mode=Mode.INFERENCE, use_fallback=False)
    with use_kernel_mapping({"ToyNorm": {"cuda": Repo(_layer("gpu"))}}):
        with pytest.raises(ValueError, match="on device type `cpu`"):
            kernelize(_model(), mode=Mode.INFERENCE, use_fallback=False)


class _WithInit(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x


class _WithHelper(nn.Module):
    def helper(self):
        return 1

    def forward(self, x):
        return x


class _WithClassVar(nn.Module):
    scale = 2.0

    def forward(self, x):
        return x


class _WithExtraArg(nn.Module):
    def forward(self, x, y):
        return x


class _KeywordOnly(nn.Module):
    def forward(self, *, x):
        return x


@pytest.mark.parametrize(
    "layer, match",
    [
        (_WithInit, "must not define __init__"),
        (_WithHelper, r"members \['helper'\]"),
        (_WithClassVar, r"members \['scale'\]"),
        (_WithExtraArg, "takes 3 parameters, `ToyNorm` takes 2"),
        (_KeywordOnly, "parameter 'x' is keyword-only"),
        (int, "not a torch.nn.Module subclass"),
    ],
)
def test_impure_layers_are_rejected(layer, match):
    with use_kernel_mapping({"ToyNorm": {"cpu": Repo(layer)}}):
        with pytest.raises(TypeError, match=match):
            kernelize(_model(), mode=Mode.INFERENCE)


def test_kernel_condition_and_external_class():
    class External(nn.Module):
        def __init__(self, big):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, dtype=torch.float64))
            self.eps, self.big = 1e-6, big

        def forward(self, x):
            return x

    replace_kernel_forward_from_hub(External, "ToyNorm", condition=lambda m: m.big)
    model = nn.Sequential(External(True), External(False))
    with use_kernel_mapping({"ToyNorm": {"cpu": Repo(_layer("ext"))}}):
        kernelize(model, mode=Mode.INFERENCE)
    assert tnn.report(model).paths() == ["0"]
    with pytest.raises(TypeError, match="cls: expected a class"):
        replace_kernel_forward_from_hub(External(True), "ToyNorm")


def test_decorated_function_becomes_named_module():
    @use_kernel_forward_from_hub("toy_add")
    def add(a, b, alpha=1):
        return a + alpha * b

    assert add(2, 3) == 5 and add.kernel_layer_name == "toy_add"
    with pytest.raises(TypeError, match="applies to classes or functions"):
        use_kernel_forward_from_hub("x")(3)


# ------------------------------------------------------------------------------------------------ repositories
def _write_repo(root, variants, *, layer_src=None, package="toy_kernels", metadata=False):
    layer_src = layer_src or (
        "import torch\nfrom torch import nn\nfrom .helpers import rms\n\n"
        "class ToyNorm(nn.Module):\n    has_backward = True\n\n"
        "    def forward(self, x):\n        return rms(x, self.eps) * self.weight\n"
    )
    for v in variants:
        pkg = root / "build" / v / package
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("from . import layers\n")
        (pkg / "layers.py").write_text(layer_src)
        (pkg / "helpers.py").write_text(
            f"VARIANT = {v!r}\n\ndef rms(x, eps):\n    import torch\n"
            "    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)\n"
        )
        if metadata:
            (root / "build" / v / "metadata.json").write_text(json.dumps({"name": package.replace("_", "-")}))
    return root


def test_local_repository_loads_build_variant_package(tmp_path):
    repo_dir = _write_repo(
        tmp_path / "r", ["torch-universal", "torch-cpu", "torch-cuda", "torch99-cxx11-cu999-x86_64-linux"]
    )
    repo = LocalLayerRepository(repo_path=repo_dir, package_name="toy_kernels", layer_name="ToyNorm")
    layer = repo.load()
    assert sys.modules[layer.__module__.rsplit(".", 1)[0] + ".helpers"].VARIANT == "torch-cpu"  # noarch backend wins
    model = _model()
    x = torch.randn(2, 4, dtype=torch.float64)
    ref = model(x)
    with use_kernel_mapping({"ToyNorm": {"cpu": repo}}):
        kernelize(model, mode=Mode.TRAINING)
    assert all(c.kernel.endswith("ToyNorm.forward") for c in tnn.report(model))
    torch.testing.assert_close(model(x), ref)


def test_local_repository_package_name_from_metadata_or_single_package(tmp_path):
    a = _write_repo(tmp_path / "a", ["torch-universal"], metadata=True)
    assert LocalLayerRepository(a, layer_name="ToyNorm").load().__name__ == "ToyNorm"
    b = _write_repo(tmp_path / "b", ["torch-universal"])
    assert LocalLayerRepository(b, layer_name="ToyNorm").load().__name__ == "ToyNorm"


@pytest.mark.parametrize(
    "setup, kwargs, exc, match",
    [
        (lambda p: p.mkdir(), {}, FileNotFoundError, "has no build/ directory"),
        (lambda p: _write_repo(p, ["torch-cuda"]), {}, FileNotFoundError, "torch-cuda: backend cuda does not match"),
        (lambda p: _write_repo(p, ["torch11-cxx11-cpu-x86_64-linux"]), {}, FileNotFoundError, "built for torch 1.1"),
        (lambda p: _write_repo(p, ["torch-universal"]), {"package_name": "nope"}, FileNotFoundError, "package_name"),
        (lambda p: _write_repo(p, ["torch-universal"]), {"layer_name": "Nope"}, ValueError, "layer_name: `Nope`"),
    ],
)
def test_local_repository_errors(tmp_path, setup, kwargs, exc, match):
    setup(tmp_path / "r")
    args = {"package_name": "toy_kernels", "layer_name": "ToyNorm", **kwargs}
    with pytest.raises(exc, match=match):
        LocalLayerRepository(tmp_path / "r", **args).load()


def test_hub_repository_fails_fast_offline():
    repo = LayerRepository("kernels-community/activation", layer_name="SiluAndMul", version="1")
    t0 = time.monotonic()
    with use_kernel_mapping({"ToyNorm": {"cpu": repo}}):
        with pytest.raises(HubUnavailableError, match="does not download kernels.*TRITONSPEC_LOCAL_KERNELS"):
            kernelize(_model(), mode=Mode.INFERENCE)  # loading errors raise even with use_fallback=True
    assert time.monotonic() - t0 < 5.0


def test_hub_repository_local_override(tmp_path, monkeypatch):
    _write_repo(tmp_path / "ck", ["torch-universal"])
    monkeypatch.setenv("TRITONSPEC_LOCAL_KERNELS", f"me/toy={tmp_path / 'ck'}")
    assert LayerRepository("me/toy", layer_name="ToyNorm").load().__name__ == "ToyNorm"


@pytest.mark.parametrize(
    "args, match", [(("no-slash",), "repo_id: 'no-slash'"), (("a/b",), "revision/version: give at most one")]
)
def test_hub_repository_argument_errors(args, match):
    with pytest.raises(ValueError, match=match):
        LayerRepository(*args, layer_name="X", **({"revision": "main", "version": "1"} if args == ("a/b",) else {}))
