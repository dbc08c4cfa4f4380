#!/usr/bin/env bash
# Creates .venv (if missing) and installs agg-bench with the pinned versions. Safe to run again.
#
# torch is installed first and alone. Where no NVIDIA GPU is found it comes from PyTorch's CPU wheel
# index, because a plain `pip install torch==...` from the public index takes the multi-GB CUDA build.
#   TORCH_INDEX_URL=URL   take torch from this index instead (e.g. https://download.pytorch.org/whl/cu128)
#   TORCH_INDEX_URL=      (empty) take torch from pip's configured index, whatever the machine has
#   PYTHON=python3.12     the interpreter for the venv (3.11 or newer)
#   EXTRAS=test,workflow  the extras to install
set -euo pipefail
# no arguments: one (setup.sh --cpu, say) was dropped without a word, and the set-up that ran was the default one
if [ $# -gt 0 ]; then
  echo "setup: takes no arguments ('$*' given); set TORCH_INDEX_URL, PYTHON or EXTRAS instead (scripts/setup.sh's" \
       "first lines)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-test,workflow,slurm,gpu,models,clipscore}
TORCH_VERSION=$(sed -n 's/^torch==//p' requirements/constraints.txt)
CPU_INDEX=https://download.pytorch.org/whl/cpu

# one set-up of a clone at a time: two (two `make pipeline` started together) ran pip into the same .venv at once
# and could leave it half of each. The second waits, then finds the first one's install done (the stamp below).
# Without flock, or where the clone cannot be written (then nothing is installed either), there is no lock.
# shellcheck source=scripts/turns.sh
source scripts/turns.sh
take_turn .venv.lock "setup: another set-up of this clone is running" || true

if [ -z "${TORCH_INDEX_URL+set}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_INDEX_URL=""           # a GPU: the public index's CUDA build
  else
    TORCH_INDEX_URL=$CPU_INDEX   # no GPU: the CPU build
  fi
fi

# a .venv there already is used only when its interpreter runs and is new enough; this script never removes it
if { [ -e .venv ] || [ -L .venv ]; } && [ ! -d .venv ]; then  # a file, or a link to nothing
  echo "setup: .venv is not a folder; move it away, and this script makes the virtual environment there" >&2; exit 2
fi
if [ -e .venv/bin/python ] || [ -L .venv/bin/python ]; then
  if ! venv_version=$(.venv/bin/python -V 2>&1) || [[ $venv_version != Python\ * ]]; then
    echo "setup: .venv/bin/python does not run ($(printf '%s\n' "$venv_version" | head -n 1)); remove .venv (rm -rf .venv) and run this again" >&2; exit 2
  fi
  .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "setup: .venv has $venv_version and agg-bench needs Python 3.11 or newer; remove .venv (rm -rf .venv) and run this again (PYTHON=... chooses the interpreter)" >&2; exit 2; }
fi
stamp=.venv/.agg-bench-installed
here=$(pwd -P)
# a venv is not relocatable: its scripts' #! lines, bin/activate and the editable install name the folder it was
# made in, so one moved or copied with its clone runs the old clone's code, or nothing ("required file not found");
# the same folder under another name (a link, a bind mount) is fine
if [ -f "$stamp" ] && made_in=$(sed -n 2p "$stamp") && [ -n "$made_in" ] && [ ! "$made_in" -ef .venv ]; then
  echo "setup: .venv was made in $made_in and this clone is $here (moved or copied?); remove .venv (rm -rf .venv) and run this again" >&2; exit 2
fi
want="$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -c1-16) $EXTRAS"
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$want" ] && [ "$(sed -n 2p "$stamp")" -ef .venv ]; then
  exit 0
fi
# what follows writes: say so in one line, not as pip's or venv's traceback halfway through
if [ -d .venv ] && [ ! -w .venv ]; then
  echo "setup: cannot write in $here/.venv (permissions, or a read-only file system); run as its owner, or clone the repository where you can write" >&2; exit 2
fi
if [ ! -d .venv ] && [ ! -w . ]; then
  echo "setup: cannot write in $here, where .venv goes (permissions, or a read-only file system); clone the repository where you can write" >&2; exit 2
fi
if [ ! -x .venv/bin/python ]; then
  # `$PYTHON -V` alone passed Python 2 and printed the shell's "command not found" beside this script's line
  if ! found=$("$PYTHON" -c 'import sys; print("Python %d.%d.%d" % sys.version_info[:3]); sys.exit(sys.version_info < (3, 11))' 2>&1); then
    if [[ $found == Python\ * ]]; then
      echo "setup: agg-bench needs Python 3.11 or newer; $PYTHON is $found (set PYTHON=...)" >&2
    else
      echo "setup: PYTHON=$PYTHON does not run ($(printf '%s\n' "$found" | head -n 1)); set PYTHON to a Python 3.11 or newer" >&2
    fi
    exit 2
  fi
  venv_out=$("$PYTHON" -m venv .venv 2>&1) || {
    echo "setup: $PYTHON -m venv .venv failed ($(printf '%s\n' "$venv_out" | grep -m 1 . || true)); fix that and run this again" >&2; exit 2; }
fi
# a set-up stopped while `python -m venv` ran its ensurepip (or a venv made --without-pip) has no pip
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  .venv/bin/python -m ensurepip >/dev/null 2>&1 || {
    echo "setup: .venv has no pip and ensurepip could not install it; remove .venv (rm -rf .venv) and run this again" >&2; exit 2; }
fi
# gone until the install below completes: a set-up stopped halfway (Ctrl-C, a kill, a full disk) is never taken as done
rm -f "$stamp"
pip=(.venv/bin/python -m pip)
# `pip install ARGS` from the index $1 names; pip's messages as it writes them, but an index it could not reach
# (no network, a proxy, DNS) is one line: pip's retries wrote a screen of warnings and ended in "No matching
# distribution", which reads like a wrong version
pip_install() {
  local index=$1 errors status=0
  shift
  { errors=$("${pip[@]}" install "$@" 2>&1 1>&3 3>&-); } 3>&1 || status=$?
  if [ "$status" -ne 0 ] && grep -qE "NewConnectionError|Failed to establish a new connection|Name or service not known|Temporary failure in name resolution|ConnectTimeoutError|ReadTimeoutError|ProxyError|Network is unreachable|Max retries exceeded" <<<"$errors" \
      && grep -qE "No matching distribution found|Could not find a version|Max retries exceeded" <<<"$errors"; then
    echo "setup: pip could not reach the package index ($index): $(grep -m 1 '^ERROR' <<<"$errors" || grep -m 1 . <<<"$errors"); check the network or proxy (HTTPS_PROXY) and run this again" >&2
    exit 1
  fi
  [ -z "$errors" ] || printf '%s\n' "$errors" >&2
  return "$status"
}
PIP_INDEX="pip's index: PIP_INDEX_URL or pip.conf"
# --no-compile: pip byte-compiles what it installs one file at a time (torch alone: 5,000 files, 16 of its 24 s of
# install on a 2-core machine); compileall below does it on every core
pip_install "$PIP_INDEX" -q --upgrade pip
if .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  :  # the pinned torch is already there (CPU or CUDA build, as the machine chose before)
elif [ -n "$TORCH_INDEX_URL" ]; then
  echo "setup: torch $TORCH_VERSION from $TORCH_INDEX_URL (set TORCH_INDEX_URL to choose another index)" >&2
  # pip also looks in its configured find-links, so a wheel already on disk is used when the index is unreachable
  pip_install "$TORCH_INDEX_URL" -q --no-compile --retries 1 --timeout 30 --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
  pip_install "$PIP_INDEX" -q --no-compile "torch==$TORCH_VERSION"
fi
pip_install "$PIP_INDEX" -q --no-compile -c requirements/constraints.txt -e ".[$EXTRAS]"
# the byte code of the environment and of the clone's own modules, on every core; without it, where
# PYTHONDONTWRITEBYTECODE is set, every process would compile each module it imports again. A file that does not
# compile (a package's Python 2 example) only stays uncompiled, as pip leaves it.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
.venv/bin/python -m compileall -q -j 0 "$site" agg_bench baselines >/dev/null 2>&1 || true
printf '%s\n%s\n' "$want" "$here/.venv" > "$stamp"  # what was installed, and where
