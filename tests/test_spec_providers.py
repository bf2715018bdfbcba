"""Spec providers as an attacker or a heavy user meets them: who may load, what the cache keys cover,
what a process that never asks for a spec pays, and what TRITONSPEC_DISABLE=1 leaves behind.

Each case runs in a fresh process: the allow-list and the installed entry points are read once per
process, and these tests install fake distributions by putting a ``*.dist-info`` on ``PYTHONPATH``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import compile_for
import triton.language as tl

STOCK_EXP_3 = 20.085536923187668  # e**3: what tl.exp(3.0) must give unless a trusted spec says otherwise


def fake_distribution(site, name, entry_points: dict, modules: dict, record=True, version="1.0", folder=None) -> None:
    """A distribution as pip leaves it: ``<name>-<version>.dist-info`` (METADATA, entry_points.txt and,
    with ``record``, a RECORD listing its files) and modules. ``folder`` names the dist-info otherwise."""
    info = site / (folder or f"{name}-{version}.dist-info")
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for mod, source in modules.items():
        (site / f"{mod}.py").write_text(textwrap.dedent(source))
    if record:
        files = [f"{mod}.py" for mod in modules] + [f"{info.name}/{f}" for f in ("METADATA", "entry_points.txt")]
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files) + f"{info.name}/RECORD,,\n")


# A spec that claims the interpreter's backend name and makes tl.exp(x) return x + x. Importing it
# leaves a marker file, so a test can tell "never imported" from "imported but not used".
EVIL = """
import os
open(os.environ["EVIL_MARKER"], "w").write("imported")
from triton.language import core

@core.builtin
def exp(x, _semantic=None):
    return _semantic.add(x, x, True)

math_ext_base_func_list = ["exp"]
__all__ = ["math_ext_base_func_list"]
"""

PROBE = """
import json, os, sys
import torch, triton, triton.language as tl

@triton.jit
def exp_kernel(x_ptr, y_ptr):
    tl.store(y_ptr, tl.exp(tl.load(x_ptr)))

x, y = torch.tensor([3.0]), torch.full((1,), float("nan"))
try:
    exp_kernel[(1,)](x, y)
    result = y.item()
except Exception as e:
    result = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps({"result": result, "evil imported": os.path.exists(os.environ["EVIL_MARKER"])}))
