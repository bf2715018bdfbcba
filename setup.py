"""tritonspec: backend specialization hooks for stock Triton, vendor backends, LLM kernels."""

from pathlib import Path

from setuptools import find_packages, setup

_ROOT = Path(__file__).resolve().parent
_THIRD_PARTY = _ROOT / "third_party"
_BACKENDS = find_packages(str(_THIRD_PARTY))
# Each vendor directory is its own declaration: third_party/<vendor>/backend/spec/ is a spec
# provider, and a backend/ with compiler.py and driver.py is a Triton backend of its own (nvidia and
# amd keep the stock ones). Adding a vendor directory is all it takes to register it.
_VENDORS = sorted(p.parents[2].name for p in _THIRD_PARTY.glob("*/backend/spec/__init__.py"))
_TRITON_BACKENDS = sorted(p.parents[1].name for p in _THIRD_PARTY.glob("*/backend/compiler.py"))
_HF = ["transformers>=4.57", "kernels>=0.17"]
_README = _ROOT / "README.md"  # in every sdist (setuptools includes it); absent only from partial copies of the tree
_DESCRIPTION = "FlagTree-style backend specialization installed into stock Triton, plus LLM kernels"

setup(
    name="tritonspec",
    version="0.1.0",
    description=_DESCRIPTION,
    long_description=_README.read_text(encoding="utf-8") if _README.exists() else _DESCRIPTION,
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    package_dir={"tritonspec": "python/tritonspec", "tritonspec_backends": "third_party"},
    packages=(
        ["tritonspec"]
        + ["tritonspec." + p for p in find_packages("python/tritonspec")]
        + ["tritonspec_backends"]
        + ["tritonspec_backends." + p for p in _BACKENDS]
    ),
    install_requires=[
        "triton>=3.6,<3.10",
        "torch>=2.11",
        # triton 3.6's interpreter breaks on numpy 2.4 (int(ndarray) in __index__); 3.7+ is fine.
        "numpy<2.4",
        "pyyaml",
        "regex",  # match.name in YAML rules: re-compatible, with a search timeout
    ],
    extras_require={
        # tritonspec.nn: the Hugging Face integrations (kernelize, the registry, hub layers, MoE experts)
        "hf": _HF,
        # ruff pinned: its formatter's output is part of what CI checks
        "test": ["pytest", "pytest-xdist", "lit", "ruff==0.17.6", *_HF],
    },
    entry_points={
        "console_scripts": ["tritonspec=tritonspec.cli:main"],
        "tritonspec.specs": [f"{v} = tritonspec_backends.{v}.backend.spec" for v in _VENDORS],
        # Imported during Triton's backend discovery: importing them activates the hooks.
        "triton.backends": [f"{v} = tritonspec_backends.{v}.backend" for v in _TRITON_BACKENDS],
    },
)
