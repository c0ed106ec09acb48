#!/usr/bin/env bash
# Run the test suite and the linter.
#
#   scripts/test.sh                      # everything
#   scripts/test.sh -m "not slow" -x     # arguments go to pytest
#
# Sets up .venv first if needed (scripts/setup.sh). Exits non-zero if pytest or ruff fails, and
# also when pytest collected no test at all (pytest's exit code 5): an empty run is not a pass.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
export VENV

"$ROOT/scripts/setup.sh"
cd "$ROOT"

status=0
echo "==> ruff check src tests"
"$VENV/bin/ruff" check src tests || status=$?

echo "==> pytest $*"
pytest_status=0
"$VENV/bin/python" -m pytest "$@" || pytest_status=$?
if (( pytest_status == 5 )); then
    echo "test.sh: pytest collected no tests; that is a failure, not a pass" >&2
fi
if (( status == 0 )); then status=$pytest_status; fi
exit "$status"
