# shellcheck shell=bash
# Sourced by scripts/gpu_check.sh and scripts/gpu_campaign.sh (not run on its own): the interpreter a script
# runs, and the checks that make a missing environment one line and exit code 2 before anything is written.
# Needs ROOT (the repository) set by the caller.

# pick_python NAME NEEDS MODULE...: sets PY to $PYTHON when it is set, else to the project's .venv after
# scripts/setup.sh (fast when it is already set up); exits 2 with one line when setting up fails or PY cannot
# import every MODULE. NEEDS says in that line what the interpreter must have. With PYTHON, the repository is put
# first on PYTHONPATH (exported, for every process the script starts): the tree, not an install, as on a GPU
# machine that gets the tree copied and agg-bench's requirements as wheels, from whatever folder it is started in.
pick_python() {
  local name=$1 needs=$2 fix missing words
  shift 2
  if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
    # a relative path to an interpreter, absolute: the scripts run it again after they change folder
    [[ $PY != */* || $PY == /* ]] || PY=$PWD/$PY
    fix="set PYTHON to an interpreter with $needs, or unset it to use $ROOT/.venv"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  else
    bash "$ROOT/scripts/setup.sh" || {
      echo "$name: setting up $ROOT/.venv failed (bash scripts/setup.sh, exit $?; see its message above)" >&2
      exit 2; }
    PY=$ROOT/.venv/bin/python
    fix="run bash scripts/setup.sh (or set PYTHON to an interpreter with $needs)"
  fi
  words=${*: -1}  # "torch, diffusers and agg_bench"
  if [[ $# -gt 1 ]]; then words="$(printf '%s, ' "${@:1:$#-1}")" && words="${words%, } and ${*: -1}"; fi
  if ! missing=$("$PY" -c "import $(IFS=,; echo "$*")" 2>&1); then
    echo "$name: $PY cannot import $words ($(printf '%s\n' "$missing" | tail -n 1)); $fix" >&2
    exit 2
  fi
}

# require_modules NAME NEEDS MODULE...: exits 2 with one line when PY has no MODULE to import; each is found, not
# imported (importing peft and pandas took seconds of a window's clock), so call pick_python first.
require_modules() {
  local name=$1 needs=$2 missing
  shift 2
  if ! missing=$("$PY" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if u.find_spec(m) is None))' \
                 "$@" 2>&1); then
    echo "$name: $PY could not look for its modules ($(printf '%s\n' "$missing" | tail -n 1)); set PYTHON to an" \
         "interpreter with $needs" >&2
    exit 2
  fi
  if [[ -n "$missing" ]]; then
    echo "$name: $PY cannot import ${missing// /, } (ModuleNotFoundError); set PYTHON to an interpreter with $needs" >&2
    exit 2
  fi
}

# require_cuda NAME ADVICE: exits 2 with one line when PY's torch sees no CUDA device; ADVICE ends that line.
# One interpreter start gives both the version and the answer (an import of torch takes seconds).
require_cuda() {
  local version
  if ! version=$("$PY" -c 'import sys, torch; print(torch.__version__); sys.exit(not torch.cuda.is_available())' \
                 2>/dev/null); then
    echo "$1: torch $version in $PY sees no CUDA device; $2" >&2
    exit 2
  fi
}
