"""SIGTERM at random moments of a run: does every attempt end promptly, as interrupted or without a folder?

Each trial starts the run below (issue 37's reproduction: one iteration whose rollout and train phase
take seconds each on a CPU), sends it SIGTERM after a seeded random delay and records the exit code,
the seconds from the signal to the exit, and what the output folder holds: nothing, or a summary and its
status. A trial passes when the process ends within ``--limit`` seconds with exit code 143 (128 + SIGTERM)
and the folder is absent or its summary says ``interrupted``. A first, uninterrupted run measures the
phases (start-up until the folder's files are written, rollout, reward, train) so that the delays can
be drawn over all of them and each trial says which phase its signal landed in.

    python scripts/signal_trials.py --trials 12 --seed 0 --work /tmp/signal-trials

Too slow for the test suite (a run takes about 25 s on 2 cores); the mechanism has fast tests in
tests/test_signals.py.
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
    """The phase a signal after ``delay`` seconds lands in, by the reference run's times."""
    edges = [("start-up", ref["begun_s"]), ("rollout", ref["rollout_s"]), ("reward", ref["reward_s"]),
             ("train", ref["train_s"])]
    t = 0.0
    for name, length in edges:
        t += length
        if delay < t:
            return name
    return "finishing"


def trial(python: str, out: Path, delay: float, limit: float, env: dict, after_claim: bool = False) -> dict:
    """One run, SIGTERM ``delay`` seconds after it starts (``after_claim``: after its folder appears)."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(command(python, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    if after_claim:
        while not out.exists() and proc.poll() is None:
            time.sleep(0.002)
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
    parser.add_argument("--work", type=Path, default=Path("/tmp/signal-trials"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--startup", type=int, default=2,
                        help="trials whose signal lands while the command starts (imports, config; no folder yet)")
    parser.add_argument("--claimed", type=int, default=2,
                        help="trials whose signal lands just after the folder is claimed (the model being built)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    ref = reference(args.python, args.work, env)
    print(json.dumps({"reference": {k: round(v, 2) for k, v in ref.items()}}), flush=True)
    rng = random.Random(args.seed)
    # (delay, after the claim?, phase): the command starting, the folder just claimed, then anywhere in the
    # rest of the run (its rollout and train phase are most of it)
    plan = [(rng.uniform(0.2, 2.0), False, "start-up: loading") for _ in range(args.startup)]
    plan += [(rng.uniform(0.0, 0.3), True, "start-up: folder claimed") for _ in range(args.claimed)]
    rest = args.trials - len(plan)
    plan += [(rng.uniform(ref["begun_s"], ref["total_s"] - 1.0), False, None) for _ in range(rest)]
    passed = 0
    for number, (delay, after_claim, phase) in enumerate(plan, 1):
        result = trial(args.python, args.work / f"trial{number}", delay, args.limit, env, after_claim)
        result["phase"] = phase or phase_at(delay, ref)
        passed += result["ok"]
        print(json.dumps({"trial": number, **result}), flush=True)
    print(json.dumps({"passed": passed, "trials": len(plan)}), flush=True)
    return 0 if passed == len(plan) else 1


if __name__ == "__main__":
    sys.exit(main())
