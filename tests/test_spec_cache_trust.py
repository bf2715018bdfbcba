"""The compile cache never serves a stale binary: a spec's fingerprint covers whatever can change what it
emits, or the spec is not cached across processes (and ``tritonspec check`` says why).

Each end-to-end case is a spec package whose ``tl.exp`` doubles its input through a helper that the
spec reaches in a way the module globals do not show. Two processes share one TRITON_CACHE_DIR and
compile the same kernel for cuda sm90: the first with the helper adding (x + x), then the helper is
edited to multiply (x * x), and the second must emit the multiplication, never the first one's binary.
"""

import importlib
import json
import os
import subprocess
import sys
import types

import pytest
from helpers import compile_for
import triton.language as tl

import tritonspec
from tritonspec.specialization import check, fingerprint

EXP = "from triton.language import core\n"
SPEC_TAIL = "math_ext_base_func_list = ['exp']\n__all__ = ['math_ext_base_func_list']\n"
HELPER = "def combine(x, semantic):\n    return semantic.add(x, x, True)\n"

# case -> (files of the spec site, whether the fingerprint can follow it). Each spec is package spec_<case>.
CASES = {
    # importlib.import_module with a name computed when the builtin runs: nothing to follow
    "computed_import": (
        {
            "spec_computed_import/__init__.py": EXP + "import importlib\n_PREFIX = 'helper_'\n"
            "@core.builtin\ndef exp(x, _semantic=None):\n"
            "    return importlib.import_module(_PREFIX + 'computed_import').combine(x, _semantic)\n" + SPEC_TAIL,
            "helper_computed_import.py": HELPER,
        },
        False,
    ),
    # importlib.import_module with a constant name, not imported before the first compile
    "constant_import": (
        {
            "spec_constant_import/__init__.py": EXP + "import importlib\nHELPER = 'helper_constant_import'\n"
            "@core.builtin\ndef exp(x, _semantic=None):\n"
            "    return importlib.import_module(HELPER).combine(x, _semantic)\n" + SPEC_TAIL,
            "helper_constant_import.py": HELPER,
        },
        True,
    ),
    # getattr(sys.modules[...], name)
    "sys_modules": (
        {
            "spec_sys_modules/__init__.py": EXP + "import sys\nimport helper_sys_modules  # noqa: F401\n"
            "@core.builtin\ndef exp(x, _semantic=None):\n"
            "    return getattr(sys.modules['helper_sys_modules'], 'combine')(x, _semantic)\n" + SPEC_TAIL,
            "helper_sys_modules.py": HELPER,
        },
        True,
    ),
    # a class of a module that has no file (built from source read at import time)
    "fileless_class": (
        {
            "spec_fileless_class/__init__.py": EXP + "import os, types\n"
            "_helpers = types.ModuleType('helper_fileless_class')\n"
            "_source = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fileless.txt')\n"
            "with open(_source) as f:\n    exec(compile(f.read(), '<helper_fileless_class>', 'exec'), vars(_helpers))\n"
            "Combine = _helpers.Combine\n"
            "@core.builtin\ndef exp(x, _semantic=None):\n    return Combine.apply(x, _semantic)\n" + SPEC_TAIL,
            "fileless.txt": "class Combine:\n    @staticmethod\n    def apply(x, semantic):\n"
            "        return semantic.add(x, x, True)\n",
        },
        True,
    ),
    # a JSON data file of its own package, read when the builtin runs
    "data_file": (
        {
            "spec_data_file/__init__.py": EXP + "import json, os\n_HERE = os.path.dirname(os.path.abspath(__file__))\n"
            "@core.builtin\ndef exp(x, _semantic=None):\n"
            "    with open(os.path.join(_HERE, 'op.json')) as f:\n        op = json.load(f)['op']\n"
            "    return getattr(_semantic, op)(x, x, True)\n" + SPEC_TAIL,
            "spec_data_file/op.json": '{"op": "add"}\n',
        },
        True,
    ),
}
EDITED = {
    "computed_import": "helper_computed_import.py",
    "constant_import": "helper_constant_import.py",
    "sys_modules": "helper_sys_modules.py",
    "fileless_class": "fileless.txt",
    "data_file": "spec_data_file/op.json",
}

COMPILE_ALL = """
import importlib, json, sys
sys.path.insert(0, {site!r}); sys.path.insert(0, {testdir!r})
import tritonspec
from test_spec_cache_trust import compile_exp
out = {{}}
for case in {cases!r}:
    tritonspec.register_spec(case, importlib.import_module("spec_" + case))
    with tritonspec.use_backend(case):
        k = compile_exp()
    d = tritonspec.PROVIDERS.get(case).digest
    out[case] = {{"ttir": k.asm["ttir"], "hash": k.hash, "fingerprint": d.value, "cacheable": d.cacheable,
                 "reason": d.reason}}
print("RESULT " + json.dumps(out))
"""


def exp_kernel(x_ptr, y_ptr):
    tl.store(y_ptr, tl.exp(tl.load(x_ptr)))


