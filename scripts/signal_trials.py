"""SIGTERM at random moments of a run: does every attempt end promptly, as interrupted or without a folder?

Each trial starts the run below (issue 37's reproduction: one iteration whose rollout and train phase
take seconds each on a CPU), sends it SIGTERM after a seeded random delay and records the exit code,
the seconds from the signal to the exit, and what the output folder holds: nothing, or a summary and its
status. A trial passes when the process ends within ``--limit`` seconds with exit code 143 (128 + SIGTERM)
and the folder is absent or its summary says ``interrupted``. The signals land while the command loads
(``--startup`` trials), just after its folder is claimed while the model is built (``--claimed``), and
the rest at a random moment of the iteration after the folder's files are written; a first,
uninterrupted run measures the iteration's phases (rollout, reward, train), over which those delays are
drawn and by which each trial says where its signal landed.

    python scripts/signal_trials.py --trials 12 --seed 0 --work WORK

Too slow for the test suite (a run takes about 25 s on 2 cores); the mechanism has fast tests in
tests/integration/test_signals.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ["run", "--config", str(ROOT / "config/run.yaml"), "--set", "model.resolution=32",
       "--set", "train.iterations=1", "--set", "sampling.steps=100", "--set", "grpo.group_size=16",
       "--set", "grpo.prompts_per_iteration=4"]


def command(python: str, out: Path) -> list[str]:
    return [python, "-m", "agg_bench", *RUN, "--out", str(out)]


def folder_state(out: Path) -> str:
    """What ``out`` holds: absent, the names in it, and the summary's status if there is one."""
    if not out.exists():
        return "absent"
    names = sorted(p.name for p in out.iterdir())
    summary = out / "summary.json"
    status = json.loads(summary.read_text())["status"] if summary.is_file() else None
    return f"summary {status}" if status else f"no summary ({', '.join(names) or 'empty'})"


def reference(python: str, work: Path, env: dict) -> dict:
    """One uninterrupted run: when its files appear and how long each phase of its iteration takes."""
    out = work / "reference"
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    proc = subprocess.Popen(command(python, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    begun = None
    while proc.poll() is None:
        if begun is None and (out / "metrics.jsonl").exists():
            begun = time.monotonic() - start
        time.sleep(0.01)
    total = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"the reference run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    rollout, reward, train = (record[f"t_{k}_s"] for k in ("rollout", "reward", "train"))
    return {"begun_s": begun, "rollout_s": rollout, "reward_s": reward, "train_s": train, "total_s": total}


def phase_at(delay: float, ref: dict) -> str:
    """The phase of the iteration a signal ``delay`` seconds after the folder's files appeared lands in, by
    the reference run's times."""
    t = 0.0
    for name in ("rollout", "reward", "train"):
        t += ref[f"{name}_s"]
        if delay < t:
            return name
    return "finishing"


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists() and proc.poll() is None:
        time.sleep(0.002)


def trial(python: str, out: Path, delay: float, limit: float, env: dict, after: str | None = None) -> dict:
    """One run, SIGTERM ``delay`` seconds after it starts, or after its folder (``after`` = "claim") or its
    files (``after`` = "files") appear."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(command(python, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    if after is not None:
        wait_for(out if after == "claim" else out / "metrics.jsonl", proc)
    time.sleep(delay)
    if proc.poll() is not None:
        return {"delay_s": round(delay, 2), "result": f"ended before the signal (exit {proc.returncode})", "ok": False}
    before = folder_state(out)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=limit + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    took = time.monotonic() - sent
    after = folder_state(out)
    err = proc.stderr.read().strip().splitlines()
    ok = code == 128 + signal.SIGTERM and took <= limit and (after == "absent" or after == "summary interrupted")
    return {"delay_s": round(delay, 2), "folder_at_signal": before, "exit": code, "stop_s": round(took, 2),
            "folder_after": after, "last_line": err[-1] if err else "", "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=float, default=10.0, help="seconds a stop may take (default 10)")
    parser.add_argument("--work", type=Path, default=None,
                        help="the trials' folders go here (default: a new temporary folder); its reference/ and "
                             "trialN/ are replaced")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--startup", type=int, default=2,
                        help="trials whose signal lands while the command starts (imports, config; no folder yet)")
    parser.add_argument("--claimed", type=int, default=2,
                        help="trials whose signal lands just after the folder is claimed (the model being built)")
    args = parser.parse_args()
    for flag in ("trials", "startup", "claimed"):
        if getattr(args, flag) < 0:
            parser.exit(2, f"--{flag} {getattr(args, flag)}: expected an integer >= 0\n")
    if args.trials < args.startup + args.claimed:
        parser.exit(2, f"--trials {args.trials}: expected at least --startup + --claimed = "
                       f"{args.startup + args.claimed} (the trials those take are counted in it)\n")
    if not 0 < args.limit < float("inf"):
        parser.exit(2, f"--limit {args.limit}: expected a positive, finite number of seconds\n")
    if args.work is None:  # not a fixed name in the shared /tmp, whose trial folders another user could own
        args.work = Path(tempfile.mkdtemp(prefix="signal-trials-"))
    try:
        args.work.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file there, or a folder this user may not write
        parser.exit(2, f"--work {args.work}: cannot make the folder ({err.strerror or err}); expected a folder path\n")
    print(json.dumps({"work": str(args.work)}), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    ref = reference(args.python, args.work, env)
    print(json.dumps({"reference": {k: round(v, 2) for k, v in ref.items()}}), flush=True)
    rng = random.Random(args.seed)
    # (delay, after what, phase): the command starting, the folder just claimed, then anywhere in the
    # iteration once the folder's files are written (its rollout and train phase are most of it; the delay
    # stops short of the reference's end, since a run on a busy machine may finish sooner)
    plan = [(rng.uniform(0.2, 2.0), None, "start-up: loading") for _ in range(args.startup)]
    plan += [(rng.uniform(0.0, 0.3), "claim", "start-up: folder claimed") for _ in range(args.claimed)]
    iteration_s = ref["rollout_s"] + ref["reward_s"] + ref["train_s"]
    plan += [(rng.uniform(0.0, 0.9 * iteration_s), "files", None) for _ in range(args.trials - len(plan))]
    passed = 0
    for number, (delay, after, phase) in enumerate(plan, 1):
        result = trial(args.python, args.work / f"trial{number}", delay, args.limit, env, after)
        result["phase"] = phase or phase_at(delay, ref)
        passed += result["ok"]
        print(json.dumps({"trial": number, **result}), flush=True)
    print(json.dumps({"passed": passed, "trials": len(plan)}), flush=True)
    return 0 if passed == len(plan) else 1


if __name__ == "__main__":
    sys.exit(main())
