"""lit configuration: IR tests that compile kernels offline and FileCheck what each backend emits.

``%python`` is the interpreter running lit (the venv's, via tests/test_lit.py); ``FileCheck`` is
the binary shipped in the triton wheel. Kernels compile for real here, so TRITON_INTERPRET is
never passed through.
"""

import importlib.util
import os
import sys
import tempfile

import lit.formats

config.name = "tritonspec"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".py", ".mlir"]
config.excludes = ["lit.cfg.py", "compile_ir.py"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.environ.get("TRITONSPEC_LIT_OUT") or os.path.join(
    tempfile.gettempdir(), f"tritonspec-lit-{os.getuid()}"
)

_triton_dir = importlib.util.find_spec("triton").submodule_search_locations[0]  # without importing triton
_filecheck = os.path.join(_triton_dir, "FileCheck")
if not os.access(_filecheck, os.X_OK):
    lit_config.fatal(f"no FileCheck binary in the triton wheel at {_filecheck}")

config.substitutions.append(("%python", sys.executable))
config.substitutions.append(("FileCheck", _filecheck))

for var in ("PATH", "HOME", "TMPDIR", "TRITONSPEC_ALLOWED_BACKENDS", "TRITON_CACHE_DIR"):
    if var in os.environ:
        config.environment[var] = os.environ[var]
config.environment["TRITON_DEFAULT_FP_FUSION"] = "1"
# IR comparisons must see fresh compiles: a cached kernel from another checkout carries its file paths.
config.environment["TRITON_ALWAYS_COMPILE"] = "1"
config.environment["PYTHONDONTWRITEBYTECODE"] = "1"
