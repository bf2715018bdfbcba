"""Helper for the .mlir tests (not a test): compile a TTIR file for a target, print the result.

usage: compile_ir.py FILE TARGET [num_stages]  with TARGET one of cuda, iluvatar, hip, ascend
"""

import os
import shutil
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

TARGETS = {
    "cuda": GPUTarget("cuda", 90, 32),
    "iluvatar": GPUTarget("iluvatar", 90, 32),
    "hip": GPUTarget("hip", "gfx942", 64),
    "ascend": GPUTarget("ascend", "Ascend910B3", 0),
}

path, target = sys.argv[1], sys.argv[2]
options = {"num_stages": int(sys.argv[3])} if len(sys.argv) > 3 else {}
with tempfile.TemporaryDirectory() as tmp:  # Triton picks the first stage from the file extension
    ttir = os.path.join(tmp, os.path.splitext(os.path.basename(path))[0] + ".ttir")
    shutil.copy(path, ttir)
    k = triton.compile(ttir, target=TARGETS[target], options=options)
print(f"// {target} num_stages={k.metadata.num_stages}")
print(k.asm.get("ttgir", k.asm["ttir"]))
