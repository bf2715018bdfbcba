"""Test setup: CPU runs go through the Triton interpreter, which must be chosen before kernels are defined."""
import os

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
