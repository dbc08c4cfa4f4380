# shellcheck shell=bash
# Sourced by scripts/one-workflow.sh and scripts/test.sh (bash): caches that cannot go to the user's home go to
# .snakemake/ in the clone.
#
# Snakemake makes its source cache in the user's cache folder (XDG_CACHE_HOME, else ~/.cache) before it reads
# the Snakefile: with a read-only home, or HOME naming a folder that cannot be made, every snakemake stopped with
# a PermissionError traceback from os.makedirs. Matplotlib warned in every plot job's log and rebuilt its font
# cache in a new temporary folder each time. Only a folder that cannot be made moves: a home that can be written
# keeps its caches (a Hugging Face cache under ~/.cache among them).
home_caches() {
  local cache=${XDG_CACHE_HOME:-~/.cache} config=${XDG_CONFIG_HOME:-~/.config}
  if ! mkdir -p "$cache/snakemake" 2>/dev/null || [ ! -w "$cache/snakemake" ]; then
    export XDG_CACHE_HOME=$PWD/.snakemake/home-cache
  fi
  if [ -z "${MPLCONFIGDIR:-}" ] && { ! mkdir -p "$config/matplotlib" 2>/dev/null || [ ! -w "$config/matplotlib" ]; }; then
    export MPLCONFIGDIR=$PWD/.snakemake/matplotlib
  fi
}
