#!/usr/bin/env bash
# The wheels a GPU machine that cannot download anything needs besides its own torch, peft, pandas, matplotlib,
# PyYAML and tqdm to run scripts/gpu_check.sh and scripts/gpu_campaign.sh: diffusers at the pinned version and
# jsonschema with what it needs, for that machine's Python (default 3.12, x86-64 Linux), into .whl/ (ignored
# by git where this folder is a git checkout, a worktree or submodule included), about 7 MB. On the GPU
# machine, before PYTHON=python3 scripts/gpu_campaign.sh --minutes 9 (docs/paper-scale.md, "Running a window"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
#   scripts/gpu_wheels.sh [PYTHON_VERSION]     e.g. scripts/gpu_wheels.sh 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1-3.12}
# one argument at most: a second (3.12 3.11) was dropped without a word, and the wheels were for the first only
if [[ $# -gt 1 ]]; then
  echo "gpu_wheels: $# arguments ($*), expected at most one; usage: scripts/gpu_wheels.sh [PYTHON_VERSION, e.g. 3.12]" >&2
  exit 2
fi
[[ $VERSION =~ ^3\.[0-9]+$ ]] || {
  echo "gpu_wheels: PYTHON_VERSION '$VERSION': expected 3.N (e.g. 3.12); usage: scripts/gpu_wheels.sh [PYTHON_VERSION]" >&2
  exit 2; }
PIN() { sed -n "s/^$1==//p" requirements/constraints.txt; }
WHEELS=("diffusers==$(PIN diffusers)" "jsonschema==$(PIN jsonschema)" "jsonschema-specifications" "referencing"
        "rpds-py")
mkdir -p .whl
# .whl/ ignored in this checkout's exclude file: .git/info/exclude, or the common git folder's where .git is a
# file (a worktree, a submodule); outside a git checkout of this folder there is nothing to exclude it from
if command -v git >/dev/null && [[ "$(git rev-parse --show-toplevel 2>/dev/null)" == "$(pwd -P)" ]]; then
  EXCLUDE=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$EXCLUDE")"
  grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
fi
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_34_x86_64; do
  PLATFORMS+=(--platform "$p")
done
# into a folder of their own, then in place of the wheels .whl/ held: the GPU machine installs .whl/*.whl, and a
# wheel of an earlier pin beside the new one failed that install (two versions of one package); a failed
# download leaves .whl/ as it was
NEW=$(mktemp -d .whl/.download.XXXXXX)
trap 'rm -rf "$NEW"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$NEW" "${WHEELS[@]}"
shopt -s nullglob
rm -f .whl/*.whl
for wheel in "$NEW"/*.whl; do mv "$wheel" .whl/; done
ls -l .whl
