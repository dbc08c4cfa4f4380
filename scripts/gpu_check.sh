#!/usr/bin/env bash
# One-shot check of every GPU code path, and the paper-scale numbers that matter, in a few minutes:
#   scripts/gpu_check.sh          on one GPU: SD3.5-Medium with random weights (nothing downloaded)
#   scripts/gpu_check.sh --cpu    the same steps on the tiny models on the CPU (the test suite runs this)
# Steps: the environment record; full and AGG W=5 without and with rollout-velocity reuse at two
# resolutions (train-phase time, CUDA and NVML peaks, energy, saved activations against the planner's
# prediction; bf16 autocast on the GPU); a cached rollout; FSDP (train.shard fsdp) under torchrun with one
# process (nccl on the GPU, gloo on the CPU); a run through the GPU pool; a profile with the CUDA memory
# snapshot. On the GPU each training run has a process of its own (its own peaks); --cpu runs the seven that
# need no launcher of their own in one `agg_bench cell` process, each still a step, and the pool's command
# there checks the device and lock it was given (a run under it would repeat the FSDP step's); its profile is of a
# smaller update (5 steps of 2 images: one AGG group). Writes
# results/gpu_check/summary.json and summary.md in the repository, from whatever folder it is started in
# (AGG_BENCH_CHECK_OUT changes the folder, a path from the folder it is started in; it is removed first, so one that
# holds anything but an earlier check's output is refused, exit code 2) and exits 1 if any step failed.
# Python: the project's .venv, set up first by scripts/setup.sh as `make` does (fast when it is already
# set up); PYTHON=/path/to/python runs another interpreter that has agg-bench's requirements instead (the
# repository is put on its path). A missing
# environment (no torch, no agg-bench, no CUDA device for the GPU check) is one line and exit code 2,
# before anything is run or written.
set -uo pipefail

