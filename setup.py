"""tritonspec: backend specialization hooks for stock Triton, vendor backends, LLM kernels."""
from setuptools import find_packages, setup

_BACKENDS = find_packages("third_party")

setup(
    name="tritonspec",
    version="0.1.0",
    description="FlagTree-style backend specialization installed into stock Triton, plus LLM kernels",
    python_requires=">=3.10",
    package_dir={"tritonspec": "python/tritonspec", "tritonspec_backends": "third_party"},
    packages=(["tritonspec"] + ["tritonspec." + p for p in find_packages("python/tritonspec")] +
              ["tritonspec_backends"] + ["tritonspec_backends." + p for p in _BACKENDS]),
    package_data={"tritonspec": ["py.typed"]},
    install_requires=[
        "triton>=3.6,<3.10",
        "torch>=2.11",
        # triton 3.6's interpreter breaks on numpy 2.4 (int(ndarray) in __index__); 3.7+ is fine.
        "numpy<2.4",
        "pyyaml",
    ],
    extras_require={"test": ["pytest", "lit", "transformers>=4.57", "kernels>=0.17"]},
    entry_points={
        "console_scripts": ["tritonspec=tritonspec.cli:main"],
        # Importing any of these during Triton's backend discovery activates the hooks.
        "tritonspec.specs": [
            "nvidia = tritonspec_backends.nvidia.backend.spec",
            "amd = tritonspec_backends.amd.backend.spec",
            "iluvatar = tritonspec_backends.iluvatar.backend.spec",
            "ascend = tritonspec_backends.ascend.backend.spec",
            "cpu = tritonspec_backends.cpu.backend.spec",
        ],
        # New Triton backends (nvidia and amd stay the stock ones): each names a package with
        # compiler.py / driver.py, imported during Triton's backend discovery.
        "triton.backends": [
            "iluvatar = tritonspec_backends.iluvatar.backend",
            "ascend = tritonspec_backends.ascend.backend",
        ],
    },
)
