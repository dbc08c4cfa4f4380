"""agg-bench: a benchmark and reproducibility harness for AGG (Jacobian-Aggregated Group Gradient)
and the GRPO baselines it is measured against, on diffusers DiTs."""

__version__ = "0.1.0"
