# The sweep config checked and expanded into jobs, and their command lines: agg_bench/sweep.py. Nothing
# here runs a job; every check happens while the workflow is parsed, before any job starts.
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError

from agg_bench.errors import UserError
from agg_bench.sweep import EMBED_DIR, PRETRAINED_DIR, PYTHON, Sweep, set_arg

try:
    SWEEP = Sweep(config, Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml")
except UserError as err:
    raise WorkflowError(str(err)) from None
