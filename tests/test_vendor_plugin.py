"""The out-of-tree vendor example (examples/vendor_plugin): installed offline into a fresh venv.

Proves a vendor adds a backend with spec functions (a semantic hook, a ``tl`` builtin, a launch
config) as a distribution of its own, through the ``triton.backends`` and ``tritonspec.specs``
entry points, touching no file of tritonspec.

The venv is made by this test's Python without pip and sees the test's own site-packages (torch,
triton, pip, setuptools, the editable tritonspec) through a ``.pth`` file, so nothing is
downloaded or reinstalled. The plugin is built from a copy in tmp_path, so the source tree gets no
build/ or *.egg-info. Every check runs in a subprocess of the new venv's Python: Triton discovers
backends once per process, and TRITON_INTERPRET / TRITONSPEC_ALLOWED_BACKENDS must be set before import.
"""

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "vendor_plugin"
DIST = "tritonspec-toyvendor"

# Plain functions in a file (JITFunction needs their source): jitted or compiled by the scripts.
KERNELS = """
import triton.language as tl


def clamp01(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.toy_clamp01(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def atomic_add(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.atomic_add(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
"""

# (b) interpreted (TRITON_INTERPRET=1), no allow-list.
INTERPRETED = """
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import kernels
import toyvendor
import tritonspec
from tritonspec import PROVIDERS

repo, venv = Path(sys.argv[1]), Path(sys.argv[2])
# The new venv sees the outer one: the editable tritonspec, the plugin from the new venv only.
assert Path(tritonspec.__file__).resolve().is_relative_to(repo / "python"), tritonspec.__file__
assert Path(toyvendor.__file__).resolve().is_relative_to(venv.resolve()), toyvendor.__file__
assert Path(sys.prefix).resolve() == venv.resolve(), sys.prefix

provider = PROVIDERS.get("toyvendor")
assert provider is not None and provider.distribution == "tritonspec-toyvendor", provider
assert provider.source == "entry point of tritonspec-toyvendor" and provider.info.runs == "emulated"
assert provider.hooks == ["atomic_disable_bf16", "kernel_config"], provider.hooks

seed = int.from_bytes(os.urandom(4), "little")
g = torch.Generator().manual_seed(seed)
n = 1000
x = torch.randn(n, generator=g) * 2 + 0.5
assert (x < 0).any() and (x > 1).any() and ((x > 0) & (x < 1)).any()
ref = x.double().clamp(0, 1)
clamp = triton.jit(kernels.clamp01)
atomic = triton.jit(kernels.atomic_add)
from tritonspec.kernel_table import RMSNormForward, SwiGLUForward
ROWS = dict(BLOCK_N=64, BLOCK_M=1, num_warps=8)


def bf16_atomic_error():
    xb, out = torch.randn(100, generator=g).bfloat16(), torch.zeros(100, dtype=torch.bfloat16)
    try:
        atomic[(2,)](out, xb, 100, BLOCK=64)
    except Exception as e:
        return str(e)
    return None


assert not hasattr(tl, "toy_clamp01")
with tritonspec.use_backend("toyvendor"):
    assert tl.toy_clamp01 is sys.modules["toyvendor.spec"].toy_clamp01
    out = torch.full_like(x, float("nan"))
    clamp[(triton.cdiv(n, 256),)](x, out, n, BLOCK=256)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=0, msg=lambda m: f"seed {seed}: {m}")
    assert tritonspec.launch_config(RMSNormForward, "cpu", RMSNormForward(**ROWS)).num_warps == 2
    assert tritonspec.launch_config(SwiGLUForward, "cpu", SwiGLUForward(**ROWS)).num_warps == 8  # not in its table
    assert tritonspec.value("atomic_disable_bf16") is True
    err = bf16_atomic_error()
    assert err is not None and "atomic_add on bfloat16 is not supported" in err and "'toyvendor'" in err, err

# Outside the selection: no tl.toy_clamp01, stock launch config, no bf16 atomics policy.
assert not hasattr(tl, "toy_clamp01") and not hasattr(tl.core, "toy_clamp01")
try:
    clamp[(triton.cdiv(n, 256),)](x, torch.empty_like(x), n, BLOCK=256)
except Exception as e:
    assert "has no attribute 'toy_clamp01'" in str(e), e
else:
    raise AssertionError("tl.toy_clamp01 ran outside the toyvendor selection")
assert tritonspec.launch_config(RMSNormForward, "cpu", RMSNormForward(**ROWS)).num_warps == 8
assert tritonspec.value("atomic_disable_bf16") is None
err = bf16_atomic_error()  # the interpreter itself has no bf16 atomics: its own error, not the policy's
assert err is None or ("is not supported by backend" not in err and "toyvendor" not in err), err
print("interpreted checks passed")
"""

