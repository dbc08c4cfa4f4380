#!/usr/bin/env bash
# make test: the whole suite as two pytest processes side by side, one core and one OpenMP thread each.
#
# One pytest process keeps about one core busy (most tests wait for a process they started, or run small
# tensors on one thread), so on two cores the suite's wall time halves when it runs as two streams of about
# equal length: tests/unit with the integration files that each run one long process chain (the learning
# run, the GPU check script, the cells' runs), and the rest of tests/integration (measured
# on a fresh clone on a quiet 2-core AMD EPYC: 11 min 4 s each with 3,792 tests in all; 13 min 39 s and 13 min 2 s with
# 3,897 on a slower day of the host; 12 min 7 s and 12 min 28 s with 3,910; 14 min 37 s and 15 min 4 s with 3,988 on
# a day the pipeline's work took 460 CPU-s, against 404; 12 min 25 s and 12 min 26 s with 4,029 on a day it took
# 456; 13 min 27 s and 13 min 38 s with 4,124 on a day it took 446; 8 min 24 s and 9 min 1 s, then 9 min 16 s
# and 9 min 39 s, with 4,227 on a day it took 333 and 293). Each stream runs with OMP_NUM_THREADS=1 unless it is set (the suite passes at any thread count). With fewer
# than two usable cores the streams run one after the other. Arguments go to both streams (make test
# PYTEST_ARGS="-m 'not slow'"); a stream whose selection is empty counts as passed. The second stream's report follows the first's.
set -uo pipefail
# no set -e (a failed stream must not stop the other), so a failed cd stops here, not pytest in the wrong folder
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the tests start snakemake, which needs a cache folder it can make
# shellcheck source=scripts/caches.sh
source scripts/caches.sh
home_caches
LONG=(tests/integration/test_learning.py tests/integration/test_gpu_check.py tests/integration/test_cell.py)

first=(tests/unit "${LONG[@]}")
second=(tests/integration)
for file in "${LONG[@]}"; do second+=("--ignore=$file"); done

passed() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: pytest collected nothing

# a file for a report printed later; a TMPDIR that names no folder fails mktemp (Python's tempfile, which the
# tests use, takes /tmp then), and what was to write there never ran
report_file() {
  mktemp 2>/dev/null || mktemp -p /tmp || { echo "test.sh: cannot make a temporary file in TMPDIR or /tmp" >&2; exit 2; }
}

# AGG_BENCH_TEST_LINT (make test's ruff, shellcheck and mypy: one shell command) runs beside the streams, its
# report kept in a file and printed after theirs; the suite fails when it fails. Not passed on to the streams:
# the tests that run this script in a stand-in clone would run it there
lint=${AGG_BENCH_TEST_LINT:-}
unset AGG_BENCH_TEST_LINT
pid="" log="" lint_pid="" lint_log=""
trap 'kill $pid $lint_pid 2>/dev/null; rm -f "$log" "$lint_log"; exit 130' INT TERM  # background jobs ignore SIGINT
if [ -n "$lint" ]; then
  lint_log=$(report_file) || exit 2
  bash -c "$lint" >"$lint_log" 2>&1 &
  lint_pid=$!
fi
lint_report() {  # wait for the lint steps and print their report; their exit code (0 without them)
  [ -n "$lint_pid" ] || return 0
  wait "$lint_pid"; local code=$?
  echo "----- lint: $lint -----"
  cat "$lint_log"
  rm -f "$lint_log"
  [ "$code" -eq 0 ] || echo "test.sh: the lint steps failed (exit $code)"
  return "$code"
}

cores=$("$PYTHON" -c "import os; print(len(os.sched_getaffinity(0)))" 2>/dev/null || echo 1)
if [ "$cores" -lt 2 ]; then
  "$PYTHON" -m pytest -q "${first[@]}" "$@"; a=$?
  "$PYTHON" -m pytest -q "${second[@]}" "$@"; b=$?
else
  log=$(report_file) || { kill $lint_pid 2>/dev/null; exit 2; }  # the second stream's report
  "$PYTHON" -m pytest -q "${second[@]}" "$@" >"$log" 2>&1 &
  pid=$!
  "$PYTHON" -m pytest -q "${first[@]}" "$@"; a=$?
  wait "$pid"; b=$?
  echo "----- ${second[*]} -----"
  cat "$log"
  rm -f "$log"
fi
lint_report; l=$?
trap - INT TERM
passed "$a" && passed "$b" && [ "$l" -eq 0 ]
