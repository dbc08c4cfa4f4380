"""What a workflow job asks a cluster for: a job that takes no GPU asks for none (agg_bench/tools/jobresources.py)."""
import re

import pytest

from agg_bench.errors import UserError
from agg_bench.tools.jobresources import check_cpu_settings, drop_gpu_settings_without_gpus

resources = pytest.importorskip("snakemake.resources")


def settings_for(rule_resources, gpus: int) -> dict:
    """The settings a job of a rule with ``rule_resources`` gets, evaluated as Snakemake evaluates them (the
    keyword arguments it passes a resource function, the None values it drops)."""
    wildcards = {"gpus": str(gpus)}
    aux = {"input": [], "attempt": 1, "threads": 4, "rulename": "run", "async_run": None}
    values = {name: res.evaluate(wildcards, **aux).value for name, res in rule_resources.items()}
    return {name: value for name, value in values.items() if value is not None}


def slurm_rule(**extra):
    """A rule's resources as the SLURM profile leaves them: its settings given as command-line expressions (as
    Snakemake reads a profile's set-resources), the GPU count a function of the job's wildcards."""
    rule = resources.Resources.from_mapping({"gpu": lambda wildcards: int(wildcards["gpus"]), "mem_mb": 16000})
    for name, text in {"gpu_model": "h100", "cpus_per_gpu": "8", "slurm_partition": "gpu", **extra}.items():
        rule[name] = resources.Resource.from_cli_expression(name, text)
    return rule


def test_a_job_without_gpus_asks_for_no_gpu_model_and_not_the_gpu_partition():
    """The SLURM executor sends a gpu_model as --gpus=<model>:<gpu> whatever gpu is: a CPU sweep's jobs went out as
    --gpus=h100:0 -p gpu, which a cluster may refuse or queue on GPU nodes."""
    rule = slurm_rule()
    drop_gpu_settings_without_gpus(rule)
    assert settings_for(rule, 0) == {"gpu": 0, "mem_mb": 16000}
    assert settings_for(rule, 2) == {"gpu": 2, "mem_mb": 16000, "gpu_model": "h100", "cpus_per_gpu": 8,
                                     "slurm_partition": "gpu"}


def test_a_job_without_gpus_goes_to_the_cpu_partition_where_one_is_named():
    rule = slurm_rule(cpu_partition="batch")
    drop_gpu_settings_without_gpus(rule)
    assert settings_for(rule, 0)["slurm_partition"] == "batch"
    assert settings_for(rule, 1)["slurm_partition"] == "gpu"


def gpu_entry_rule(**extra):
    """A rule as the SLURM profile leaves it: the default resources, then the rule's entry (a GPU node's memory)."""
    rule = resources.Resources.from_mapping({"gpu": lambda wildcards: int(wildcards["gpus"]), "mem_mb": 16000})
    for name, text in {"gpu_model": "h100", "slurm_partition": "gpu", "mem_mb": "128000", **extra}.items():
        rule[name] = resources.Resource.from_cli_expression(name, text)
    return rule


def test_a_job_without_gpus_asks_for_the_default_memory_not_the_gpu_entrys():
    """A CPU job of a rule with a GPU entry asked for that entry's mem_mb (128 GB for a run, sized for a GPU node); it
    asks for the profile's default mem_mb, as a job of a rule without an entry does, while a GPU job's is unchanged."""
    defaults = resources.Resources.parse(["mem_mb=16000", "runtime=60"], allow_expressions=True)
    rule = gpu_entry_rule()
    drop_gpu_settings_without_gpus(rule, defaults)
    assert settings_for(rule, 0) == {"gpu": 0, "mem_mb": 16000}
    assert settings_for(rule, 1) == {"gpu": 1, "mem_mb": 128000, "gpu_model": "h100", "slurm_partition": "gpu"}
    # memory given as mem (a size) or mem_mib is the same resource
    rule = gpu_entry_rule()
    drop_gpu_settings_without_gpus(rule, resources.Resources.parse(["mem=8G"], allow_expressions=True))
    assert settings_for(rule, 0)["mem_mb"] == 8000


