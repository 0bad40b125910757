#!/usr/bin/env bash
# `source tools/env.sh` prepares the project's virtual environment and puts it first on PATH (the other tools do this).
# It finds a Python >= 3.12 (3.12 first: the GPU machine's version), creates .venv beside the repo, and installs the
# project with the extras in MOE_JAX_EXTRAS (default "test,notebooks,train") whenever pyproject.toml changed since the
# last install. The caller's shell options and working directory are left as they were; MOE_JAX_REPO names the repo.

MOE_JAX_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MOE_JAX_REPO

# A subshell function: `set -e` and friends stay inside it.
_moe_jax_prepare_venv() (
  set -euo pipefail
  venv="$MOE_JAX_REPO/.venv"
  extras=${MOE_JAX_EXTRAS:-test,notebooks,train}

  python_ok() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

  find_python() {
    # The CI machines' default python3 is 3.11; newer interpreters are installed through pyenv, whose shims fail
    # for a version that is not selected, so the interpreters are also looked up in pyenv's versions folder.
    local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv} candidate
    for candidate in python3.12 "$pyenv_root"/versions/3.12*/bin/python3 python3.13 \
      "$pyenv_root"/versions/3.1[3-9]*/bin/python3 python3; do
      if python_ok "$candidate"; then echo "$candidate"; return; fi
    done
    echo "error: no Python >= 3.12 found (jax 0.11 needs it); install one or put it on PATH" >&2
    return 1
  }

  if [ ! -x "$venv/bin/python" ] || ! python_ok "$venv/bin/python"; then
    py=$(find_python)
    echo "creating $venv with $("$py" --version)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
  fi
  stamp="$venv/.installed-$(cksum <"$MOE_JAX_REPO/pyproject.toml" | cut -d' ' -f1)-${extras//,/_}"
  if [ ! -f "$stamp" ]; then
    echo "installing moe_jax[$extras] into $venv" >&2
    "$venv/bin/python" -m pip install -q -e "$MOE_JAX_REPO[$extras]"
    rm -f "$venv"/.installed-*
    touch "$stamp"
  fi
)

_moe_jax_prepare_venv && export PATH="$MOE_JAX_REPO/.venv/bin:$PATH"
