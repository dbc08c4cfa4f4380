#!/usr/bin/env bash
# Runs COMMAND ARGS (a snakemake of make pipeline or make learning) as the clone's one workflow at a time.
#
# Two `make pipeline` of one clone at once: the second's snakemake stopped on Snakemake's lock with a screen
# that ends in "It can be removed with the --unlock argument", and following that while the first still ran
# let two snakemakes write the same run folders. Here the second waits for the first (flock on
# .workflow.lock), then finds its work done. A lock Snakemake left behind (its process killed by kill -9 or a
# closed terminal: SIGHUP ends it without removing its lock) is one line saying how to remove it.
# Without flock, or where the clone cannot be written, there is no lock and Snakemake's own stays.
set -euo pipefail
cd "$(dirname "$0")/.."
# a command to run, found from the clone (where the Makefile runs it): none took the lock, ran nothing and
# exited 0; one not found was the shell's "exec: ...: not found", exit code 127, after the lock and the caches
if [[ $# -eq 0 ]]; then
  echo "one-workflow: no COMMAND given; usage: scripts/one-workflow.sh COMMAND [ARGS...] (.venv/bin/snakemake ...)" >&2
  exit 2
fi
if ! command -v -- "$1" >/dev/null 2>&1; then
  echo "one-workflow: COMMAND '$1': no such command from $(pwd -P) (a path from the clone, or a name on PATH);" \
       "usage: scripts/one-workflow.sh COMMAND [ARGS...]" >&2
  exit 2
fi
# shellcheck source=scripts/turns.sh
source scripts/turns.sh
if take_turn .workflow.lock "make: another make pipeline or make learning of this clone is running"; then
  # no workflow of this clone started by make runs now, so a lock of Snakemake's is one left behind, or one of
  # a snakemake started by hand here
  if [ -n "$(ls -A .snakemake/locks 2>/dev/null)" ]; then
    echo "make: $(pwd -P)/.snakemake/locks/ holds the lock of a snakemake that was killed (kill -9, a closed terminal) or that you started by hand here; when none runs, .venv/bin/snakemake --unlock removes it, then run make again" >&2
    exit 2
  fi
fi
# shellcheck source=scripts/caches.sh
source scripts/caches.sh
home_caches
echo "$*"
exec "$@"
