#!/usr/bin/env bash
# Line and branch coverage of fusionguard/ by the test suite, with coverage.py: every xdist worker
# and every child Python a test starts (torchrun workers, the crash scripts, pytester's inner
# sessions) included, through setup.cfg's [coverage:run] (parallel, branch, patch = subprocess).
#
#   benchmarks/test_coverage.sh                 # this checkout, README's test command
#   benchmarks/test_coverage.sh OTHER_TREE      # another checkout (an older commit), measured
#                                               # with THIS checkout's coverage settings
#   benchmarks/test_coverage.sh . tests/test_api.py   # extra arguments go to pytest
#
# A fresh Inductor cache each time (cold, as README's command on a fresh clone). Prints the
# totals and writes coverage.json and the text report to the output folder it names.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tree=$(cd "${1:-$here}" && pwd)
shift || true
out=$(mktemp -d /tmp/fusionguard-coverage.XXXXXX)
export COVERAGE_RCFILE="$here/setup.cfg" COVERAGE_FILE="$out/.coverage"
export TORCHINDUCTOR_CACHE_DIR="$out/inductor" PYTHONPATH="$tree"
cd "$tree" || exit 2
start=$SECONDS
python -m coverage run -m pytest -q -p no:cacheprovider "$@" >"$out/pytest.log" 2>&1
status=$?
tail -3 "$out/pytest.log"
echo "coverage: pytest exited $status after $((SECONDS - start)) s ($(git -C "$tree" rev-parse --short HEAD 2>/dev/null), torch $(python -c 'import torch; print(torch.__version__)'))"
python -m coverage combine -q
python -m coverage report >"$out/report.txt"
python -m coverage json -q -o "$out/coverage.json"
python - "$out/coverage.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["totals"]
print(f"coverage: lines {t['covered_lines']}/{t['num_statements']} ({100 * t['covered_lines'] / t['num_statements']:.1f} %), "
      f"branches {t['covered_branches']}/{t['num_branches']} ({100 * t['covered_branches'] / max(t['num_branches'], 1):.1f} %), "
      f"combined {t['percent_covered']:.1f} %")
PY
echo "coverage: details in $out (report.txt, coverage.json, pytest.log)"
exit $status
