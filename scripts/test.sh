#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. GPU tests skip without a GPU. Extra args go to pytest.
# Two worker processes (pytest-xdist; FP8JAX_TEST_WORKERS=N for another count, 0 for one process): most of the
# suite's time is XLA:CPU compiling, one core per compile, so two workers on CI's two cores cut the wall time.
# The 25 slowest tests are listed at the end (--durations): where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra --durations=25 -n "${FP8JAX_TEST_WORKERS:-2}" --dist worksteal tests "$@"
