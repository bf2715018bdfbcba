"""Runs the lit + FileCheck IR suite (tests/lit) under pytest, with this interpreter as %python."""

import os
import subprocess
import sys

import pytest

LIT_DIR = os.path.join(os.path.dirname(__file__), "lit")


def test_lit_suite(tmp_path):
    pytest.importorskip("lit", reason="the lit IR tests need `pip install lit`")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # lit.cfg drops it too
    env["TRITONSPEC_LIT_OUT"] = str(tmp_path)
    code = "import sys; from lit.main import main; sys.argv = ['lit', '-v', %r]; main()" % LIT_DIR
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert "Failed" not in proc.stdout and "Passed: " in proc.stdout, proc.stdout[-2000:]