# (c) then (d), compiled offline (no TRITON_INTERPRET); starts with TRITONSPEC_ALLOWED_BACKENDS=nvidia,cpu.
COMPILED = """
import os
import sys

import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction

import kernels
import tritonspec
from tritonspec import PROVIDERS, SpecError
from tritonspec.specialization.resolve import explicit_backend

TOY, CUDA = GPUTarget("toyvendor", 90, 32), GPUTarget("cuda", 90, 32)
CLAMP = (kernels.clamp01, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256})
ATOMIC = (kernels.atomic_add, {"out_ptr": "*bf16", "x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
          {"BLOCK": 64})


def compile(kernel, target):
    fn, signature, constexprs = kernel
    compiled = triton.compile(ASTSource(JITFunction(fn), signature, constexprs), target=target)
    assert compiled.metadata.target == target, compiled.metadata.target
    assert compiled.asm["ptx"] and compiled.asm["cubin"], list(compiled.asm)
    return compiled


def error(kernel, target):
    try:
        compile(kernel, target)
    except Exception as e:
        return str(e)
    raise AssertionError(f"{kernel[0].__name__} compiled for {target}")


def not_selectable():
    try:
        with tritonspec.use_backend("toyvendor"):
            pass
    except SpecError as e:
        return str(e)
    raise AssertionError("use_backend('toyvendor') worked")


def allow(value):
    if value is None:
        os.environ.pop("TRITONSPEC_ALLOWED_BACKENDS", None)
    else:
        os.environ["TRITONSPEC_ALLOWED_BACKENDS"] = value
    PROVIDERS.refresh()


# The Triton backend: found by discovery, its driver inactive unless selected.
assert backends["toyvendor"].compiler.__name__ == "ToyVendorBackend", backends["toyvendor"]
assert backends["toyvendor"].driver.__name__ == "ToyVendorDriver", backends["toyvendor"]
assert not backends["toyvendor"].driver.is_active()
assert make_backend(TOY).hash().startswith("toyvendor-")
assert [c.distribution for c in PROVIDERS.entry_points()["toyvendor"]] == ["tritonspec-toyvendor"]

# (c) not in the allow-list: the spec module is never imported, whatever resolves or compiles.
assert os.environ["TRITONSPEC_ALLOWED_BACKENDS"] == "nvidia,cpu"
assert "toyvendor.spec" not in sys.modules
compile(ATOMIC, TOY)  # the toyvendor target compiles stock: no bf16 policy
assert "has no attribute 'toy_clamp01'" in error(CLAMP, TOY)
assert tritonspec.current_backend("toyvendor") == "toyvendor" and PROVIDERS.get("toyvendor") is None
assert "backend 'toyvendor' (entry point of tritonspec-toyvendor==0.1.0) is not allowed by " \
    "TRITONSPEC_ALLOWED_BACKENDS='nvidia,cpu'" in not_selectable(), not_selectable()
PROVIDERS.providers()
allow("toyvendor=another-vendor,nvidia,cpu")  # pinned to another distribution: still not allowed
assert PROVIDERS.get("toyvendor") is None and not_selectable()
assert "toyvendor.spec" not in sys.modules
allow("toyvendor=tritonspec-toyvendor,nvidia,cpu")  # pinned to this one: allowed
provider = PROVIDERS.get("toyvendor")
assert provider is not None and provider.distribution == "tritonspec-toyvendor", provider
with tritonspec.use_backend("toyvendor"):
    assert tritonspec.value("atomic_disable_bf16") is True
assert "toyvendor.spec" in sys.modules

# (d) no allow-list: compiles for a toyvendor target get the toyvendor spec without any selection.
allow(None)
assert explicit_backend() is None
ptx = compile(CLAMP, TOY).asm["ptx"]
assert "max.f32" in ptx and "min.f32" in ptx and "0f3F800000" in ptx, ptx  # max(x, 0), min(., 1.0)
err = error(ATOMIC, TOY)  # the same kernel as above, now with the spec: not a stale cache entry
assert "atomic_add on bfloat16 is not supported by backend 'toyvendor'" in err, err
compile(ATOMIC, CUDA)  # other targets keep bf16 atomics and have no toy_clamp01
assert "has no attribute 'toy_clamp01'" in error(CLAMP, CUDA)
print("compiled checks passed")
"""