def test_a_job_without_gpus_asks_for_cpu_mem_mb_where_it_is_set():
    defaults = resources.Resources.from_mapping({"mem_mb": 16000})
    rule = gpu_entry_rule(cpu_mem_mb="32000")
    drop_gpu_settings_without_gpus(rule, defaults)
    assert settings_for(rule, 0)["mem_mb"] == 32000 and settings_for(rule, 2)["mem_mb"] == 128000
    # no cpu_mem_mb and no default memory: the rule's own
    rule = gpu_entry_rule()
    drop_gpu_settings_without_gpus(rule, resources.Resources.from_mapping({}))
    assert settings_for(rule, 0)["mem_mb"] == 128000


def test_rules_without_a_gpu_resource_or_the_settings_are_left_alone():
    rule = resources.Resources.from_mapping({"mem_mb": 100, "slurm_partition": "gpu"})
    drop_gpu_settings_without_gpus(rule, resources.Resources.from_mapping({"mem_mb": 16000}))
    assert settings_for(rule, 0) == {"mem_mb": 100, "slurm_partition": "gpu"}
    local = resources.Resources.from_mapping({"gpu": 0})
    drop_gpu_settings_without_gpus(local)
    assert settings_for(local, 0) == {"gpu": 0}


def test_a_job_without_gpus_takes_cpu_runtime_where_it_is_set():
    """A CPU job of a rule with a GPU entry took that entry's runtime (240 minutes for a run) whatever cpu_mem_mb said
    of its memory: cpu_runtime gives a job without GPUs its own time limit, in minutes or as a duration."""
    defaults = resources.Resources.from_mapping({"mem_mb": 16000, "runtime": 60})
    rule = gpu_entry_rule(runtime="240", cpu_runtime="30")
    drop_gpu_settings_without_gpus(rule, defaults)
    assert settings_for(rule, 0)["runtime"] == 30 and settings_for(rule, 1)["runtime"] == 240
    rule = gpu_entry_rule(runtime="240", cpu_runtime="'8h'")
    drop_gpu_settings_without_gpus(rule, defaults)
    assert settings_for(rule, 0)["runtime"] == 480
    # none set: the rule's own, not the shorter default (a run on a CPU takes longer than on a GPU)
    rule = gpu_entry_rule(runtime="240")
    drop_gpu_settings_without_gpus(rule, defaults)
    assert settings_for(rule, 0)["runtime"] == 240


@pytest.mark.parametrize("name, text, shown", [("cpu_mem_mb", "lots", "'lots'"), ("cpu_mem_mb", "-5.0", "-5"),
                                               ("cpu_mem_mb", "'32G'", "'32G'"), ("cpu_mem_mb", "True", "True"),
                                               ("cpu_runtime", "forever", "'forever'"), ("cpu_runtime", "-2.0", "-2")])
def test_a_cpu_setting_that_is_no_number_is_refused_before_any_job(name, text, shown):
    """Snakemake takes any text from a profile or --set-resources as a resource: cpu_mem_mb: lots failed only when a
    job without a GPU was submitted (after the jobs before it), as "Resource 'mem_mb' must be assigned an int"."""
    defaults = resources.Resources.from_mapping({"mem_mb": 16000})
    with pytest.raises(UserError, match=rf"^set-resources: run:{name} = {re.escape(shown)}: expected a whole number "):
        check_cpu_settings(defaults, {"embed": gpu_entry_rule(), "run": gpu_entry_rule(**{name: text})})
    given = resources.Resources.parse([f"{name}={text}"], allow_expressions=True)
    with pytest.raises(UserError, match=rf"^default-resources: {name} = {re.escape(shown)}: expected a whole number "):
        check_cpu_settings(given, {})


def test_cpu_settings_that_read_as_numbers_or_need_a_job_pass():
    defaults = resources.Resources.parse(["cpu_mem_mb=attempt * 8000", "cpu_runtime='4h'"], allow_expressions=True)
    check_cpu_settings(defaults, {"run": gpu_entry_rule(cpu_mem_mb="0", cpu_runtime="90")})
    # evaluated per job by Snakemake: nothing to read before one
    check_cpu_settings(defaults, {"run": gpu_entry_rule(cpu_mem_mb="input.size_mb * 4",
                                                         cpu_runtime="wildcards.minutes")})
