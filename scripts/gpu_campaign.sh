#!/usr/bin/env bash
# One window of a GPU campaign (docs/paper-scale.md, "The H200 campaign"), by default config/h200.yaml:
#   scripts/gpu_campaign.sh --minutes 8          on a GPU machine: the most valuable runs that
#                                                 results/reference/h200/ lacks, stopped cleanly before 8 minutes
#   scripts/gpu_campaign.sh --cpu --minutes 3    the same campaign on the CPU (the test suite runs a window of it)
#   scripts/gpu_campaign.sh --config config/learning_gpu.yaml --reference results/reference/h200-learning --minutes 8
# What finished is packed into one archive, results/campaign/campaign.tar.gz (AGG_BENCH_CAMPAIGN_OUT changes the
# folder); add it to the reference with
#   agg-bench campaign unpack --config config/h200.yaml --archive results/campaign/campaign.tar.gz \
#       --reference results/reference/h200
# Python: the project's .venv, set up first by scripts/setup.sh as `make` does; PYTHON=/path/to/python runs
# another interpreter that has agg-bench's requirements (the repository is put on its path). A missing
# environment (no torch, no agg-bench or another of its requirements, no CUDA device without --cpu) or a bad
# option is one line and exit code 2, before anything is run or written. It runs from any folder: --config,
# --reference, AGG_BENCH_CAMPAIGN_OUT and AGG_BENCH_CAMPAIGN_REFERENCE are paths from the folder it is started
# in, their defaults paths in the repository.
set -uo pipefail
STARTED=$(date +%s.%N)  # the window's clock: checking the environment counts against --minutes

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# a path relative to the folder the script is started in, as the campaign (run in the repository) finds it; from
# the repository as it is (the window log records --config as given); one that starts with a ~ no shell expanded
# as it is, for the campaign to refuse (under the start folder it named a folder called ~)
START_DIR=$(pwd)
here() {
  if [[ -z "$1" || "$1" == /* || "$1" == "~"* || "$(pwd -P)" == "$ROOT" ]]; then printf '%s' "$1"
  else printf '%s' "$START_DIR/$1"; fi
}
MODE=gpu
MINUTES=
CONFIG=config/h200.yaml
REFERENCE=$(here "${AGG_BENCH_CAMPAIGN_REFERENCE:-}")
REFERENCE=${REFERENCE:-results/reference/h200}
USAGE="usage: scripts/gpu_campaign.sh [--cpu] [--config FILE] [--reference DIR] --minutes N"
usage() { echo "gpu_campaign: $1; $USAGE" >&2; exit 2; }
# each option with a value once, as agg-bench's own: a second --minutes (say) replaced the first without a word
once() {  # once OPTION ARGS_LEFT VALUE: GIVEN_<option> holds the value given
  local var=GIVEN_${1#--}
  [[ $2 -ge 2 ]] || usage "$1 needs a value"
  [[ -z "${!var+x}" ]] || usage "$1 given twice ('${!var}', then '$3'); expected it once"
  printf -v "$var" '%s' "$3"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) MODE=cpu; shift ;;
    --minutes) once "$1" $# "${2-}"; MINUTES=$2; shift 2 ;;
    --config) once "$1" $# "${2-}"; CONFIG=$(here "$2"); shift 2 ;;
    --reference) once "$1" $# "${2-}"; REFERENCE=$(here "$2"); shift 2 ;;
    *) usage "unknown option '$1'" ;;
  esac
done
[[ -n "${GIVEN_minutes+x}" ]] || usage "--minutes N is required (the window's length in minutes)"
# WORK, not OUT: an OUT that the caller exports (the folder a machine collects a command's files from) stays as
# it is for every process the window starts
WORK=$(here "${AGG_BENCH_CAMPAIGN_OUT:-}")
WORK=${WORK:-results/campaign}
# shellcheck source=scripts/python_env.sh
source "$ROOT/scripts/python_env.sh" || exit 2
pick_python gpu_campaign "agg-bench's requirements" torch diffusers agg_bench
# every other module a window's processes import: one missing (peft, say) failed only the runs that reach it,
# minutes in
require_modules gpu_campaign "agg-bench's requirements" peft safetensors numpy yaml jsonschema pandas PIL tqdm
# errors about the work folder name AGG_BENCH_CAMPAIGN_OUT, which this script's user sets, not --work; errors about
# the reference name AGG_BENCH_CAMPAIGN_REFERENCE where that variable set it (no --reference given to this script)
ARGS=(--config "$CONFIG" --minutes "$MINUTES" --started "$STARTED" --work "$WORK" --work-name AGG_BENCH_CAMPAIGN_OUT
      --reference "$REFERENCE")
if [[ -z "${GIVEN_reference+x}" && -n "${AGG_BENCH_CAMPAIGN_REFERENCE:-}" ]]; then
  ARGS+=(--reference-name AGG_BENCH_CAMPAIGN_REFERENCE)
fi
if [[ $MODE == gpu ]]; then
  require_cuda gpu_campaign "run scripts/gpu_campaign.sh --cpu on a machine without one, or install torch's CUDA build"
else
  ARGS+=(--cpu)
fi
cd "$ROOT" && exec "$PY" -m agg_bench campaign run "${ARGS[@]}"
