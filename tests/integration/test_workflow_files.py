"""Snakemake conventions of the workflow: every job rule keeps a log, the rules that measure keep a
benchmark, the default profile is found without a flag, and git ignores what the workflow writes but
the reference results."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASURING = {"embed", "run", "cell", "gradcheck", "calibrate", "pretrain"}


def rules() -> dict[str, str]:
    """Rule name -> its body (dedented), from the Snakefile and every workflow/rules/*.smk. A rule made in a
    loop (`rule:` with a `name:` directive, one per cell) goes by the first word of the name it is given."""
    found = {}
    for path in [ROOT / "Snakefile", *sorted((ROOT / "workflow" / "rules").glob("*.smk"))]:
        text = path.read_text()
        starts = [(m.group(1), m.start()) for m in re.finditer(r"^ *rule( \w+)?:", text, flags=re.M)]
        for (name, start), nxt in zip(starts, [s for _, s in starts[1:]] + [len(text)]):
            body = textwrap.dedent(text[start:nxt])
            found[name.strip() if name else re.search(r"name:\s+\w+\.(\w+?)_", body).group(1)] = body
    return found


def test_every_job_rule_logs_and_measuring_rules_keep_a_benchmark():
    found = rules()
    assert MEASURING <= set(found)
    for name, body in found.items():
        if not re.search(r"^    (shell|run):", body, flags=re.M):  # a target rule (all, learning) runs no job
            assert name in ("all", "learning"), f"rule {name} runs nothing"
            continue
        assert re.search(r"^    log:", body, flags=re.M), f"rule {name} has no log:"
        if name in MEASURING:
            assert re.search(r"^    benchmark:", body, flags=re.M), f"rule {name} has no benchmark:"


def test_the_slurm_profile_has_an_entry_for_each_rule_whose_jobs_take_gpus():
    """Snakemake applies a profile's set-resources by rule name, and a job of a rule without an entry got the
    defaults (60 minutes, 16 GB, any GPU model): the GPU pretrain job of config/learning_gpu.yaml had none. Each
    rule that declares a gpu resource has an entry (a cell's rule takes `run`'s: the Snakefile's
    use_run_settings), with the same keys as the run's, and each entry names a rule."""
    import yaml

    profile = yaml.safe_load((ROOT / "workflow" / "profiles" / "slurm" / "config.yaml").read_text())
    entries = profile["set-resources"]
    found = rules()
    takes_gpus = {name for name, body in found.items() if re.search(r"^        gpu=", body, flags=re.M)}
    assert {"run", "cell", "pretrain", "embed", "gradcheck", "calibrate"} <= takes_gpus
    assert sorted(takes_gpus - {"cell"}) == sorted(entries)
    assert all(set(entry) == set(entries["run"]) for entry in entries.values()), entries


def test_the_default_profile_is_where_snakemake_looks_without_a_flag():
    # Snakemake reads profiles/default/ next to the Snakefile when --workflow-profile is not given
    profile = ROOT / "profiles" / "default" / "config.yaml"
    assert profile.is_file()
    assert profile.resolve() == (ROOT / "workflow" / "profiles" / "default" / "config.yaml").resolve()


def test_every_job_runs_on_the_threads_it_reserves():
    """Every shell job sets OMP_NUM_THREADS to the cores Snakemake reserved for it (`threads:`, default 1):
    torch would otherwise start a thread per core beside the other jobs. (The pretrain job also passes
    them as its config's `threads`: tests/integration/test_learning.py's dry run.)"""
    shells = 0
    for name, body in rules().items():
        shell = re.search(r"^    shell:\n((?:        .*\n?)+)", body, flags=re.M)
        if shell:
            shells += 1
            assert shell.group(1).strip().startswith('"OMP_NUM_THREADS={threads} '), f"rule {name}"
    assert shells >= len(MEASURING)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_ignores_what_the_pipeline_writes_but_the_reference_results(tmp_path):
    """results/ is generated, but results/reference/ holds the committed reference results (agg-bench campaign
    unpack writes them there to be committed). `/results/` ignored the folder itself, and git does not look
    inside an ignored folder, so `!/results/reference/` had no effect and `git add` refused the reference."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copy(ROOT / ".gitignore", tmp_path)
    paths = ["results/reference/h200/manifest.json", "results/runs/full_sd3_32px_s0_cpu/summary.json",
             "results/tables/summary.csv", "results/report.html"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=tmp_path, capture_output=True,
                             text=True).stdout.split()
    assert ignored == paths[1:]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_keeps_the_reference_results(tmp_path):
    """`make clean` removes what the workflow made (results/, .snakemake/) but results/reference/, the committed
    reference results (and reference windows unpacked there, not yet committed), which `rm -rf results` took."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    made = ["results/runs/full_sd3_32px_s0_cpu/summary.json", "results/tables/summary.csv", "results/report.html",
            ".snakemake/agg-bench/methods.json"]
    kept = ["results/reference/h200/manifest.json", "results/reference/h200/runs/a/summary.json"]
    for path in made + kept:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    proc = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [path for path in made if (tmp_path / path).exists()] == []
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["reference"]
    assert all((tmp_path / path).read_text() == "{}" for path in kept)
    assert "kept" not in proc.stdout
    # and on a clone where nothing ran
    shutil.rmtree(tmp_path / "results")
    assert subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_clean_keeps_files_of_the_users_in_results(tmp_path):
    """`make clean` removed everything in results/ but reference/: a user's notes there and the work folder of a
    GPU campaign (results/campaign, device time) went with the workflow's outputs. Those stay, named in one line;
    a temporary name of a process killed while writing goes."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    made = ["results/tables/summary.csv", "results/.manifest.agg-bench-tmp4242.json", "results/report.html"]
    users = ["results/notes.txt", "results/campaign/campaign.tar.gz", "results/.manifest.json.bak"]
    for path in made + users:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("mine")
    proc = subprocess.run(["make", "-s", "clean"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [path for path in made if (tmp_path / path).exists()] == []
    assert all((tmp_path / path).read_text() == "mine" for path in users)
    assert proc.stdout == "make clean: kept what is not the workflows' in results/: .manifest.json.bak campaign notes.txt\n"


def test_make_clean_removes_every_output_the_workflows_name():
    """Each results/NAME that the workflows' code writes is on `make clean`'s list (results/reference/ and a
    campaign's work folder are not the workflows')."""
    named = set()
    for path in [ROOT / "Snakefile", *(ROOT / "workflow").rglob("*.smk"), *(ROOT / "agg_bench").rglob("*.py"),
                 ROOT / "Makefile"]:
        named |= set(re.findall(r"\bresults/([A-Za-z0-9_.-]+)", path.read_text()))
    listed = re.search(r"^RESULTS = ((?:.*\\\n)*.*)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    listed_names = set(listed.replace("\\", " ").split())
    assert "runs" in named and "report.html" in named
    assert sorted(named - listed_names - {"reference", "campaign"}) == []


def test_every_phony_make_target_has_a_recipe():
    """A target named .PHONY without a rule of its own (`report`) made `make report` print 'Nothing to be done'
    and exit 0, as if the report were up to date."""
    text = (ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", text, flags=re.M).group(1).split()
    rules = set(re.findall(r"^([\w-]+):", text, flags=re.M))
    assert phony and [target for target in phony if target not in rules] == []


def shell_scripts() -> list[str]:
    """The repository's shell scripts, as git tracks them: a `.sh` name, or a first line that starts a shell."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in sorted(listed.decode().split("\0")):
        path = ROOT / name
        if not name or not path.is_file() or path.is_symlink():
            continue
        with path.open("rb") as handle:
            first = handle.readline()
        if name.endswith(".sh") or re.match(rb"#!\S*/(env +)?(ba|da|k|z)?sh\b", first):
            found.append(name)
    return found


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs make, git and a git checkout")
def test_make_lint_runs_shellcheck_on_every_shell_script():
    """No shell script escapes the linter: the shellcheck command `make lint` runs names each one, so a new
    script (or one run by CI, like .ci/run, that has no .sh name) is checked from its first commit."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "-n", "lint"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (command,) = [line.split() for line in proc.stdout.splitlines() if line.startswith(".venv/bin/shellcheck ")]
    scripts = shell_scripts()
    assert {".ci/run", "scripts/setup.sh", "scripts/caches.sh"} <= set(scripts)
    assert [name for name in scripts if name not in command[1:]] == []


def make_n(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`make -n ARGS` on a copy of the Makefile in ``folder``, as a user's shell runs it: not as a sub-make of
    `make test` (whose MAKEFLAGS and MAKELEVEL would add "Entering directory" lines)."""
    shutil.copy(ROOT / "Makefile", folder)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "CORES")}
    return subprocess.run(["make", "-n", *args], cwd=folder, env=env, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", ["pipeline", "learning"])
@pytest.mark.parametrize("cores", ["0", "-1", "abc", "1.5", "", "2 3", "01"])
def test_make_refuses_a_core_count_snakemake_cannot_run_before_the_set_up(tmp_path, target, cores):
    """`CORES=0 make pipeline` waited forever (no job fits in --cores 0) and `CORES=-1` reached the jobs as
    OMP_NUM_THREADS=-1: one line and exit 2, before the set-up (which make -n would otherwise print)."""
    proc = make_n(tmp_path, target, f"CORES={cores}")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.endswith(f"*** CORES={cores}: expected a whole number of cores from 1 to 9999, or all.  Stop.")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("cores", ["1", "2", "64", "all"])
def test_make_passes_a_core_count_to_snakemake(tmp_path, cores):
    proc = make_n(tmp_path, "pipeline", f"CORES={cores}")
    assert proc.returncode == 0, proc.stderr
    assert f".venv/bin/snakemake --cores {cores}\n" in proc.stdout


def interpreter_under(folder: Path) -> Path:
    """This interpreter with its packages, run from a path under ``folder``: a virtual environment there whose
    interpreter and packages are this one's (links)."""
    venv = Path(sys.prefix)
    folder.mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    (folder / "bin").mkdir()
    (folder / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (folder / "lib").symlink_to(venv / "lib")
    return folder / "bin" / "python"


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtual environment")
def test_an_interpreter_path_with_a_space_is_refused_before_any_job(tmp_path):
    """Snakemake spawns each `run:` job (the manifests, a cell's job file) as a shell command with its
    interpreter's path unquoted: from a clone under `/tmp/my dir/`, `make pipeline` failed every cell with
    '/bin/sh: 1: /tmp/my: not found'. One line before any job instead, which names the way out."""
    python = interpreter_under(tmp_path / "my dir" / "venv é")
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "Snakefile", work)
    for folder in ("workflow", "config"):
        shutil.copytree(ROOT / folder, work / folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the smallest sweep (config/test.yaml), not the default: the refusal comes before any job whatever the sweep, and
    # the first start checks the sweep's methods in a child process of this interpreter, which no cache of the
    # session holds answers for (keyed by the interpreter): the default's 19 methods cost it about 4 CPU-seconds more
    sweep = ["--configfile", "config/test.yaml"]
    proc = subprocess.run([str(python), "-m", "snakemake", "--cores", "1", *sweep], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "holds a space" in proc.stderr and "--force-use-threads" in proc.stderr, proc.stderr[-2000:]
    assert not (work / "results").exists()  # nothing ran
    # the way out it names: the run: jobs in threads of the snakemake process
    dry = subprocess.run([str(python), "-m", "snakemake", "-n", "--cores", "1", "--force-use-threads", *sweep], cwd=work,
                         env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
