#!/usr/bin/env bash
# Sourced by the other tools: finds a Python >= 3.12, creates .venv beside the repo and installs the project with the
# extras named in MOE_JAX_EXTRAS (default "test,notebooks") whenever pyproject.toml changed since the last install.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv"
extras=${MOE_JAX_EXTRAS:-test,notebooks}

python_ok() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local candidate version
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null && python_ok "$candidate"; then echo "$candidate"; return; fi
  done
  # The CI machines' default python3 is 3.11; a 3.12 interpreter is installed through pyenv.
  if command -v pyenv >/dev/null; then
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -rV); do
      candidate="$(pyenv root)/versions/$version/bin/python3"
      if python_ok "$candidate"; then echo "$candidate"; return; fi
    done
  fi
  echo "error: no Python >= 3.12 found (jax 0.11 needs it); install one or put it on PATH" >&2
  return 1
}

if [ ! -x "$venv/bin/python" ] || ! python_ok "$venv/bin/python"; then
  py=$(find_python)
  echo "creating $venv with $($py --version)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
stamp="$venv/.installed-$(cat "$repo/pyproject.toml" | cksum | cut -d' ' -f1)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  echo "installing moe_jax[$extras] into $venv" >&2
  "$venv/bin/python" -m pip install -q -e "$repo[$extras]"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$repo"
