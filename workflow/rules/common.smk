# The sweep config checked and expanded into jobs, and their command lines: agg_bench/tools/sweep.py. Nothing
# here runs a job; every check happens while the workflow is parsed, before any job starts.
import re
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError

from agg_bench.errors import UserError
from agg_bench.tools.sweep import CELL_DIR, EMBED_DIR, PRETRAINED_DIR, PYTHON, Sweep, set_arg

try:
    # the files the config came from are read again with agg-bench's YAML loader first (Snakemake's takes
    # repeated keys and nesting aliases without a bound)
    SWEEP = Sweep(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml",
                  files=workflow.configfiles)
except UserError as err:
    raise WorkflowError(str(err)) from None
