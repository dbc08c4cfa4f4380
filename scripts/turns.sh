# shellcheck shell=bash
# Sourced by scripts/setup.sh and scripts/one-workflow.sh (bash): one process of a clone at a time.
#
# take_turn LOCK WHAT: hold the file lock LOCK (flock on descriptor 9) until the script ends; while another
# process holds it, say "WHAT (it holds LOCK); waiting for it to end" once and wait. Returns 1 without taking
# a lock where there is none to take: no flock, or a clone that cannot be written.
take_turn() {
  command -v flock >/dev/null 2>&1 && { exec 9>>"$1"; } 2>/dev/null || return 1
  if ! flock -n 9; then
    echo "$2 (it holds $(pwd -P)/$1); waiting for it to end" >&2
    flock 9
  fi
}
