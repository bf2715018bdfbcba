#!/usr/bin/env bash
# The test suite on both supported Triton releases: the default install (latest, 3.9) in .venv,
# then triton 3.6.0 (the GPU machines' release) in .venv-triton36, which this script creates.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION=1
.venv/bin/python -m pytest -q
if [ ! -x .venv-triton36/bin/python ]; then python3 -m venv .venv-triton36; fi
.venv-triton36/bin/pip install -q torch==2.13.0 triton==3.6.0 -e '.[test]'
.venv-triton36/bin/tritonspec check > /dev/null
.venv-triton36/bin/python -m pytest -q
