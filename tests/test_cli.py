"""The ``tritonspec`` command line as a user meets it: plain help text, check's options, output that fits in
100 columns, and a disabled layer said plainly (exit 1, no traceback).

The commands run in subprocesses, as ``python -m tritonspec.cli`` (what the ``tritonspec`` script runs), with
``TRITON_INTERPRET`` unset as in a user's shell: check starts its own interpreter subprocess.
"""

import os
import subprocess
import sys

import pytest

from tritonspec.text_tables import WIDTH, parse_tables, table

TITLES = ("Spec providers", "Hook points", "Install points", "Kernels", "Launch configs", "Sample kernels")


def _run(*args, timeout=600, **env):
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION") and not k.startswith("TRITONSPEC_")
    }
    return subprocess.run(
        [sys.executable, "-m", "tritonspec.cli", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _fits(text: str) -> None:
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} lines wider than {WIDTH} columns, the widest {max(map(len, wide))}:\n" + "\n".join(
        wide[:5]
    )


@pytest.fixture(scope="module")
def check_output():
    proc = _run("check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_check_fits_in_100_columns(check_output):
    _fits(check_output)
    assert "all checks passed" in check_output
    tables = parse_tables(check_output)
    assert set(TITLES) <= set(tables), sorted(tables)
    # what the tables say survives the wrapping: read back, cells are whole again
    providers = {row[0]: row for row in tables["Spec providers"]}
    assert {"cpu", "nvidia", "amd", "ascend", "iluvatar"} <= set(providers)
    assert providers["ascend"][3].endswith("(--verbose)"), providers["ascend"]  # summarised, not 300 columns
    points = {row[0]: row for row in tables["Install points"]}
    assert points["compiler.compile"][2].startswith("triton.compile: target spec"), points["compiler.compile"]
    samples = {row[0]: row for row in tables["Sample kernels"]}
    assert samples["cpu"][1:] == ["interpreter", "ok"], samples["cpu"]
    assert samples["ascend"][2] == "ok (source,ttir); npubin: not built (bishengir-compile not on PATH)"


def test_check_verbose_names_everything_and_still_fits():
    proc = _run("check", "--verbose", "--no-interpreter")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _fits(proc.stdout)
    tables = parse_tables(proc.stdout)
    functions = {(row[0], row[1]): row[2] for row in tables["Spec functions"]}
    assert functions[("ascend", "core_ext_spec_func_list")] == "insert_slice, extract_slice, get_element"
    assert "arange_disable_check_power_of_two" in functions[("ascend", "hooks")]
    samples = tables["Sample kernels"]
    assert {row[2] for row in samples} == {"scale_add", "row_sum", "dot", "histogram"}
    assert not any(row[0] == "cpu" for row in samples), "--no-interpreter still ran the interpreter"
    assert "not run in the interpreter" in proc.stdout


def test_disabled_layer_is_a_message_not_a_traceback():
    proc = _run("check", timeout=120, TRITONSPEC_DISABLE="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "hooks are disabled (TRITONSPEC_DISABLE='1'): nothing to check" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_help_is_plain_text_and_lists_checks_options():
    top = _run("--help", timeout=120)
    assert top.returncode == 0 and "check" in top.stdout, top.stderr
    check = _run("check", "--help", timeout=120)
    assert check.returncode == 0, check.stderr
    for text in (top.stdout, check.stdout):
        assert "``" not in text and ":func:" not in text and ":mod:" not in text, text
        _fits(text)
    assert "--verbose" in check.stdout and "--no-interpreter" in check.stdout, check.stdout


def test_table_wraps_long_cells_in_their_column_and_reads_back():
    name = "tritonspec_backends.cpu.backend.spec.a_module_name"  # too long for its column: broken after a dot
    rows = [["a", "short", "word " * 40], ["b", "x" * 12, "one"], ["c", "", name]]
    text = table(rows, ["key", "middle", "long"], width=50)
    _fits(text)
    lines = text.splitlines()
    assert all(len(line) <= 50 for line in lines) and len(lines) > 4, text
    assert lines[3].startswith(" " * 5), "a continuation line leaves the other columns blank"
    back = parse_tables("Title\n" + text)["Title"]
    assert back == [["a", "short", ("word " * 40).strip()], ["b", "x" * 12, "one"], ["c", "", name]], back
    assert any(line.endswith("cpu.") for line in lines), text
