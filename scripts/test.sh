#!/usr/bin/env bash
# Run the linter and the test tiers, each tier a pytest run of its own with its wall time.
#
#   scripts/test.sh                      # fast tier, then ci tier (what CI runs)
#   scripts/test.sh --tier fast          # one tier: fast | ci | slow, or a list (fast,ci), or all
#   scripts/test.sh --tier ci -x -k pp   # arguments after the options go to pytest (a -m there
#                                        # replaces the tier's marker expression)
#
# Tiers (markers; tests/conftest.py enforces the engine mark):
#   fast  -m "not engine and not slow"   no vLLM engine, no server
#   ci    -m "engine and not slow"       starts a vLLM engine or a server
#   slow  -m "slow"                      soak, fuzz, grid repeats: not in CI's default run
#
# Sets up .venv first if needed (scripts/setup.sh --with-retrieval-tests). Prints one line per tier and a table of wall
# times; the last line sums the tiers ("N passed, N failed, N skipped"). Exits non-zero if ruff
# or any tier fails, and when a tier collected no test (pytest's exit code 5): an empty run is
# not a pass.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
export VENV

tiers="fast,ci"
if [[ "${1:-}" == "--tier" ]]; then
    tiers="${2:?--tier needs fast, ci, slow, all or a comma-separated list}"
    shift 2
elif [[ "${1:-}" == --tier=* ]]; then
    tiers="${1#--tier=}"
    shift
fi
[[ "$tiers" == "all" ]] && tiers="fast,ci,slow"
IFS=, read -r -a tier_list <<< "$tiers"

tier_expr() {
    case "$1" in
        fast) echo "not engine and not slow" ;;
        ci) echo "engine and not slow" ;;
        slow) echo "slow" ;;
        *) echo "test.sh: unknown tier '$1' (fast, ci, slow, all)" >&2; return 2 ;;
    esac
}
for tier in "${tier_list[@]}"; do tier_expr "$tier" > /dev/null; done

rows=()  # "name|result|seconds"
start=$SECONDS
"$ROOT/scripts/setup.sh" --with-retrieval-tests  # the retrieval tests' references too
rows+=("setup|ok|$((SECONDS - start))")
cd "$ROOT"

status=0
echo "==> ruff check src tests"
start=$SECONDS
ruff_status=0
"$VENV/bin/ruff" check src tests || ruff_status=$?
rows+=("ruff|$( ((ruff_status == 0)) && echo ok || echo "failed (exit $ruff_status)")|$((SECONDS - start))")
status=$ruff_status

passed=0 failed=0 skipped=0
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for tier in "${tier_list[@]}"; do
    expr="$(tier_expr "$tier")"
    echo "==> tier $tier: pytest -m \"$expr\" $*"
    start=$SECONDS
    set +e
    "$VENV/bin/python" -m pytest -m "$expr" "$@" 2>&1 | tee "$log"
    tier_status=${PIPESTATUS[0]}
    set -e
    took=$((SECONDS - start))
    # pytest's closing line, e.g. "==== 3 failed, 212 passed, 2 skipped in 241.07s ===="
    summary="$(grep -E ' in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')"
    count() { grep -oE "[0-9]+ $1" <<< "$summary" | grep -oE '^[0-9]+' | head -n 1 || true; }
    p=$(count passed); f=$(count failed); e=$(count 'errors?'); s=$(count skipped)
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0} + ${e:-0}))
    skipped=$((skipped + ${s:-0}))
    result="${summary% in *}"
    if (( tier_status == 5 )); then
        result="no tests collected (exit 5): a failure"
        failed=$((failed + 1))
    elif (( tier_status != 0 )); then
        result="${result:-pytest exit $tier_status} (exit $tier_status)"
    fi
    echo "==> tier $tier: ${result:-no summary} in $took s"
    rows+=("$tier|$result|$took")
    if (( status == 0 && tier_status != 0 )); then status=$tier_status; fi
done

echo "==> wall time per step"
total=0
for row in "${rows[@]}"; do
    IFS='|' read -r name result secs <<< "$row"
    printf '  %-6s %6d s  %s\n' "$name" "$secs" "$result"
    total=$((total + secs))
done
printf '  %-6s %6d s\n' "total" "$total"
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
