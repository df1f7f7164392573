#!/usr/bin/env bash
# Creates ./.venv with a Python 3.12 interpreter found on this machine and installs fp8jax (+ test extras).
# Idempotent: re-running only reinstalls when pyproject.toml changed. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FP8JAX_VENV:-.venv}
STAMP="$VENV/.fp8jax-installed"

find_python312() {
  local c
  for c in "${FP8JAX_PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if PYENV_VERSION="${PYENV_VERSION:-3.12.1}" "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
        >/dev/null 2>&1; then
      PYENV_VERSION="${PYENV_VERSION:-3.12.1}" "$c" -c 'import sys; print(sys.executable)'
      return 0
    fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY=$(find_python312); then
    echo "setup.sh: fp8jax needs Python 3.12 (jax 0.11.2 does not support older Pythons) and none was found." >&2
    echo "  looked for: \$FP8JAX_PYTHON, python3.12 on PATH, ~/.pyenv/versions/3.12*/bin/python3.12, /usr/bin/python3.12" >&2
    echo "  install one (e.g. 'pyenv install 3.12') or point FP8JAX_PYTHON at it." >&2
    exit 1
  fi
  echo "setup.sh: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  touch "$STAMP"
fi
