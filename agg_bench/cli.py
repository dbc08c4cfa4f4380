"""``agg-bench`` command line. A user error prints one line and exits with code 2."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import UserError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="run config YAML (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-5 (repeatable)")


def cmd_run(args) -> int:
    from .config import load_config
    from .train import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, args.out)
    print(json.dumps({"out": str(args.out), "status": summary["status"]}))
    return 0


def cmd_snapshot(args) -> int:
    from .config import load_config
    from .snapshot import save_snapshot

    out = save_snapshot(load_config(args.config, args.overrides), args.out)
    print(json.dumps({"out": str(out)}))
    return 0


def cmd_replay(args) -> int:
    from .snapshot import replay

    counts = replay(args.snapshot, args.method, args.overrides, args.out, args.device)
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


def cmd_env(args) -> int:
    from .telemetry import environment

    print(json.dumps(environment(), indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agg-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="one training run -> DIR/metrics.jsonl, summary.json, env.json")
    _add_config_args(p)
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("snapshot", help="freeze one rollout for replay")
    _add_config_args(p)
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("replay", help="one method's gradient on a snapshot")
    p.add_argument("snapshot", type=Path)
    p.add_argument("--method", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, type=Path, help="FILE.safetensors (+ FILE.json pass counts)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("env", help="print the environment record (versions, GPUs, commit)")
    p.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as err:
        print(f"agg-bench {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"agg-bench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
