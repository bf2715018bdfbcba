"""Offline (compiled, not interpreted) checks from a test session that interprets.

The test session sets TRITON_INTERPRET=1 before triton.language is imported, which turns tl's own
``@jit`` helpers (tl.sum, tl.zeros, ...) into interpreted functions that cannot be compiled. Compile
checks therefore run in a subprocess without it and report a JSON dict back on one line.
"""

import json
import os
import subprocess
import sys

_TAG = "RESULTS "


def run_checks(checks: dict) -> None:
    """Called in the subprocess: run each ``name -> fn()`` and hand back "ok" or its traceback."""
    import traceback

    results = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
    print(_TAG + json.dumps(results))


def run_without_interpreter(module: str, function: str, timeout: int = 900) -> dict:
    """Run ``tests/<module>.py``'s ``function()`` in a fresh process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import {module} as m; m.{function}()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_TAG)]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len(_TAG) :])