MODE=gpu
# one argument at most: a second (--cpu --cpu, --cpu --gpu) was dropped without a word
if [[ $# -gt 1 || ( $# -eq 1 && "$1" != "--cpu" ) ]]; then
  echo "gpu_check: $(if [[ $# -gt 1 ]]; then echo "$# arguments ($*), expected at most one"; else echo "unknown \
argument '$1'"; fi); usage: scripts/gpu_check.sh [--cpu]" >&2; exit 2
fi
[[ $# -eq 0 ]] || MODE=cpu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# the repository's, wherever the script is started: a default relative to the current folder wrote (and first
# removed) a results/gpu_check under whatever folder that was
OUT=${AGG_BENCH_CHECK_OUT:-$ROOT/results/gpu_check}
# shellcheck source=scripts/python_env.sh
source "$ROOT/scripts/python_env.sh" || exit 2
pick_python gpu_check "agg-bench's requirements" torch agg_bench
if [[ $MODE == gpu ]]; then
  require_cuda gpu_check "run scripts/gpu_check.sh --cpu on a machine without one, or install torch's CUDA build \
(TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh)"
fi
# the folder is removed whole: one that holds anything but an earlier check's output is refused, not emptied
"$PY" -m agg_bench.tools.gpucheck --check-out "$OUT" || exit 2
rm -rf "$OUT"
mkdir -p "$OUT/runs" "$OUT/logs"
: > "$OUT/steps.tsv"

COMMON=(--set model.family=sd3 --set sampling.steps=10 --set grpo.group_size=4 --set grpo.prompts_per_iteration=1
        --set train.plan=groups --set train.plan_window=5 --set train.timestep_fraction=1.0
        --set progress=false --set telemetry.saved_activations=every)
if [[ $MODE == gpu ]]; then
  COMMON+=(--set device=cuda --set model.dtype=bfloat16 --set model.preset=random --set model.architecture=sd3.5-medium)
  RESOLUTIONS=(512 1024)
  ITERATIONS=3
  PROFILE=()
else
  COMMON+=(--set device=cpu --set model.dtype=float32 --set model.preset=tiny)
  RESOLUTIONS=(32 64)
  ITERATIONS=2
  # the profile's update on the CPU is smaller, through the same code: 5 steps (one AGG group of W=5) of 2 images,
  # since torch's parse of the profiler's events, most of the step's cost, grows with them
  PROFILE=(--set sampling.steps=5 --set grpo.group_size=2)
fi
SMALL=${RESOLUTIONS[0]}

# step NAME COMMAND...: run it, log to $OUT/logs/NAME.log, record its exit code
step() {
  local name=$1; shift
  local log="$OUT/logs/$name.log"
  echo "gpu_check: $name" >&2
  "$@" > "$log" 2>&1
  local code=$?
  printf '%s\t%s\t%s\n' "$name" "$code" "$log" >> "$OUT/steps.tsv"
  [[ $code -eq 0 ]] || echo "gpu_check: $name FAILED (exit $code, see $log)" >&2
}
run() {  # run NAME [--set ...]: one training run into $OUT/runs/NAME
  local name=$1; shift
  if [[ $MODE == gpu ]]; then
    step "$name" "$PY" -m agg_bench run "${COMMON[@]}" --set train.iterations=$ITERATIONS "$@" --out "$OUT/runs/$name"
  else  # the same run's entry in the cell job that run_cell runs
    CELL+=("$name")
    "$PY" -c 'import json, sys; assert set(sys.argv[2::2]) == {"--set"}, sys.argv[2:]
print(json.dumps({"config": None, "set": sys.argv[3::2], "out": sys.argv[1]}))' \
        "$OUT/runs/$name" "${COMMON[@]}" --set train.iterations=$ITERATIONS "$@" >> "$OUT/cell.jsonl"
  fi
}
# run_cell (--cpu): the runs queued by run, one after the other in one process (`agg_bench cell`, as the
# workflow's cell jobs run them), which imports torch and diffusers once where each run's process spent most
# of its time doing so; each run is then a step of its own, ok when its summary.json says so
CELL=()
run_cell() {
  local log="$OUT/logs/cell.log" cell_code code name
  echo "gpu_check: ${CELL[*]} (one process)" >&2
  { printf '{"runs": ['; paste -sd, "$OUT/cell.jsonl"; printf ']}\n'; } > "$OUT/cell.json"
  "$PY" -m agg_bench cell "$OUT/cell.json" > "$log" 2>&1
  cell_code=$?
  for name in "${CELL[@]}"; do
    code=0
    "$PY" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["status"] != "ok")' \
        "$OUT/runs/$name/summary.json" 2>/dev/null || code=$(( cell_code ? cell_code : 1 ))
    printf '%s\t%s\t%s\n' "$name" "$code" "$log" >> "$OUT/steps.tsv"
    [[ $code -eq 0 ]] || echo "gpu_check: $name FAILED (exit $code, see $log)" >&2
  done
}

# the inner sh expands $0 and $1 (the interpreter and the file), not this script
# shellcheck disable=SC2016
step env sh -c '"$0" -m agg_bench env > "$1"' "$PY" "$OUT/env.json"
for res in "${RESOLUTIONS[@]}"; do
  run "full_${res}" --set model.resolution="$res" --set 'method={"name": "full"}'
  run "agg-w5_${res}" --set model.resolution="$res" --set 'method={"name": "agg", "window": 5, "alpha": "sigma"}'
  run "agg-w5-reuse_${res}" --set model.resolution="$res" \
      --set 'method={"name": "agg", "window": 5, "alpha": "sigma", "reuse_rollout_velocity": true}'
done
run "cached-fora_${SMALL}" --set model.resolution="$SMALL" --set 'method={"name": "cached", "cache": "fora", "cache_in": "rollout"}'
[[ $MODE == gpu ]] || run_cell
step "fsdp_${SMALL}" "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m agg_bench run "${COMMON[@]}" \
    --set train.iterations=1 --set model.resolution="$SMALL" --set train.shard=fsdp --out "$OUT/runs/fsdp_${SMALL}"
if [[ $MODE == gpu ]]; then
  step "pool_${SMALL}" "$PY" -m agg_bench.machine.gpus --count 1 --timeout 60 -- "$PY" -m agg_bench run "${COMMON[@]}" \
      --set train.iterations=1 --set model.resolution="$SMALL" --out "$OUT/runs/pool_${SMALL}"
else  # a pretend one-GPU machine: the pool's locking and what it hands its command. The command checks them
  # itself: on the CPU a run there would only repeat the fsdp step's `agg_bench run` (and import the model code
  # again), so it checks that it sees device 0 as the pool sets it and holds device 0's lock (a second try fails)
  step "pool_${SMALL}" env AGG_BENCH_GPUS=1 AGG_BENCH_GPU_LOCK_DIR="$OUT/locks" "$PY" -m agg_bench.machine.gpus --count 1 \
      --timeout 60 -- "$PY" -c 'import os
from agg_bench.machine.gpus import GpuPool
seen = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
assert seen == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, seen
assert GpuPool.from_environment().try_acquire(1) is None, "the command does not hold the lock of device 0"
print("pool: CUDA_VISIBLE_DEVICES=0, the lock of device 0 held")'
fi
step "profile_${SMALL}" "$PY" -m agg_bench profile "${COMMON[@]}" "${PROFILE[@]}" --set model.resolution="$SMALL" \
    --method agg --set method.window=5 --phase train --wait 0 --warmup 0 --active 1 --out "$OUT/profile"
if [[ $MODE == gpu ]]; then
  step memory_snapshot test -s "$OUT/profile/memory_snapshot.pickle"
fi
"$PY" -m agg_bench.tools.gpucheck "$OUT" "$MODE"