def compile_exp():
    """``exp_kernel`` compiled for cuda sm90, as the scripts here do, each in a process of its own."""
    return compile_for(exp_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"})


def _write(site, files: dict) -> None:
    for name, text in files.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _edit(path, old, new):
    path.write_text(path.read_text().replace(old, new))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later mtime even on coarse clocks


def _compile_all(site, cache) -> dict:
    code = COMPILE_ALL.format(site=str(site), testdir=os.path.dirname(__file__), cases=list(CASES))
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), TRITON_INTERPRET="0")
    env.pop("TRITON_ALWAYS_COMPILE", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def before_and_after(tmp_path_factory):
    """Every case compiled in a first process with its helper adding, then in a second one sharing the
    cache dir after the helper was edited to multiply."""
    root = tmp_path_factory.mktemp("stale")
    site = root / "site"
    for files, _ in CASES.values():
        _write(site, files)
    before = _compile_all(site, root / "cache")
    for name in EDITED.values():
        _edit(site / name, "add", "mul")
    after = _compile_all(site, root / "cache")
    return before, after


@pytest.mark.parametrize("case", list(CASES))
def test_an_edited_helper_never_reuses_the_old_binary(before_and_after, case):
    before, after = (run[case] for run in before_and_after)
    assert "arith.addf" in before["ttir"] and "arith.mulf" not in before["ttir"], before["ttir"]
    assert "arith.mulf" in after["ttir"] and "arith.addf" not in after["ttir"], (case, after)
    assert before["hash"] != after["hash"]
    followed = CASES[case][1]
    assert before["cacheable"] is after["cacheable"] is followed, (case, before["reason"])
    if followed:
        assert before["fingerprint"] != after["fingerprint"]
    else:
        assert "importlib.import_module() with a module name computed at run time" in before["reason"], before


# -- what the fingerprint follows, in this process -------------------------------------------------------


def _digest(module, **exposed):
    return fingerprint.digest("fp", module, exposed or {n: getattr(module, n) for n in module.__all__})


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory of spec modules on sys.path; they leave sys.modules again afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_an_import_in_the_functions_body_is_followed(site):
    """``from helper import combine`` when the hook runs: the helper's file, imported or not yet."""
    _write(
        site,
        {
            "spec_lazy.py": "def num_stages_cap():\n    from helper_lazy import combine\n"
            "    return combine()\n__all__ = ['num_stages_cap']\n",
            "helper_lazy.py": "def combine():\n    return 2\n",
        },
    )
    spec = importlib.import_module("spec_lazy")
    first = _digest(spec)
    _edit(site / "helper_lazy.py", "2", "3")
    assert first.cacheable and _digest(spec).value != first.value
    importlib.import_module("helper_lazy")  # imported now: combine's own code is followed too
    imported = _digest(spec)
    _edit(site / "helper_lazy.py", "3", "4")
    assert imported.cacheable and _digest(spec).value != imported.value


def test_a_helper_reached_as_an_attribute_of_a_module_is_followed(site):
    """``helpers.combine()``: combine's own helper in a third file changes the digest."""
    _write(
        site,
        {
            "spec_attr.py": "import helpers_attr\ndef num_stages_cap():\n    return helpers_attr.combine()\n"
            "__all__ = ['num_stages_cap']\n",
            "helpers_attr.py": "from deeper_attr import value\ndef combine():\n    return value()\n",
            "deeper_attr.py": "def value():\n    return 2\n",
        },
    )
    spec = importlib.import_module("spec_attr")
    first = _digest(spec)
    _edit(site / "deeper_attr.py", "2", "3")
    assert first.cacheable and _digest(spec).value != first.value


@pytest.mark.parametrize(
    "body,why",
    [
        ("return getattr(sys.modules[NAME + '_x'], 'cap')()", "looks a module up in sys.modules by a name computed"),
        ("return importlib.import_module(name)", "importlib.import_module() with a module name computed at run time"),
        ("return __import__(name).cap", "__import__() with a module name computed at run time"),
        (
            "return importlib.util.spec_from_file_location('x', name)",
            "spec_from_file_location(), which loads a module from a path",
        ),
    ],
)
def test_a_module_looked_up_by_a_computed_name_is_not_cacheable(body, why):
    module = types.ModuleType("dyn_spec")
    exec(
        f"import importlib, importlib.util, sys\nNAME = 'x'\ndef num_stages_cap(name='m'):\n    {body}\n", vars(module)
    )
    d = _digest(module, num_stages_cap=module.num_stages_cap)
    assert not d.cacheable and d.value.startswith("nonce-") and why in d.reason, d.reason
    assert "dyn_spec.num_stages_cap" in d.reason


def test_reading_files_is_cached_only_inside_the_specs_package(site):
    """A package's own data files are hashed; a file elsewhere (or a top-level module's neighbour) is not."""
    reader = (
        "import json, os\n_HERE = os.path.dirname(os.path.abspath(__file__))\n"
        "def num_stages_cap():\n    with open(os.path.join(_HERE, {path!r})) as f:\n"
        "        return json.load(f)['cap']\n__all__ = ['num_stages_cap']\n"
    )
    _write(
        site,
        {
            "pkg_reads/__init__.py": reader.format(path="cap.json"),
            "pkg_reads/cap.json": '{"cap": 2}',
            "pkg_escapes/__init__.py": reader.format(path="../cap.json"),
            "cap.json": '{"cap": 2}',
            "top_reads.py": reader.format(path="cap.json"),
        },
    )
    own = importlib.import_module("pkg_reads")
    first = _digest(own)
    _edit(site / "pkg_reads" / "cap.json", "2", "3")
    assert first.cacheable and _digest(own).value != first.value
    for name in ("pkg_escapes", "top_reads"):
        d = _digest(importlib.import_module(name))
        assert not d.cacheable and "reads files (open()) outside the spec's package" in d.reason, (name, d)
    path_reader = types.ModuleType("path_spec")
    exec(
        "from pathlib import Path\ndef num_stages_cap():\n    return int(Path('/etc/cap').read_text())\n",
        vars(path_reader),
    )
    d = _digest(path_reader, num_stages_cap=path_reader.num_stages_cap)
    assert not d.cacheable and "reads files (.read_text())" in d.reason, d.reason


def test_package_files_are_bounded(site, monkeypatch):
    _write(
        site,
        {
            "pkg_big/__init__.py": "num_stages_cap = 2\n__all__ = ['num_stages_cap']\n",
            **{f"pkg_big/data/{i}.bin": "x" for i in range(5)},
            "pkg_big/__pycache__/stale.pyc": "ignored",
            "pkg_big/.git/HEAD": "ignored",
        },
    )
    big = importlib.import_module("pkg_big")
    first = _digest(big)
    (site / "pkg_big" / "__pycache__" / "stale.pyc").write_text("changed")
    (site / "pkg_big" / ".git" / "HEAD").write_text("changed")
    assert first.cacheable and _digest(big).value == first.value
    (site / "pkg_big" / "data" / "new.bin").write_text("y")  # a new data file changes it
    assert _digest(big).value != first.value
    monkeypatch.setattr(fingerprint, "_PACKAGE_FILES", 3)
    d = _digest(big)
    assert not d.cacheable and "holds more than 3 files to hash" in d.reason, d.reason


def test_a_class_without_a_file_counts_by_its_methods():
    def runtime_class(op):
        module = types.ModuleType("runtime_helpers")
        exec(f"class Combine:\n    def apply(self, x):\n        return x {op} x\n", vars(module))
        return module.Combine

    def spec(cls):
        return _digest(types.ModuleType("cls_spec"), num_stages_cap=lambda: cls)

    assert spec(runtime_class("+")).value == spec(runtime_class("+")).value
    assert spec(runtime_class("+")).value != spec(runtime_class("*")).value
    assert spec(runtime_class("+")).cacheable


def test_a_class_built_from_source_elsewhere_counts_by_its_methods(site):
    """Its module has a file, but the class's code came from ``exec`` of another file's text."""
    _write(
        site,
        {
            "spec_exec.py": "import os\n_src = os.path.join(os.path.dirname(__file__), 'combine.txt')\n"
            "exec(compile(open(_src).read(), '<combine>', 'exec'))\n"
            "def num_stages_cap():\n    return Combine.cap()\n__all__ = ['num_stages_cap']\n",
            "combine.txt": "class Combine:\n    @staticmethod\n    def cap():\n        return 2\n",
        },
    )
    spec = importlib.import_module("spec_exec")
    first = _digest(spec)
    _edit(site / "combine.txt", "2", "3")
    del sys.modules["spec_exec"]
    assert first.cacheable and _digest(importlib.import_module("spec_exec")).value != first.value


def test_check_says_which_spec_is_not_cached_and_why(registry):
    module = types.ModuleType("uncached_spec")
    exec(
        "import importlib\ndef num_stages_cap(name='caps'):\n    return importlib.import_module(name).CAP\n",
        vars(module),
    )
    module.__all__ = ["num_stages_cap"]
    tritonspec.register_spec("uncached", module)
    _, rows, _ = check.provider_rows()
    row = next(r for r in rows if r[0] == "uncached")
    assert row[-1].startswith(
        "not cached across processes: uncached_spec.num_stages_cap calls "
        "importlib.import_module() with a module name computed at run time"
    ), row
    assert all(r[-1] == "shared" for r in rows if r[0] in ("cpu", "nvidia", "amd", "ascend", "iluvatar")), rows


def test_our_own_backends_stay_cacheable():
    providers = tritonspec.PROVIDERS.providers()
    assert {"cpu", "nvidia", "amd", "ascend", "iluvatar"} <= set(providers)
    for name, provider in providers.items():
        assert provider.digest.cacheable, (name, provider.digest.reason)
