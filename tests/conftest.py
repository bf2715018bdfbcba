"""Test setup: CPU runs go through the Triton interpreter, which must be chosen before kernels are defined.

Fixtures used by several test files live here; the plain helpers they use are in helpers.py.
"""

import os
import sys

DEVICE = os.environ.get("TRITONSPEC_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# A cache of this run's own: kernels cached by another checkout (or Triton version) would carry
# its file paths and hide compile-time behaviour from the tests.
# It is removed when the run ends: every CI run would otherwise leave one behind.
if "TRITON_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tritonspec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
# tests/gpu imports helpers (and offline, test_one_source) by name whatever pytest's import mode.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cuda":
        return
    skip = pytest.mark.skip(reason="GPU test: set TRITONSPEC_TEST_DEVICE=cuda on a CUDA machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def registry():
    """Register test specs freely; the real providers and the default selection come back afterwards."""
    import tritonspec
    from tritonspec import PROVIDERS

    saved = dict(PROVIDERS._registered), dict(PROVIDERS._loaded)
    default = tritonspec.default_backend()
    yield PROVIDERS
    tritonspec.set_default_backend(default)
    for mine, kept in zip((PROVIDERS._registered, PROVIDERS._loaded), saved):
        mine.clear()
        mine.update(kept)
    PROVIDERS._changed()


@pytest.fixture
def gen():
    """A torch.Generator seeded with this run's seed (printed: see helpers.SEED)."""
    from helpers import generator

    return generator()


@pytest.fixture
def spy(monkeypatch):
    """Count calls of the ops the hub layers, tritonspec.nn.RMSNorm, the attention, the experts and the routers use
    (``add_rms_norm``: the fused decoder layers)."""
    import importlib
    from tritonspec.nn.hub import layers as hub_layers

    counts = {}

    def wrap(modname, fn_name, *also):
        mod = importlib.import_module(modname)
        orig = getattr(mod, fn_name)

        def counted(*a, **k):
            counts[fn_name] = counts.get(fn_name, 0) + 1
            return orig(*a, **k)

        monkeypatch.setattr(mod, fn_name, counted)
        for other in also:
            monkeypatch.setattr(importlib.import_module(other), fn_name, counted)

    wrap("tritonspec.ops.rms_norm", "rms_norm", "tritonspec.nn.modules")
    wrap("tritonspec.ops.rms_norm", "add_rms_norm")
    wrap("tritonspec.ops.swiglu", "swiglu", "tritonspec.nn.modules")
    wrap("tritonspec.ops.rope", "rope")
    wrap("tritonspec.ops.attention", "attention")
    wrap("tritonspec.ops.attention_decode", "attention_decode")
    wrap("tritonspec.ops.moe", "moe_experts")
    wrap("tritonspec.ops.moe_routing", "moe_route")
    monkeypatch.setattr(hub_layers, "_IMPORTED", {})
    return counts
