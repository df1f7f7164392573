#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. GPU tests skip without a GPU. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra tests "$@"
