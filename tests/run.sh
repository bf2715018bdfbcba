#!/usr/bin/env bash
# The test suite on every supported Triton release: the default install (the latest, 3.9) in .venv,
# then the newest 3.6.x (the GPU machines' release), 3.7.x and 3.8.x, each in a venv of its own
# (.venv-triton36, -37, -38) that this script creates and installs the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_DEFAULT_FP_FUSION=1
.venv/bin/python -m pytest -q
for version in 3.6.0 3.7.1 3.8.0; do
  venv=.venv-triton$(echo "$version" | cut -d. -f1-2 | tr -d .)
  echo "== triton $version ($venv)"
  if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
  "$venv/bin/pip" install -q torch==2.13.0 "triton==$version" -e '.[test]'
  "$venv/bin/tritonspec" check > /dev/null
  "$venv/bin/python" -m pytest -q
done