# TRITONSPEC_DISABLE=1: Triton still discovers the backend, which must not import tritonspec, and is
# taken back out of Triton's table with ours.
DISABLED = """
import sys

imported = []


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tritonspec":
            imported.append(name)


sys.meta_path.insert(0, Watch())
import triton  # noqa: E402
from triton.backends import backends  # noqa: E402

# Discovery did import the plugin's backend, which then left Triton stock: only Triton's own backends.
assert "toyvendor.backend.compiler" in sys.modules, sorted(sys.modules)
assert all(b.compiler.__module__.startswith("triton.") for b in backends.values()), sorted(backends)
assert not hasattr(sys.modules["toyvendor.backend"], "tritonspec")
assert not imported, imported
print("disabled checks passed")
"""


def _env(interpret: bool, **extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_BACKEND") and not k.startswith("TRITONSPEC_")
    }
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def _run(args, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[1:]} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _fresh_venv(root: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new venv at ``root / "venv"`` that also sees this one's site-packages."""
    venv = root / "venv"
    # pip comes from the outer site-packages; a venv made without pip (uv) gets one from ensurepip (offline).
    has_pip = importlib.util.find_spec("pip") is not None
    subprocess.run([sys.executable, "-m", "venv", *(["--without-pip"] if has_pip else []), str(venv)], check=True)
    (site_dir,) = venv.glob("lib/python*/site-packages")
    # addsitedir (not a bare path line): the outer site-packages' own .pth files run too, among them
    # the editable tritonspec's finder.
    (site_dir / "_outer_site_packages.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages())
    )
    return venv / "bin" / "python", site_dir


def _pip_install(python: Path, src: Path, cwd: Path) -> None:
    """Install ``src`` offline; never touch a distribution of the same name outside the new venv."""
    _run(
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--ignore-installed",
            src,
        ],
        _env(False),
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory):
    """(python, work dir) of a fresh venv with the plugin installed offline from a copy of its source."""
    root = tmp_path_factory.mktemp("vendor_plugin")
    src = root / "src"
    shutil.copytree(PLUGIN, src, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
    python, site_dir = _fresh_venv(root)
    _pip_install(python, src, root)
    assert any(site_dir.glob("tritonspec_toyvendor-*.dist-info")), sorted(p.name for p in site_dir.iterdir())
    for name, text in (
        ("kernels.py", KERNELS),
        ("interpreted.py", INTERPRETED),
        ("compiled.py", COMPILED),
        ("disabled.py", DISABLED),
    ):
        (root / name).write_text(textwrap.dedent(text))
    yield python, root
    leftovers = [p.name for p in PLUGIN.iterdir() if p.name in ("build", "dist") or p.name.endswith(".egg-info")]
    assert not leftovers, f"installing wrote into the source tree: {leftovers}"


def test_check_lists_and_compiles_the_plugin(plugin_venv):
    """(a) ``tritonspec check`` in the new venv: the provider, its hooks, its samples for toyvendor:90:32."""
    python, root = plugin_venv
    out = _run([python, "-m", "tritonspec.cli", "check", "--verbose"], _env(False), cwd=root).stdout
    from tritonspec.text_tables import parse_tables

    tables = parse_tables(out)
    assert "all checks passed" in out, out
    providers = {row[0]: row for row in tables["Spec providers"]}
    assert providers["toyvendor"][1:3] == ["emulated", f"entry point of {DIST}"], providers["toyvendor"]
    functions = {(row[0], row[1]): row[2] for row in tables["Spec functions"]}
    assert functions[("toyvendor", "core_ext_spec_func_list")] == "toy_clamp01", functions
    hooks = {row[0]: row for row in tables["Hook points"]}
    for hook in ("atomic_disable_bf16", "kernel_config"):
        assert "toyvendor" in hooks[hook][-1], hooks[hook]
    samples = [row for row in tables["Sample kernels"] if row[0] == "toyvendor"]
    assert samples and all(row[1] == "toyvendor:90:32" and row[3].startswith("ok (") for row in samples), samples
    assert all("ptx" in row[3] and "cubin" in row[3] for row in samples), samples


def test_interpreted_under_selection(plugin_venv):
    """(b) tl.toy_clamp01 vs the float64 clamp, kernel_config and the bf16 atomics hook, only when selected."""
    python, root = plugin_venv
    out = _run([python, "interpreted.py", REPO, python.parents[1]], _env(True), cwd=root).stdout
    assert "interpreted checks passed" in out


def test_allow_list_and_offline_compile(plugin_venv):
    """(c) an allow-list without toyvendor never imports its spec; (d) compiles for its target use it."""
    python, root = plugin_venv
    out = _run([python, "compiled.py"], _env(False, TRITONSPEC_ALLOWED_BACKENDS="nvidia,cpu"), cwd=root).stdout
    assert "compiled checks passed" in out


def test_disabled_layer_is_not_imported(plugin_venv):
    """TRITONSPEC_DISABLE=1: the plugin's Triton backend loads without importing tritonspec."""
    python, root = plugin_venv
    out = _run([python, "disabled.py"], _env(False, TRITONSPEC_DISABLE="1"), cwd=root).stdout
    assert "disabled checks passed" in out


# -- the distribution pin against wheels installed in a fresh venv -----------------------------------
# Both venvs also see this one's site-packages, so the editable tritonspec is a second distribution
# named tritonspec there: an identical one (same providers) for the real wheel, a different one for the fake.

PINNED = """
import json, os, sys
import tritonspec
from tritonspec import PROVIDERS
out = {"tritonspec": tritonspec.__file__}
for backend in sys.argv[1:]:
    try:
        provider = PROVIDERS.get(backend)
        out[backend] = {"file": provider.module.__file__, "distribution": provider.distribution,
                        "cacheable": provider.digest.cacheable}
    except tritonspec.SpecError as e:
        out[backend] = {"refused": str(e)}
out["evil imported"] = "evilmod" in sys.modules
print("PINNED " + json.dumps(out))
"""

FAKE_PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "tritonspec"
version = "9.9"

[project.entry-points."tritonspec.specs"]
cpu = "evilmod"
toyx = "evilmod"

[tool.setuptools]
py-modules = ["evilmod"]
"""

EVILMOD = """
from triton.language import core

@core.builtin
def exp(x, _semantic=None):
    return _semantic.add(x, x, True)

math_ext_base_func_list = ["exp"]
__all__ = ["math_ext_base_func_list"]
"""


def _pinned(python: Path, root: Path, allow: str, *backends) -> dict:
    import json

    proc = _run([python, "pinned.py", *backends], _env(False, TRITONSPEC_ALLOWED_BACKENDS=allow), cwd=root)
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("PINNED ")][-1][7:])


def test_a_wheel_install_of_tritonspec_passes_its_own_pin(tmp_path_factory):
    """A regular (non-editable) install: its RECORD lists the spec packages' files."""
    root = tmp_path_factory.mktemp("tritonspec_wheel")
    src = root / "src"
    for part in ("python", "third_party"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "setup.py", src / "setup.py")
    shutil.copy(REPO / "README.md", src / "README.md")  # the long description
    python, site_dir = _fresh_venv(root)
    _pip_install(python, src, root)
    (root / "pinned.py").write_text(PINNED)
    allow = ",".join(f"{name}=tritonspec" for name in ("cpu", "nvidia", "amd", "ascend", "iluvatar"))
    out = _pinned(python, root, allow, "cpu", "nvidia", "iluvatar")
    assert Path(out["tritonspec"]).is_relative_to(site_dir), out
    for backend in ("cpu", "nvidia", "iluvatar"):
        assert out[backend].get("distribution") == "tritonspec", out
        assert Path(out[backend]["file"]).is_relative_to(site_dir / "tritonspec_backends" / backend), out
        assert out[backend]["cacheable"], out


def test_a_wheel_calling_itself_tritonspec_is_refused_under_the_pin(tmp_path_factory):
    """A proper wheel (RECORD and all) whose METADATA says ``Name: tritonspec``: installed beside the real
    tritonspec, it is a second, different distribution of that name, and a pin cannot tell them apart."""
    root = tmp_path_factory.mktemp("fake_tritonspec")
    src = root / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(FAKE_PYPROJECT)
    (src / "evilmod.py").write_text(EVILMOD)
    python, site_dir = _fresh_venv(root)
    _pip_install(python, src, root)
    assert any(site_dir.glob("tritonspec-9.9.dist-info/RECORD")), sorted(p.name for p in site_dir.iterdir())
    (root / "pinned.py").write_text(PINNED)
    out = _pinned(python, root, "cpu=tritonspec,toyx=tritonspec,nvidia", "cpu", "toyx")
    assert (
        "backend 'cpu' has 2 spec providers: tritonspec==9.9 (evilmod) and tritonspec==0.1.0" in out["cpu"]["refused"]
    ), out
    assert out["toyx"]["refused"].startswith(
        "backend 'toyx': refusing the provider evilmod of tritonspec==9.9 pinned "
        "by TRITONSPEC_ALLOWED_BACKENDS: 2 different installed distributions are named "
        "'tritonspec'"
    ), out
    assert not out["evil imported"], out
