"""The package's shape as the README describes it: the spec layer in a package of its own, no import cycle,
every setting declared once in tritonspec.settings, and the names of earlier layouts still working."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import tritonspec
from tritonspec import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "tritonspec"


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports(name: str, path: pathlib.Path, is_package: bool, modules) -> set[str]:
    """Every tritonspec module ``name`` imports, at module level or inside a function, by statement or by
    ``importlib.import_module("...")`` with a constant name."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = (
                ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module
            )
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycle_inside_tritonspec():
    modules = _modules()
    graph = {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}
    assert "tritonspec.specialization.resolve" in graph["tritonspec"]  # the graph sees imports at all
    assert "tritonspec.nn.modules" in graph["tritonspec.nn.rules"]  # ... and those inside functions
    cycles, state = [], {}

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_spec_layer_is_a_package_of_its_own():
    """Hooks, install, resolution and providers live in tritonspec.specialization; only settings, the
    kernel table, launch configs and devices (op support) sit beside it at the top."""
    layer = {p.stem for p in (PACKAGE / "specialization").glob("*.py")} - {"__init__"}
    assert {
        "hooks",
        "backend_info",
        "providers",
        "resolve",
        "inject",
        "fingerprint",
        "patches",
        "check",
        "install",
        "import_hook",
    } <= layer
    points = {p.stem for p in (PACKAGE / "specialization" / "points").glob("*.py")} - {"__init__"}
    assert points == {"language", "compiler", "runtime", "jit_caches", "interpreter"}
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert not top & layer, top & layer
    from tritonspec.specialization import check, install

    # every area's table is installed, each point once, and every hook has its point
    names = [p.name for p in install.INSTALL_POINTS]
    assert len(names) == len(set(names))
    assert {h.point for h in tritonspec.HOOKS.values()} <= set(names) | check.OWN_POINTS


def _string_reads(path: pathlib.Path):
    """``TRITONSPEC_*`` names read from the environment in ``path`` (os.environ[...] / .get(...) / getenv)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Call, ast.Subscript)):
            text = ast.unparse(node)
            if ("environ" in text or "getenv" in text) and "TRITONSPEC_" in text:
                for const in ast.walk(node):
                    if isinstance(const, ast.Constant) and str(const.value).startswith("TRITONSPEC_"):
                        yield const.value


def test_settings_are_read_only_where_they_are_declared():
    readers = {}
    for path in list(PACKAGE.rglob("*.py")) + list((ROOT / "third_party").rglob("*.py")):
        for name in _string_reads(path):
            readers.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    # tritonspec_backends decides whether to import tritonspec at all before importing it
    allowed = {"python/tritonspec/settings.py", "third_party/__init__.py"}
    assert all(paths <= allowed for paths in readers.values()), readers
    assert set(readers) <= {"TRITONSPEC_DISABLE"}, readers
    declared = settings.ALL
    assert {
        "TRITONSPEC_DISABLE",
        "TRITONSPEC_DEFAULT_BACKEND",
        "TRITONSPEC_ALLOWED_BACKENDS",
        "TRITONSPEC_CACHED_LAUNCH",
        "TRITONSPEC_LOCAL_KERNELS",
    } <= set(declared)
    assert all(s.doc and s.name.startswith("TRITONSPEC_") for s in declared.values())


@pytest.mark.parametrize(
    "raw, expected", [("1", True), ("yes", True), ("On", True), ("0", False), ("off", False), ("", False)]
)
def test_boolean_settings_read_as_tritons_knobs(monkeypatch, raw, expected):
    monkeypatch.setenv("TRITONSPEC_CACHED_LAUNCH", raw)
    assert settings.CACHED_LAUNCH.get() is expected


def test_a_boolean_setting_that_is_neither_warns_and_keeps_its_default(monkeypatch):
    monkeypatch.setenv("TRITONSPEC_CACHED_LAUNCH", "sometimes")
    with pytest.warns(RuntimeWarning, match="TRITONSPEC_CACHED_LAUNCH='sometimes' is neither true"):
        assert settings.CACHED_LAUNCH.get() is True


OLD_NAMES = """
import warnings
warnings.simplefilter("always")
import tritonspec
from tritonspec import PROVIDERS
print("DEFAULT", tritonspec.default_backend())
print("ALLOWED", sorted(PROVIDERS.allow_list().names))
"""


@pytest.mark.parametrize("old", [True, False])
def test_renamed_backend_variables_keep_working_with_a_warning(old):
    names = (
        ("TRITONSPEC_BACKEND", "TRITONSPEC_BACKENDS")
        if old
        else ("TRITONSPEC_DEFAULT_BACKEND", "TRITONSPEC_ALLOWED_BACKENDS")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITONSPEC_")}
    env.update({names[0]: "cpu", names[1]: "cpu,nvidia", "TRITON_INTERPRET": "1"})
    proc = subprocess.run([sys.executable, "-c", OLD_NAMES], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DEFAULT cpu" in proc.stdout and "ALLOWED ['cpu', 'nvidia']" in proc.stdout, proc.stdout
    renamed = (
        "TRITONSPEC_BACKEND is renamed TRITONSPEC_DEFAULT_BACKEND" in proc.stderr,
        "TRITONSPEC_BACKENDS is renamed TRITONSPEC_ALLOWED_BACKENDS" in proc.stderr,
    )
    assert renamed == (old, old), proc.stderr[-3000:]


def test_names_of_earlier_layouts_are_the_same_objects_with_a_warning():
    from tritonspec.deprecated import ATTRIBUTES, MODULES
    import importlib

    for old, new in MODULES.items():
        sys.modules.pop(old, None)
        with pytest.warns(FutureWarning, match=f"{old} is now {new}"):
            assert importlib.import_module(old) is importlib.import_module(new)
    for (module, old), new in ATTRIBUTES.items():
        with pytest.warns(FutureWarning, match=f"{module}.{old} is now {module}.{new}"):
            assert getattr(importlib.import_module(module), old) is getattr(importlib.import_module(module), new)
    with pytest.raises(AttributeError, match="has no attribute 'NO_SUCH_NAME'"):
        tritonspec.NO_SUCH_NAME
