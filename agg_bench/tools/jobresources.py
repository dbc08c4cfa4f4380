"""What a workflow job that takes no GPU asks a cluster for.

The SLURM profile (``workflow/profiles/slurm/config.yaml``) gives each rule whose jobs can take GPUs a
``gpu_model`` and ``cpus_per_gpu``, and every job the GPU partition (``slurm_partition``), while the number of
GPUs comes per job from the sweep (``resources: gpu=K``, 0 on a CPU device). Snakemake's SLURM executor
turns a ``gpu_model`` into ``--gpus=<model>:<gpu>`` whatever ``gpu`` is, so a CPU job of a CPU sweep
(``config/test.yaml``) was sent as ``--gpus=h100:0 -p gpu``: a request a cluster may refuse, or queue behind the
GPU jobs on GPU nodes; and it asked for the memory of the rule's GPU entry (``mem_mb: 128000`` for a run), sized
for a GPU node's host memory, not a CPU job's. :func:`drop_gpu_settings_without_gpus` makes those settings depend
on the job's own ``gpu``: a job that takes none asks for no GPU model, no CPUs per GPU (its threads become
``--cpus-per-task``), the partition ``cpu_partition`` names, else none (the cluster's default partition), and the
memory ``cpu_mem_mb`` names, else the profile's ``default-resources`` ``mem_mb`` (what a job of a rule without an
entry asks for).

This module imports nothing from Snakemake: it works on a rule's ``resources`` as Snakemake keeps them
(``snakemake.resources.Resources``, whose values evaluate for a job's wildcards).
"""
from __future__ import annotations

from typing import Any

# settings that only mean something for a job holding a GPU
GPU_ONLY = ("gpu_model", "cpus_per_gpu")
PARTITION = "slurm_partition"
CPU_PARTITION = "cpu_partition"
MEMORY = "mem_mb"  # Snakemake keeps mem, mem_mb and mem_mib as this one
CPU_MEMORY = "cpu_mem_mb"


def _value(resource: Any, wildcards: Any, kwargs: dict[str, Any]) -> Any:
    """The value ``resource`` (a ``snakemake.resources.Resource``) takes for a job with ``wildcards``."""
    return resource.evaluate(wildcards, **kwargs).value if resource.is_evaluable() else resource.value


def drop_gpu_settings_without_gpus(resources: Any, defaults: Any = None) -> None:
    """Make ``gpu_model``, ``cpus_per_gpu``, ``slurm_partition`` and ``mem_mb`` in ``resources`` (a rule's) depend on
    each job's ``gpu``: unchanged for a job that takes a GPU; for one that takes none, no ``gpu_model`` or
    ``cpus_per_gpu``, the ``cpu_partition`` resource as its partition (none where that is not set), and as its memory
    the ``cpu_mem_mb`` resource, else ``defaults``' ``mem_mb`` (the workflow's default resources, a
    ``snakemake.resources.Resources``; its own ``mem_mb`` where neither is set). Rules without a ``gpu`` resource,
    and settings a rule does not have, are left as they are."""
    if "gpu" not in resources:
        return
    gpu = resources["gpu"]
    cpu_partition = resources[CPU_PARTITION] if CPU_PARTITION in resources else None
    cpu_memory = resources[CPU_MEMORY] if CPU_MEMORY in resources else \
        defaults[MEMORY] if defaults is not None and MEMORY in defaults else None
    for name in (*GPU_ONLY, PARTITION, MEMORY):
        if name not in resources:
            continue
        original = resources[name]
        if not original.is_evaluable() and original.value is None:
            continue
        if name == MEMORY:
            if cpu_memory is None:
                continue
            without_gpus = cpu_memory
        else:
            without_gpus = cpu_partition if name == PARTITION else None

        # Snakemake passes a function with **kwargs all it has for the job (input, attempt, threads, rulename,
        # ...), which each wrapped setting then takes what it needs of
        def for_job(wildcards, _original=original, _without=without_gpus, **kwargs):
            if _value(gpu, wildcards, kwargs):
                return _value(_original, wildcards, kwargs)
            # None: Snakemake drops the setting from the job's resources
            return None if _without is None else _value(_without, wildcards, kwargs)

        resources[name] = for_job
