"""Where kernelize gets a layer from: our built-in layers, a local ``build/<variant>/<package>`` tree, or the Hub.

Why our own loader next to the ``kernels`` package: tritonspec must work without it (the device machine may
not have it; transformers 5.23 refuses kernels 0.17), and a local tree in huggingface/kernels' layout
(kernel-requirements.md) is all a Triton-only kernel needs. ``LayerRepository`` keeps the Hub API shape but
never opens a connection: this build has no network, and a kernelize that hangs on a DNS timeout is worse
than a clear error.

Every loaded layer is checked by :func:`validate_layer` against the rules of kernel-requirements.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import platform
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from .. import kernel_table, settings
from ..devices import triton_runs

_ALLOWED_MEMBERS = {"has_backward", "can_torch_compile"}


class HubUnavailableError(RuntimeError):
    """A Hub kernel was requested but this build cannot download anything."""


def validate_layer(layer: type, reference: Callable | type, *, repo: object) -> None:
    """Raise TypeError unless ``layer`` may replace the forward of ``reference``.

    ``reference`` is the class whose ``forward`` is replaced, or a plain function (its signature with a
    leading ``self`` is what the layer's ``forward`` must mirror). Rules (kernel-requirements.md): an
    ``nn.Module`` subclass, no constructor of its own, no members beyond ``has_backward`` and
    ``can_torch_compile``, and a ``forward`` with the same number and kinds of parameters.
    """
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise TypeError(f"layer {layer!r} from {repo} is not a torch.nn.Module subclass")
    if layer.__init__ is not nn.Module.__init__:
        raise TypeError(f"layer `{layer.__name__}` from {repo} must not define __init__ (layers are stateless)")
    extra = {n for n, _ in inspect.getmembers(layer)} - {n for n, _ in inspect.getmembers(nn.Module)}
    if not extra <= _ALLOWED_MEMBERS:
        raise TypeError(
            f"layer `{layer.__name__}` from {repo} has members {sorted(extra - _ALLOWED_MEMBERS)}; "
            f"only forward, has_backward and can_torch_compile are allowed"
        )
    params = list(inspect.signature(layer.forward).parameters.values())
    if isinstance(reference, type):
        ref = list(inspect.signature(reference.forward).parameters.values())
        ref_name = reference.__name__
    else:
        ref = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        ref += list(inspect.signature(reference).parameters.values())
        ref_name = getattr(reference, "__name__", repr(reference))
    if len(params) != len(ref):
        raise TypeError(
            f"forward of layer `{layer.__name__}` from {repo} takes {len(params)} parameters, "
            f"`{ref_name}` takes {len(ref)}"
        )
    for p, r in zip(params, ref):
        if p.kind != r.kind:
            raise TypeError(
                f"forward of layer `{layer.__name__}` from {repo}: parameter {p.name!r} is "
                f"{p.kind.description}, `{ref_name}` has {r.name!r} as {r.kind.description}"
            )


def kernel_available(kernel: kernel_table.Kernel, device_type: str) -> bool:
    """Triton can run on ``device_type`` (a GPU-like backend, or the CPU interpreter) and the kernel's op
    module imports (a missing op makes the kernel unavailable, not an error)."""
    if not triton_runs(device_type):
        return False
    try:
        return importlib.util.find_spec(kernel.module) is not None
    except ImportError:  # tritonspec.ops itself failed to import
        return False


class TritonspecRepository:
    """The hub layer of a kernel of the kernel table (:mod:`tritonspec.kernel_table`), no files involved."""

    def __init__(self, layer_name: str):
        kernel = kernel_table.layers().get(layer_name)
        if kernel is None:
            known = ", ".join(sorted({k.layer.name for k in kernel_table.layers().values()}))
            raise ValueError(f"layer_name: {layer_name!r} is not a tritonspec layer; known: {known}")
        self.layer_name = kernel.layer.name
        self.kernel = kernel

    def load(self) -> type:
        return self.kernel.layer.load()

    def available(self, device_type: str) -> bool:
        return kernel_available(self.kernel, device_type)

    def __eq__(self, other):
        return isinstance(other, TritonspecRepository) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash(("tritonspec", self.layer_name))

    def __str__(self):
        return f"tritonspec layer `{self.layer_name}`"

    __repr__ = __str__


def _system_backend() -> str:
    if torch.version.cuda is not None:
        return "cuda"
    if getattr(torch.version, "hip", None) is not None:
        return "rocm"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


_ARCH_BACKEND = re.compile(r"^(cu|rocm|xpu|cpu|metal|cann)")


def _judge_variant(name: str, backend: str) -> tuple[int, str]:
    """(preference, reason): preference > 0 accepts the variant (higher wins), 0 rejects it (reason says why)."""
    parts = name.split("-")
    if parts[0] == "torch" and len(parts) == 2:  # noarch: torch-universal, torch-cuda, torch-cpu, ...
        kind = parts[1]
        if kind == "universal":
            return 1, ""
        want = "npu" if backend == "cann" else backend
        return (2, "") if kind == want else (0, f"backend {kind} does not match system backend {backend}")
    m = re.match(r"^torch(\d)(\d+)$", parts[0])
    if m is None:
        return 0, "not a build variant name"
    rest = parts[2:] if len(parts) > 1 and parts[1].startswith("cxx") else parts[1:]
    if len(rest) < 3:
        return 0, "not a build variant name"
    torch_mm = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if (int(m.group(1)), int(m.group(2))) != torch_mm:
        return 0, f"built for torch {m.group(1)}.{m.group(2)}, running {torch_mm[0]}.{torch_mm[1]}"
    bm = _ARCH_BACKEND.match(rest[0])
    tag = {"cu": "cuda"}.get(bm.group(1), bm.group(1)) if bm else rest[0]
    if tag != backend:
        return 0, f"backend {tag} does not match system backend {backend}"
    if rest[-2] != platform.machine() or rest[-1] != platform.system().lower():
        return 0, f"platform {rest[-2]}-{rest[-1]} is not {platform.machine()}-{platform.system().lower()}"
    return 3, ""


_LOADED: dict[Path, ModuleType] = {}


class LocalLayerRepository:
    """A kernel repository on disk: ``repo_path/build/<variant>/<package_name>/__init__.py`` exporting ``layers``.

    The variant is chosen for this system: an arch build for the installed torch/backend/platform first,
    then ``torch-<backend>``, then ``torch-universal``. ``package_name`` may be omitted when the variant
    holds a ``metadata.json`` (kernels 0.17 layout) or exactly one package.
    """

    def __init__(self, repo_path, *, package_name: str | None = None, layer_name: str):
        self.repo_path = Path(repo_path)
        self.package_name = package_name
        self.layer_name = layer_name

    def _variant_dir(self) -> Path:
        build = self.repo_path / "build"
        if not build.is_dir():
            raise FileNotFoundError(
                f"repo_path: {self.repo_path} has no build/ directory (expected build/<variant>/<package>/__init__.py)"
            )
        backend = _system_backend()
        judged = sorted(
            ((*_judge_variant(d.name, backend), d) for d in build.iterdir() if d.is_dir()),
            key=lambda t: (-t[0], t[2].name),
        )
        if not judged or judged[0][0] == 0:
            why = "; ".join(f"{d.name}: {reason}" for _, reason, d in judged) or "no variant directories"
            raise FileNotFoundError(f"no build variant for this system ({backend}) in {build}: {why}")
        return judged[0][2]

    def _package_dir(self, variant: Path) -> Path:
        name = self.package_name
        if name is None:
            meta = variant / "metadata.json"
            if meta.is_file():
                name = json.loads(meta.read_text())["name"].replace("-", "_")
            else:
                pkgs = [d.name for d in variant.iterdir() if (d / "__init__.py").is_file()]
                if len(pkgs) != 1:
                    raise FileNotFoundError(
                        f"package_name: not given and {variant} holds {len(pkgs)} packages "
                        f"({', '.join(pkgs) or 'none'})"
                    )
                name = pkgs[0]
        pkg = variant / name
        if not (pkg / "__init__.py").is_file():
            raise FileNotFoundError(f"package_name: {pkg}/__init__.py does not exist")
        return pkg

    def load(self) -> type:
        pkg = self._package_dir(self._variant_dir()).resolve()
        module = _LOADED.get(pkg)
        if module is None:
            # A unique module name per directory: two versions of one kernel may be loaded side by side,
            # which is why kernel code must import itself relatively.
            mod_name = f"_tritonspec_hub_{pkg.name}_{hashlib.sha1(str(pkg).encode()).hexdigest()[:10]}"
            spec = importlib.util.spec_from_file_location(
                mod_name, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(mod_name, None)
                raise
            _LOADED[pkg] = module
        layers = getattr(module, "layers", None)
        if layers is None:
            raise ValueError(f"kernel repo {self} does not export `layers` from its __init__.py")
        layer = getattr(layers, self.layer_name, None)
        if layer is None:
            raise ValueError(f"layer_name: `{self.layer_name}` not found in {self}")
        return layer

    def __eq__(self, other):
        return isinstance(other, LocalLayerRepository) and (self.repo_path, self.package_name, self.layer_name) == (
            other.repo_path,
            other.package_name,
            other.layer_name,
        )

    def __hash__(self):
        return hash((self.repo_path, self.package_name, self.layer_name))

    def __str__(self):
        return f"`{self.repo_path}` (layer `{self.layer_name}`)"

    __repr__ = __str__


def _local_overrides() -> dict[str, Path]:
    raw = settings.LOCAL_KERNELS.get() or ""
    out = {}
    for item in filter(None, raw.split(":")):
        repo_id, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"TRITONSPEC_LOCAL_KERNELS: entry {item!r} is not repo_id=path")
        out[repo_id] = Path(path)
    return out


class LayerRepository:
    """A layer in a Hugging Face Hub kernel repository (``org/name``).

    This build never downloads: ``load`` resolves ``repo_id`` through ``TRITONSPEC_LOCAL_KERNELS``
    (``org/name=/path/to/checkout:...``) and otherwise fails at once with :class:`HubUnavailableError`.
    """

    def __init__(self, repo_id: str, *, layer_name: str, revision: str | None = None, version: str | None = None):
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo_id or ""):
            raise ValueError(f"repo_id: {repo_id!r} is not of the form 'org/name'")
        if revision is not None and version is not None:
            raise ValueError("revision/version: give at most one of them")
        self.repo_id = repo_id
        self.layer_name = layer_name
        self.revision = revision
        self.version = version

    def load(self) -> type:
        path = _local_overrides().get(self.repo_id)
        if path is not None:
            return LocalLayerRepository(path, layer_name=self.layer_name).load()
        raise HubUnavailableError(
            f"cannot load `{self.repo_id}` (layer `{self.layer_name}`) from the Hugging Face Hub: tritonspec "
            "does not download kernels. Fetch the repository on a machine with network access and map it with "
            f"TRITONSPEC_LOCAL_KERNELS={self.repo_id}=/path/to/checkout, or use LocalLayerRepository."
        )

    def __eq__(self, other):
        return isinstance(other, LayerRepository) and (self.repo_id, self.layer_name, self.revision, self.version) == (
            other.repo_id,
            other.layer_name,
            other.revision,
            other.version,
        )

    def __hash__(self):
        return hash((self.repo_id, self.layer_name, self.revision, self.version))

    def __str__(self):
        at = f"@{self.revision}" if self.revision else (f" {self.version}" if self.version else "")
        return f"`{self.repo_id}`{at} (layer `{self.layer_name}`)"

    __repr__ = __str__
