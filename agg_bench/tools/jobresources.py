"""What a workflow job that takes no GPU asks a cluster for.

The SLURM profile (``workflow/profiles/slurm/config.yaml``) gives each rule whose jobs can take GPUs a
``gpu_model`` and ``cpus_per_gpu``, and every job the GPU partition (``slurm_partition``), while the number of
GPUs comes per job from the sweep (``resources: gpu=K``, 0 on a CPU device). Snakemake's SLURM executor
turns a ``gpu_model`` into ``--gpus=<model>:<gpu>`` whatever ``gpu`` is, so a CPU job of a CPU sweep
(``config/test.yaml``) was sent as ``--gpus=h100:0 -p gpu``: a request a cluster may refuse, or queue behind the
GPU jobs on GPU nodes; and it asked for the memory of the rule's GPU entry (``mem_mb: 128000`` for a run), sized
for a GPU node's host memory, not a CPU job's. :func:`drop_gpu_settings_without_gpus` makes those settings depend
on the job's own ``gpu``: a job that takes none asks for no GPU model, no CPUs per GPU (its threads become
``--cpus-per-task``), the partition ``cpu_partition`` names, else none (the cluster's default partition), the
memory ``cpu_mem_mb`` names, else the profile's ``default-resources`` ``mem_mb`` (what a job of a rule without an
entry asks for), and the time ``cpu_runtime`` names, else the rule's own ``runtime`` (a job on a CPU is slower
than on a GPU, so the GPU entry's time is kept rather than the profile's shorter default). :func:`check_cpu_settings`
reads ``cpu_mem_mb`` and ``cpu_runtime`` before any job: Snakemake takes any text as a resource, and one that is
no number failed only when a job without a GPU was submitted, in words about ``mem_mb``.

This module imports nothing from Snakemake: it works on a rule's ``resources`` as Snakemake keeps them
(``snakemake.resources.Resources``, whose values evaluate for a job's wildcards).
"""
from __future__ import annotations

from typing import Any

from ..errors import UserError, quote

# settings that only mean something for a job holding a GPU
GPU_ONLY = ("gpu_model", "cpus_per_gpu")
PARTITION = "slurm_partition"
CPU_PARTITION = "cpu_partition"
MEMORY = "mem_mb"  # Snakemake keeps mem, mem_mb and mem_mib as this one
CPU_MEMORY = "cpu_mem_mb"
RUNTIME = "runtime"  # minutes
CPU_RUNTIME = "cpu_runtime"
# what each cpu_* setting must evaluate to, as words for a refusal
CPU_SETTINGS = {CPU_MEMORY: "a whole number of MB >= 0 (the memory of a job without a GPU)",
                CPU_RUNTIME: "a whole number of minutes >= 0, or a duration such as '4h' (the time limit of a job "
                             "without a GPU)"}
# what a resource is evaluated with before any job: a setting that needs more (the job's wildcards or input) is
# left to Snakemake, which evaluates it per job
NO_JOB = {"input": [], "attempt": 1, "threads": 1, "async_run": None}


def _value(resource: Any, wildcards: Any, kwargs: dict[str, Any]) -> Any:
    """The value ``resource`` (a ``snakemake.resources.Resource``) takes for a job with ``wildcards``."""
    return resource.evaluate(wildcards, **kwargs).value if resource.is_evaluable() else resource.value


def drop_gpu_settings_without_gpus(resources: Any, defaults: Any = None) -> None:
    """Make ``gpu_model``, ``cpus_per_gpu``, ``slurm_partition``, ``mem_mb`` and ``runtime`` in ``resources`` (a
    rule's) depend on each job's ``gpu``: unchanged for a job that takes a GPU; for one that takes none, no
    ``gpu_model`` or ``cpus_per_gpu``, the ``cpu_partition`` resource as its partition (none where that is not set),
    as its memory the ``cpu_mem_mb`` resource, else ``defaults``' ``mem_mb`` (the workflow's default resources, a
    ``snakemake.resources.Resources``; its own ``mem_mb`` where neither is set), and as its time the ``cpu_runtime``
    resource, else its own ``runtime``. Rules without a ``gpu`` resource, and settings a rule does not have, are left
    as they are."""
    if "gpu" not in resources:
        return
    gpu = resources["gpu"]
    keep = object()  # a setting a job without GPUs takes as the rule has it
    without_gpus: dict[str, Any] = {name: None for name in GPU_ONLY}  # None: dropped
    without_gpus[PARTITION] = resources[CPU_PARTITION] if CPU_PARTITION in resources else None
    without_gpus[MEMORY] = resources[CPU_MEMORY] if CPU_MEMORY in resources else \
        defaults[MEMORY] if defaults is not None and MEMORY in defaults else keep
    without_gpus[RUNTIME] = resources[CPU_RUNTIME] if CPU_RUNTIME in resources else keep
    for name, without in without_gpus.items():
        if name not in resources or without is keep:
            continue
        original = resources[name]
        if not original.is_evaluable() and original.value is None:
            continue

        # Snakemake passes a function with **kwargs all it has for the job (input, attempt, threads, rulename,
        # ...), which each wrapped setting then takes what it needs of
        def for_job(wildcards, _original=original, _without=without, **kwargs):
            if _value(gpu, wildcards, kwargs):
                return _value(_original, wildcards, kwargs)
            # None: Snakemake drops the setting from the job's resources
            return None if _without is None else _value(_without, wildcards, kwargs)

        resources[name] = for_job


def check_cpu_settings(defaults: Any, per_rule: Any) -> None:
    """``cpu_mem_mb`` and ``cpu_runtime`` where they are set, in ``defaults`` (the workflow's default resources) and
    ``per_rule`` ({rule: its set resources}; each a ``snakemake.resources.Resources``), are what
    :func:`drop_gpu_settings_without_gpus` can ask a cluster for, where they need no job to be evaluated: Snakemake
    takes any text from a profile or the command line (``cpu_mem_mb: lots``) as a resource, and such a value
    failed only once a job without a GPU was submitted, after other jobs, as a ``mem_mb`` that was no number.
    Raises UserError naming the setting as it was given and its value."""
    places = [("default-resources: ", "", defaults), *((f"set-resources: {rule}:", rule, resources)
                                                       for rule, resources in per_rule.items())]
    for where, rule, resources in places:
        for name, expected in CPU_SETTINGS.items():
            if name not in resources:
                continue
            resource = resources[name]
            try:
                value = _value(resource, {}, {**NO_JOB, "rulename": rule})
            except Exception:  # a setting that reads the job's wildcards or input: Snakemake's per job
                continue
            if value is None:
                continue
            read = value
            if name == CPU_RUNTIME and isinstance(value, str):
                try:  # as Snakemake reads the runtime the job takes it as ('4h': 240 minutes)
                    read = type(resource)(RUNTIME, value).value
                except Exception:  # Snakemake's WorkflowError: not a duration, refused below as the text given
                    pass
            if isinstance(read, bool) or not isinstance(read, int) or read < 0:
                raise UserError(f"{where}{name} = {quote(value)}: expected {expected}")
