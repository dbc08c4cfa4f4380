"""agg-bench: a benchmark and reproducibility harness for AGG (Jacobian-Aggregated Group Gradient)
and the GRPO baselines it is measured against, on diffusers DiTs."""
from .threads import short_openmp_waits

__version__ = "0.1.0"

# first, before any module of the package imports torch (whose OpenMP runtime reads the wait settings once,
# when it loads): every process the harness starts (the CLI, workflow jobs, the sweep's check, tests)
# imports this first, and its children inherit the settings
short_openmp_waits()
