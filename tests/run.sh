#!/usr/bin/env bash
# The test suite on every supported Triton release: all of it on the default install (the latest, 3.9)
# in .venv, then what depends on Triton's release (the spec layer, backends and offline compiles) on the
# newest 3.6.x (the GPU machines' release), 3.7.x and 3.8.x, each in a venv of its own (.venv-triton36,
# -37, -38) that this script creates and installs the same way. The kernels run in the interpreter on
# 3.9 and on 3.6, the two ends of the range; model integration (tests/test_nn_*, offloading,
# distributed), the README's examples and the package layout reach Triton only through those kernels,
# or not at all: once is enough. `tritonspec check` runs in every release's tests (test_spec_layer).
# Then, once, `tritonspec check --kernels`: every kernel compiled for every backend target at model
# shapes, against the targets' limits (minutes: the longest single step).
# Test files run in parallel, one worker per CPU, each file whole in one worker (module fixtures).
# First the linter and the formatter (ruff.toml), as CI enforces them.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== ruff (lint, format)"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
export TRITON_DEFAULT_FP_FUSION=1
PYTEST=(-m pytest -q -n auto --dist loadfile)
release=$(.venv/bin/python -c 'from importlib.metadata import version; print(version("triton"))')
echo "== triton $release (.venv, every test)"
.venv/bin/python "${PYTEST[@]}"
for version in 3.6.0 3.7.1 3.8.0; do
  venv=.venv-triton$(echo "$version" | cut -d. -f1-2 | tr -d .)
  echo "== triton $version ($venv)"
  if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
  "$venv/bin/pip" install -q torch==2.13.0 "triton==$version" -e '.[test]'
  kernels=()
  if [ "$version" != 3.6.0 ]; then
    kernels=(--ignore=tests/test_attention.py --ignore=tests/test_attention_bounds.py --ignore=tests/test_moe.py
             --ignore=tests/test_moe_decode.py --ignore=tests/test_moe_routing.py
             --ignore=tests/test_rms_norm.py --ignore=tests/test_linear_cross_entropy.py --ignore=tests/test_rope.py
             --ignore=tests/test_swiglu.py)
  fi
  "$venv/bin/python" "${PYTEST[@]}" --ignore-glob='tests/test_nn_*' --ignore-glob='tests/test_offload*' \
    --ignore=tests/test_distributed.py --ignore=tests/test_readme.py --ignore=tests/test_layout.py "${kernels[@]}"
done
echo "== tritonspec check --kernels (triton $release)"
.venv/bin/tritonspec check --kernels