"""


@pytest.fixture
def evil_site(tmp_path):
    site = tmp_path / "site"
    fake_distribution(site, "evil", {"tritonspec.specs": {"cpu": "evilmod"}}, {"evilmod": EVIL})
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def run_python(args, env_extra: dict, timeout=300):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def probe(root, allow: str | None) -> dict:
    marker = root / "marker"
    marker.unlink(missing_ok=True)
    env = {"PYTHONPATH": str(root / "site"), "EVIL_MARKER": str(marker), "TRITON_INTERPRET": "1"}
    if allow is not None:
        env["TRITONSPEC_ALLOWED_BACKENDS"] = allow
    proc = run_python([str(root / "probe.py")], env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("PROBE ") :])


# -- trust ------------------------------------------------------------------------------------------


def test_a_second_provider_for_a_name_is_an_error_naming_both_distributions(evil_site):
    """The reproducer: a name-only allow-list let whichever provider came first on sys.path win."""
    out = probe(evil_site, "cpu,nvidia")
    assert "backend 'cpu' has 2 spec providers" in out["result"], out
    assert "evil==1.0" in out["result"] and "tritonspec==0.1.0" in out["result"], out
    assert "TRITONSPEC_ALLOWED_BACKENDS=cpu=<distribution>" in out["result"]
    assert not out["evil imported"], "a conflicting provider must not be imported"
    out = probe(evil_site, None)  # no allow-list at all: the same error, never a silent winner
    assert "backend 'cpu' has 2 spec providers" in out["result"] and not out["evil imported"]


def test_the_allow_list_pins_a_name_to_a_distribution(evil_site):
    out = probe(evil_site, "cpu=tritonspec,nvidia")
    assert out == {"result": pytest.approx(STOCK_EXP_3, rel=1e-6), "evil imported": False}
    out = probe(evil_site, "nvidia")  # cpu not allowed at all: stock semantics, nothing imported
    assert out == {"result": pytest.approx(STOCK_EXP_3, rel=1e-6), "evil imported": False}
    out = probe(evil_site, "cpu=evil")  # the marker does record an import, and the pin is what decides
    assert out == {"result": 6.0, "evil imported": True}


def test_check_shows_conflicts_and_distributions(evil_site):
    env = {"PYTHONPATH": str(evil_site / "site"), "EVIL_MARKER": str(evil_site / "marker")}
    proc = run_python(["-m", "tritonspec.cli", "check"], env, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("cpu ")]
    assert ["cpu", "CONFLICT", "entry", "point", "of", "evil==1.0", "evilmod", "-"] in rows, proc.stdout
    assert any(r[:6] == ["cpu", "CONFLICT", "entry", "point", "of", "tritonspec==0.1.0"] for r in rows)
    assert "backend 'cpu' has 2 spec providers" in proc.stdout
    assert not (evil_site / "marker").exists()


def test_register_spec_cannot_take_a_pinned_name(tmp_path):
    """A pinned name's spec comes from its distribution's entry point: not from a module made at run time
    under a name that looks like the distribution's, nor from its own module registered by hand."""
    code = textwrap.dedent("""
        import types, tritonspec
        lookalike = types.ModuleType("tritonspec_backends.cpu.backend.evil"); lookalike.__all__ = []
        import tritonspec_backends.cpu.backend.spec as ours
        for module in (lookalike, ours):
            try:
                tritonspec.register_spec("cpu", module)
                print("ACCEPTED", module.__name__)
            except tritonspec.SpecError as e:
                print("REFUSED", e)
        print("PROVIDER", tritonspec.PROVIDERS.get("cpu").origin)
        tritonspec.register_spec("scratch", lookalike)  # an allowed name that is not pinned
        print("OK", tritonspec.PROVIDERS.get("scratch").origin)
    """)
    proc = run_python(["-c", code], {"TRITONSPEC_ALLOWED_BACKENDS": "cpu=tritonspec,scratch"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2 and "ACCEPTED" not in proc.stdout, proc.stdout
    for line, module in zip(refused, ("tritonspec_backends.cpu.backend.evil", "tritonspec_backends.cpu.backend.spec")):
        assert (
            "register_spec: backend 'cpu' is pinned to distribution tritonspec by TRITONSPEC_ALLOWED_BACKENDS="
            "'cpu=tritonspec,scratch': its spec comes from that distribution's tritonspec.specs entry point "
            f"only, not from module {module} registered at run time"
        ) in line, line
    assert "PROVIDER entry point" in proc.stdout and "OK register_spec" in proc.stdout


def test_a_package_calling_itself_tritonspec_is_refused_under_the_pin(tmp_path):
    """METADATA says ``Name: tritonspec``; nothing else about it is tritonspec's. (First on sys.path, it also
    hides tritonspec's Triton backends from Triton's discovery, so here tritonspec is imported by name.)"""
    site = tmp_path / "site"
    fake_distribution(
        site, "tritonspec", {"tritonspec.specs": {"cpu": "evilmod"}}, {"evilmod": EVIL}, record=False, version="9.0"
    )
    (tmp_path / "probe.py").write_text("import tritonspec\n" + PROBE)
    out = probe(tmp_path, "cpu=tritonspec,nvidia")
    assert "backend 'cpu' has 2 spec providers: tritonspec==9.0 (evilmod) and tritonspec==0.1.0" in out["result"], out
    assert "distributions of one name cannot be told apart by a pin" in out["result"]
    assert not out["evil imported"]


PINNED = """
import json, os, sys
import tritonspec
from tritonspec import PROVIDERS
try:
    provider = PROVIDERS.get(sys.argv[1])
    result = {"module": provider.module.__name__, "file": provider.module.__file__,
              "distribution": provider.distribution}
except tritonspec.SpecError as e:
    result = {"refused": str(e)}
result["evil imported"] = os.path.exists(os.environ["EVIL_MARKER"])
print("PINNED " + json.dumps(result))
"""


def pinned(root, backend, allow, cwd=None) -> dict:
    """What ``PROVIDERS.get(backend)`` gives in a fresh process under ``TRITONSPEC_ALLOWED_BACKENDS=allow``."""
    marker = root / "marker"
    marker.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(root / "site"), EVIL_MARKER=str(marker), TRITONSPEC_ALLOWED_BACKENDS=allow)
    proc = subprocess.run(
        [sys.executable, "-c", PINNED, backend], env=env, capture_output=True, text=True, timeout=300, cwd=cwd or root
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PINNED ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("PINNED ") :])


