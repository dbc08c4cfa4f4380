#!/usr/bin/env bash
# Creates .venv (if missing) and installs agg-bench with the pinned versions. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test,workflow,slurm,gpu,models,clipscore}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.agg-bench-installed
want="$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -c1-16) $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and alone: on a CPU-only machine this takes the CPU build instead of a CUDA one.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -c requirements/constraints.txt -e ".[$EXTRAS]"
echo "$want" > "$stamp"
