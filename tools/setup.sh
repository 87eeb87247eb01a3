#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 (JAX 0.11 needs it; 3.12 first, what the GPU machine
# runs) and installs ikbo_jax with its test extra. Extra extras as arguments, e.g.
# `bash tools/setup.sh cuda` (the CUDA plugin of the pinned jax, for the GPU kernels).
# Safe to run again: an existing .venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidate
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for version in $(pyenv versions --bare | sort -V); do
      if PYENV_VERSION="$version" python3 -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        PYENV_VERSION="$version" pyenv which python3; return 0
      fi
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! python=$(find_python); then
    echo "error: ikbo_jax needs Python >= 3.12 (for jax 0.11) and none was found on PATH or in pyenv" >&2
    exit 1
  fi
  echo "using $python ($("$python" --version))"
  "$python" -m venv .venv
fi
extras=$(IFS=,; echo "test${*:+,$*}")
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$extras]"