def test_a_second_distribution_of_the_pinned_name_is_refused_even_with_its_own_record(tmp_path):
    """Its dist-info folder named otherwise, its RECORD listing its module: still not the pinned project."""
    fake_distribution(
        tmp_path / "site",
        "tritonspec",
        {"tritonspec.specs": {"toyx": "evilmod"}},
        {"evilmod": EVIL},
        folder="innocent-1.0.dist-info",
    )
    out = pinned(tmp_path, "toyx", "toyx=tritonspec,cpu")
    assert out["refused"].startswith(
        "backend 'toyx': refusing the provider evilmod of tritonspec==1.0 pinned by "
        "TRITONSPEC_ALLOWED_BACKENDS: 2 different installed distributions are named "
        "'tritonspec' (at "
    ), out
    assert "innocent-1.0.dist-info: toyx = evilmod" in out["refused"] and "the pin cannot tell" in out["refused"]
    assert not out["evil imported"]


def test_a_pinned_provider_must_be_a_file_of_its_distribution(tmp_path):
    """The entry point names a module the distribution does not ship (not in its RECORD)."""
    fake_distribution(
        tmp_path / "site", "evil", {"tritonspec.specs": {"cpu": "evilmod"}}, {"evilmod": EVIL}, record=False
    )
    out = pinned(tmp_path, "cpu", "cpu=evil")
    evil_file = os.path.realpath(tmp_path / "site" / "evilmod.py")
    assert out["refused"] == (
        "backend 'cpu': refusing the provider evilmod of evil==1.0 pinned by "
        f"TRITONSPEC_ALLOWED_BACKENDS: {evil_file} (imported for evilmod) is not a file of distribution "
        "evil==1.0: neither in its RECORD nor in its editable source"
    ), out
    assert not out["evil imported"]


@pytest.mark.parametrize("from_repo", [False, True])
def test_the_editable_install_passes_its_own_pin(tmp_path, from_repo):
    """``pip install -e`` records only its .pth and import finder: the finder's mapping names the sources.
    From the repository root the source tree's ``tritonspec.egg-info`` is a second, identical distribution."""
    (tmp_path / "site").mkdir()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    allow = ",".join(f"{name}=tritonspec" for name in ("cpu", "nvidia", "amd", "ascend", "iluvatar"))
    for backend in ("cpu", "nvidia", "ascend"):
        out = pinned(tmp_path, backend, allow, cwd=repo if from_repo else None)
        assert out.get("distribution") == "tritonspec", out
        assert out["file"].startswith(os.path.join(repo, "third_party", backend, "backend", "spec")), out


@pytest.mark.parametrize("raw", ["cpu=", "=tritonspec"])
def test_a_malformed_allow_list_is_an_error(raw):
    from tritonspec.specialization.providers import AllowList
    from tritonspec import SpecError

    with pytest.raises(SpecError, match="must be 'name' or 'name=distribution'"):
        AllowList.parse(raw)


# -- cache identity -----------------------------------------------------------------------------------

# Two specs for one backend name, each exporting exp only through math_ext_base_func_list, built at
# run time from source that is in no file (so only their code objects can tell them apart).
RUNTIME_SPEC = """
import json, sys, types
import triton, tritonspec, triton.language as tl
sys.path.insert(0, {testdir!r})
from test_spec_providers import compile_exp

spec = types.ModuleType("dup_spec")
exec({body!r}, spec.__dict__)
spec.math_ext_base_func_list = ["exp"]
spec.__all__ = ["math_ext_base_func_list"]
tritonspec.register_spec("dup", spec)
with tritonspec.use_backend("dup"):
    k = compile_exp()
print("RESULT " + json.dumps({{"ttir": k.asm["ttir"], "hash": k.hash,
                              "fingerprint": tritonspec.PROVIDERS.get("dup").fingerprint}}))
"""

