"""The README's examples run as written: every ```python block, each in a fresh process, on CPU.

Each block runs as a script of its own (a newcomer pastes one at a time) with what the README promises it
needs and nothing more: ``TRITON_INTERPRET=1``, no network (Hugging Face offline), none of our settings, a
fresh Triton cache and an empty working directory. A block that cannot run here says so on its first line,
``# not run: <why>`` (a CUDA GPU, several nodes); those are listed, and there must stay few of them.
Also: the setup commands CI runs are the README's, and the README lists every setting.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")
MAX_NOT_RUN = 2
TIMEOUT = 300


def blocks(language: str) -> list[tuple[int, str]]:
    """(line number, text) of every fenced ``language`` block of the README."""
    found, lines = [], README.read_text().splitlines()
    start = None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == f"```{language}":
            start = number
        elif start is not None and line.strip() == "```":
            found.append((start, "\n".join(lines[start : number - 1]) + "\n"))
            start = None
    assert start is None, f"README.md:{start}: a ```{language} block is never closed"
    return found


PYTHON = blocks("python")


def _not_run(code: str) -> str | None:
    match = NOT_RUN.fullmatch(code.splitlines()[0].strip()) if code.strip() else None
    return match.group(1) if match else None


@pytest.mark.parametrize("line, code", PYTHON, ids=[f"line{line}" for line, _ in PYTHON])
def test_python_block_runs(line, code, tmp_path):
    why = _not_run(code)
    if why is not None:
        pytest.skip(f"README.md:{line} is marked not run: {why}")
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSPEC_")}
    env.update(
        TRITON_INTERPRET="1",
        TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONWARNINGS="error:tritonspec:FutureWarning",
    )  # examples use no name of ours that was renamed
    proc = subprocess.run(
        [sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, (
        f"README.md:{line}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )


def test_few_blocks_are_not_run():
    """Blocks marked ``# not run: <why>`` are the exception: listed here, with their reasons."""
    skipped = [(line, _not_run(code)) for line, code in PYTHON if _not_run(code) is not None]
    print("\n".join(f"README.md:{line}: not run: {why}" for line, why in skipped) or "every block runs")
    assert len(PYTHON) >= 5, f"only {len(PYTHON)} python blocks found: is the fence still ```python?"
    assert len(skipped) <= MAX_NOT_RUN, f"{len(skipped)} blocks are not run (at most {MAX_NOT_RUN}): {skipped}"
    for line, code in PYTHON:
        assert "not run" not in "\n".join(code.splitlines()[1:]).lower(), (
            f"README.md:{line}: a 'not run' marker must be the block's first line"
        )


def test_setup_commands_are_what_ci_runs():
    """The README's first block is the two commands CI (.ci/run) runs, word for word."""
    first = blocks("bash")[0][1].splitlines()
    assert first == [
        "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[test]' && .venv/bin/tritonspec check",
        "bash tests/run.sh",
    ], first
    ci = ROOT / ".ci" / "run"
    if ci.exists():
        commands = [line for line in ci.read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
        assert commands == first, commands


def test_every_setting_is_listed():
    """Every declared TRITONSPEC_* setting (tritonspec.settings and the vendors' own) has a row in the README's
    settings table, and every renamed one its old spelling."""
    import importlib

    import tritonspec.settings as settings

    importlib.import_module("tritonspec_backends.ascend.backend.settings")  # declares the ascend settings
    text = README.read_text()
    rows = set(re.findall(r"^\| `(TRITONSPEC_\w+)` \|", text, re.M))
    assert set(settings.ALL) <= rows, sorted(set(settings.ALL) - rows)
    for setting in settings.ALL.values():
        for old in setting.renamed_from:
            assert f"`{old}`" in text, f"{setting.name}'s former name {old} is not mentioned"