MUL = (
    "from triton.language import core\n@core.builtin\ndef exp(x, _semantic=None):\n"
    "    return _semantic.mul(x, x, True)\n"
)
ADD = MUL.replace("mul", "add")


def exp_kernel(x_ptr, y_ptr):
    tl.store(y_ptr, tl.exp(tl.load(x_ptr)))


def compile_exp():
    """``exp_kernel`` compiled for cuda sm90: what the scripts here compile, each in a process of its own."""
    return compile_for(exp_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"})


def _compile_in_process(code, cache) -> dict:
    env = {"TRITON_CACHE_DIR": str(cache), "TRITON_INTERPRET": "0"}
    proc = run_python(["-c", code], env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_specs_differing_only_in_injected_functions_never_share_binaries(tmp_path):
    """Across processes sharing a cache dir: the second spec's compile must not reuse the first's."""
    testdir = os.path.dirname(__file__)
    mul = _compile_in_process(RUNTIME_SPEC.format(testdir=testdir, body=MUL), tmp_path / "cache")
    add = _compile_in_process(RUNTIME_SPEC.format(testdir=testdir, body=ADD), tmp_path / "cache")
    assert "arith.mulf" in mul["ttir"] and "arith.addf" not in mul["ttir"]
    assert "arith.addf" in add["ttir"] and "arith.mulf" not in add["ttir"]
    assert mul["fingerprint"] != add["fingerprint"] and mul["hash"] != add["hash"]
    again = _compile_in_process(RUNTIME_SPEC.format(testdir=testdir, body=MUL), tmp_path / "cache")
    assert again["fingerprint"] == mul["fingerprint"] and again["hash"] == mul["hash"]  # stable: cacheable


FILE_SPEC = """
import json, sys
sys.path.insert(0, {site!r}); sys.path.insert(0, {testdir!r})
import triton, tritonspec
from test_spec_providers import compile_exp
import toyspec
tritonspec.register_spec("toy", toyspec)
with tritonspec.use_backend("toy"):
    k = compile_exp()
print("RESULT " + json.dumps({{"ttir": k.asm["ttir"], "fingerprint": tritonspec.PROVIDERS.get("toy").fingerprint}}))
"""


def test_a_spec_function_in_a_helper_file_is_part_of_the_fingerprint(tmp_path):
    """The spec module's own file never changes; only the helper it imports exp from does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "toyspec.py").write_text(
        "from toyhelpers import exp\nmath_ext_base_func_list = ['exp']\n__all__ = ['math_ext_base_func_list']\n"
    )
    code = FILE_SPEC.format(site=str(site), testdir=os.path.dirname(__file__))
    (site / "toyhelpers.py").write_text(MUL)
    first = _compile_in_process(code, tmp_path / "cache")
    (site / "toyhelpers.py").write_text(ADD)
    second = _compile_in_process(code, tmp_path / "cache")
    assert "arith.mulf" in first["ttir"] and "arith.addf" in second["ttir"] and "arith.mulf" not in second["ttir"]
    assert first["fingerprint"] != second["fingerprint"]


def test_the_fingerprint_follows_helpers_closures_and_defaults():
    import threading
    import types
    from tritonspec.specialization import fingerprint

    def spec_with(**exposed):
        module = types.ModuleType("fp_spec")
        return fingerprint.digest("fp", module, exposed)

    def make(k):
        def cap():
            return k

        return cap

    assert spec_with(cap=make(2)).value != spec_with(cap=make(3)).value  # same source, other closure
    assert spec_with(cap=make(2)).value == spec_with(cap=make(2)).value
    assert spec_with(v=(1, "a")).value != spec_with(v=(1, "b")).value
    lock = threading.Lock()
    unreadable = spec_with(cap=lambda: lock)
    assert not unreadable.cacheable and unreadable.value.startswith("nonce-")
    assert "closure 'lock'" in unreadable.reason and "lock" in unreadable.reason.lower()


# -- cost of having the layer installed ------------------------------------------------------------

ZERO_COST = """
import json, sys
import triton, tritonspec
sys.path.insert(0, {testdir!r})
from test_spec_providers import compile_exp
k = compile_exp()
print("RESULT " + json.dumps({{"spec": tritonspec.PROVIDERS.get("nvidia").module.__name__,
                              "heavy": sorted(m for m in ("torch", "tritonspec.ops", "numpy") if m in sys.modules)}}))
"""


def test_the_first_cuda_compile_loads_the_nvidia_spec_but_not_torch_or_the_ops(tmp_path):
    out = _compile_in_process(ZERO_COST.format(testdir=os.path.dirname(__file__)), tmp_path / "cache")
    assert out == {"spec": "tritonspec_backends.nvidia.backend.spec", "heavy": []}


# -- TRITONSPEC_DISABLE=1 --------------------------------------------------------------------------

STOCK = """
import json, sys
sys.path.insert(0, {testdir!r})
import triton
from test_spec_providers import compile_exp
compile_exp()
from triton.backends import backends
print("RESULT " + json.dumps({{"backends": sorted(backends),
                              "ours": sorted(m for m in sys.modules if m.startswith("tritonspec"))}}))
"""


def test_disable_leaves_triton_stock(tmp_path):
    code = STOCK.format(testdir=os.path.dirname(__file__))
    proc = run_python(
        ["-c", code], {"TRITONSPEC_DISABLE": "1", "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    )
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    import triton.backends

    stock = sorted(n for n, b in triton.backends.backends.items() if b.compiler.__module__.startswith("triton."))
    assert out == {"backends": stock, "ours": []}
    enabled = _compile_in_process(code, tmp_path / "cache")  # and without it: our backends, our modules
    assert set(enabled["backends"]) > set(stock) and "tritonspec" in enabled["ours"]


ACTIVE = """
import json, sys
import triton
print("ACTIVE " + json.dumps([m for m in ("tritonspec", "tritonspec_backends") if m in sys.modules]))
"""


def test_disable_takes_what_tritons_boolean_knobs_take(monkeypatch):
    """``TRITONSPEC_DISABLE`` reads like ``TRITON_INTERPRET``: 1/true/yes/on/y in any case disable, and
    0/false/no/off/empty do not; anything else keeps the layer on, with a warning naming the value."""
    from triton._C.libtriton import getenv_bool  # how triton.knobs reads its boolean switches

    values = ["1", "true", "TRUE", "yes", "On", "y", "0", "false", "no", "off", "", "maybe"]
    procs = {}
    for value in values:
        monkeypatch.setenv("TRITONSPEC_DISABLE", value)
        procs[value] = subprocess.Popen(
            [sys.executable, "-c", ACTIVE],
            env=dict(os.environ),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    disabled = []
    for value, proc in procs.items():
        monkeypatch.setenv("TRITONSPEC_DISABLE", value)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        loaded = json.loads(stdout.split("ACTIVE ", 1)[1])
        assert loaded == ([] if getenv_bool("TRITONSPEC_DISABLE", False) else ["tritonspec", "tritonspec_backends"]), (
            value,
            loaded,
        )
        assert ("TRITONSPEC_DISABLE='maybe' is neither true" in stderr) == (value == "maybe"), (value, stderr[-2000:])
        disabled += [value] if not loaded else []
    assert disabled == ["1", "true", "TRUE", "yes", "On", "y"]


def test_a_broken_provider_does_not_take_the_others_down(tmp_path):
    """It is left out of target and device resolution with a warning, and fails where it is named."""
    site = tmp_path / "site"
    fake_distribution(
        site,
        "broken",
        {"tritonspec.specs": {"brokengpu": "brokenmod"}},
        {"brokenmod": "raise ImportError('no SDK here')\n"},
    )
    code = ZERO_COST.format(testdir=os.path.dirname(__file__)).replace(
        'print("RESULT "',
        'import tritonspec\ntry:\n    tritonspec.PROVIDERS.get("brokengpu")\n'
        'except ImportError as e:\n    print("NAMED", e)\nprint("RESULT "',
    )
    proc = run_python(
        ["-c", code], {"PYTHONPATH": str(site), "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spec provider 'brokengpu' failed to load (ImportError: no SDK here)" in proc.stderr
    assert "NAMED no SDK here" in proc.stdout
    assert '"spec": "tritonspec_backends.nvidia.backend.spec"' in proc.stdout
