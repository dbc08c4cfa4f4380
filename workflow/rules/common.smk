# Helpers every rule file uses: the sweep config checked and expanded into jobs, and the command lines.
# Nothing here runs a job; every check happens while the workflow is parsed, before any job starts.
import dataclasses
import fnmatch
import json
import shlex
import sys
from pathlib import Path

import jsonschema
import yaml
from snakemake.exceptions import WorkflowError

from agg_bench.config import _describe as describe_schema_error
from agg_bench.config import load_config
from agg_bench.errors import UserError

PYTHON = shlex.quote(sys.executable)  # the interpreter running the workflow has agg_bench installed
SCHEMA = Path(workflow.basedir) / "workflow" / "schemas" / "config.schema.yaml"
# keys whose value is one whole section: a method's options must not mix with another method's
WHOLE_SECTIONS = ("method", "options")


def check_sweep(sweep: dict) -> None:
    """The sweep's structure against the schema, then the cross-references between its sections."""
    schema = yaml.safe_load(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(sweep),
                    key=lambda e: (len(list(e.absolute_path)), list(map(str, e.absolute_path))))
    if errors:
        raise WorkflowError(f"sweep config: {describe_schema_error(errors[0])}")
    for section in ("gradcheck", "embed"):
        part = sweep.get(section) or {}
        for label in part.get("models", []):
            if label not in sweep["models"]:
                raise WorkflowError(f"sweep config: {section}.models: {label!r} is not a label under models "
                                    f"({', '.join(sweep['models'])})")
        if "device" in part and part["device"] not in sweep["devices"]:
            raise WorkflowError(f"sweep config: {section}.device: {part['device']!r} is not a label under devices "
                                f"({', '.join(sweep['devices'])})")
    labels = [ref["label"] for ref in sweep.get("references", [])]
    if len(set(labels)) != len(labels):
        raise WorkflowError(f"sweep config: references: labels must be unique ({', '.join(labels)})")


def flatten(overrides: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Dotted (key, value) leaves of ``overrides``; `method` and `*.options` stay whole."""
    out = []
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted.split(".")[-1] not in WHOLE_SECTIONS:
            out.extend(flatten(value, dotted + "."))
        else:
            out.append((dotted, value))
    return out


def yaml_text(value) -> str:
    """``value`` as one line of YAML, which is how `agg-bench --set key=value` parses it."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def set_arg(key: str, value) -> str:
    """``--set key=value`` quoted for the shell."""
    return "--set " + shlex.quote(f"{key}={yaml_text(value)}")


class Sweep:
    """The jobs of a sweep config: runs, gradchecks, embeddings and imported references."""

    def __init__(self, sweep: dict):
        check_sweep(sweep)
        self.sweep = sweep
        base = sweep["base"]
        self.base_file = base if isinstance(base, str) else None
        self.base_pairs = [] if isinstance(base, str) else flatten(base)
        if self.base_file is not None and not Path(self.base_file).is_file():
            raise WorkflowError(f"sweep config: base: {self.base_file!r} is not a file "
                                "(a run config YAML, relative to the working directory)")
        self.devices = sweep["devices"]
        self.embed = sweep.get("embed")
        # models whose runs read prompt embeddings made by the embed rule
        self.embed_models = [] if self.embed is None else self.embed.get("models", list(sweep["models"]))
        self.runs = {}
        for method in sweep["methods"]:
            for model in sweep["models"]:
                for resolution in sweep["resolutions"]:
                    for seed in sweep["seeds"]:
                        for device in self.devices:
                            labels = {"method": method, "model": model, "resolution": resolution, "seed": seed,
                                      "device": device}
                            if not self.excluded(labels):
                                self._add_run(**labels)
        self.gradchecks = {}
        part = sweep.get("gradcheck")
        if part:
            device = part.get("device", next(iter(self.devices)))
            for model in part.get("models", list(sweep["models"])):
                for resolution in part.get("resolutions", sweep["resolutions"][:1]):
                    self._add_gradcheck(part, model, resolution, device)
        self.embeddings = {}
        if self.embed is not None:
            device = self.embed.get("device", next(iter(self.devices)))
            for model in self.embed_models:
                self.embeddings[model] = {"device": device, "pairs": self._pairs(device, model, None, None, {})}
        self.references = {ref["label"]: ref for ref in sweep.get("references", [])}

    def excluded(self, labels: dict) -> bool:
        """Whether an `exclude` entry matches every label it names (shell-style patterns: cache-*)."""
        return any(all(fnmatch.fnmatchcase(str(labels[key]), str(pattern)) for key, pattern in entry.items())
                   for entry in self.sweep.get("exclude", []))

    # ----- composing run configs ----------------------------------------------------------------
    def _pairs(self, device: str, model: str, resolution, seed, extra: dict) -> list[tuple[str, object]]:
        pairs = [*self.base_pairs, *flatten(self.sweep.get("set") or {}),
                 ("device", self.devices[device]["device"]), *flatten(self.sweep["models"][model])]
        if resolution is not None:
            pairs.append(("model.resolution", resolution))
        if seed is not None:
            pairs.append(("seed", seed))
        pairs.extend(flatten(extra))
        if model in self.embed_models:
            pairs.append(("prompts.cache_dir", EMBED_DIR))
        return pairs

    def _check(self, what: str, pairs: list[tuple[str, object]]):
        """Load the composed run config as `agg-bench run` will; any error names the job and the key."""
        from agg_bench.methods import build_method  # imports torch: only once the sweep's structure is fine

        try:
            cfg = load_config(self.base_file, [f"{k}={yaml_text(v)}" for k, v in pairs])
            options = dict(cfg.method)
            estimator = build_method(options.pop("name"), options)
            check_run = getattr(estimator, "check_run", None)
            if check_run is not None:
                check_run(cfg)
        except UserError as err:
            raise WorkflowError(f"sweep config: {what}: {err}") from None
        return cfg, estimator

    def _add_run(self, method, model, resolution, seed, device) -> None:
        run_id = f"{method}_{model}_{resolution}px_s{seed}_{device}"
        pairs = self._pairs(device, model, resolution, seed, self.sweep["methods"][method])
        cfg, estimator = self._check(f"run {run_id} (methods.{method}, models.{model})", pairs)
        options = {"name": cfg.method["name"], **dataclasses.asdict(estimator.config)}
        self.runs[run_id] = {"method": method, "model": model, "resolution": resolution, "seed": seed,
                             "device": device, "pairs": pairs, "method_options": options}

    def _add_gradcheck(self, part, model, resolution, device) -> None:
        name = f"{model}_{resolution}px_{device}"
        pairs = self._pairs(device, model, resolution, None, part.get("set") or {})
        self._check(f"gradcheck {name}", pairs)
        self.gradchecks[name] = {"model": model, "resolution": resolution, "device": device, "pairs": pairs}

    # ----- command lines ------------------------------------------------------------------------
    def _config_args(self, pairs) -> str:
        args = [f"--config {shlex.quote(self.base_file)}"] if self.base_file else []
        args += [set_arg(k, v) for k, v in pairs]
        return " ".join(args)

    def gpus(self, device: str) -> int:
        spec = self.devices[device]
        return int(spec.get("gpus", 1 if spec["device"] == "cuda" else 0))

    def threads(self, device: str) -> int:
        return int(self.devices[device].get("threads", 1))

    def launch(self, device: str, verb: str) -> str:
        """How a job of ``device`` starts `agg-bench VERB`: on pooled GPUs, with torchrun for several."""
        k = self.gpus(device)
        cli = f"{PYTHON} -m agg_bench {verb}"
        if k == 0:
            return cli
        if k > 1:
            cli = f"{PYTHON} -m torch.distributed.run --standalone --nproc_per_node {k} -m agg_bench {verb}"
        return f"{PYTHON} -m agg_bench.gpus --count {k} -- {cli}"

    def run_command(self, run_id: str) -> str:
        run = self.runs[run_id]
        return f"{self.launch(run['device'], 'run')} {self._config_args(run['pairs'])} --out results/runs/{run_id}"

    def gradcheck_command(self, name: str) -> str:
        job, part = self.gradchecks[name], self.sweep["gradcheck"]
        lists = {"--windows": part.get("windows", [2, 3, 5]), "--alphas": part.get("alphas", ["index", "sigma"]),
                 "--route-fracs": part.get("route_fracs", [0, 0.5, 1]), "--reuse": part.get("reuse", [False])}
        args = " ".join(f"{flag} {shlex.quote(','.join(json.dumps(v) if not isinstance(v, str) else v for v in values))}"
                        for flag, values in lists.items())
        methods = " ".join(f"--methods {shlex.quote(m)}" for m in part.get("methods", []))
        return (f"{self.launch(job['device'], 'gradcheck')} {self._config_args(job['pairs'])} {args} {methods} "
                f"--out results/gradcheck/{name}.csv")

    def embed_command(self, model: str) -> str:
        job = self.embeddings[model]
        return f"{self.launch(job['device'], 'embed')} {self._config_args(job['pairs'])} --out {EMBED_DIR}/{model}.safetensors"

    def import_command(self, label: str) -> str:
        ref = self.references[label]
        args = [f"--method {shlex.quote(ref.get('method', 'full'))}"]
        for key, flag in (("model", "--model"), ("resolution", "--resolution"), ("gpu_name", "--gpu-name"),
                          ("n_gpus", "--n-gpus")):
            if key in ref:
                args.append(f"{flag} {shlex.quote(str(ref[key]))}")
        return (f"{PYTHON} -m agg_bench import-log {shlex.quote(ref['log'])} {' '.join(args)} "
                f"--out results/imported/{label}")

    # ----- files --------------------------------------------------------------------------------
    def inputs(self, model: str) -> list[str]:
        """Files a run or gradcheck of ``model`` reads: the base config and the model's embeddings."""
        files = [self.base_file] if self.base_file else []
        if model in self.embed_models:
            files.append(f"{EMBED_DIR}/{model}.safetensors")
        pretrained = dict(flatten(self.sweep["models"][model])).get("model.pretrained")
        if isinstance(pretrained, str) and pretrained.startswith(PRETRAINED_DIR + "/"):  # made by rule pretrain
            files.append(pretrained)
        return files

    def summaries(self) -> list[str]:
        return [f"results/runs/{r}/summary.json" for r in self.runs] + \
            [f"results/imported/{label}/summary.json" for label in self.references]

    def gradcheck_files(self) -> list[str]:
        return [f"results/gradcheck/{name}.csv" for name in self.gradchecks]

    def manifest(self) -> dict:
        """What `agg-bench report --manifest` reads: every run folder with its labels."""
        runs = [{"dir": f"results/runs/{run_id}", "method": r["method"], "model": r["model"],
                 "resolution": r["resolution"], "seed": r["seed"], "device": r["device"],
                 "method_options": r["method_options"]} for run_id, r in self.runs.items()]
        runs += [{"dir": f"results/imported/{label}", "method": label,
                  "model": ref.get("model"), "resolution": ref.get("resolution")}
                 for label, ref in self.references.items()]
        checks = [{"file": f"results/gradcheck/{name}.csv", "model": g["model"], "resolution": g["resolution"]}
                  for name, g in self.gradchecks.items()]
        warmup = (self.sweep.get("report") or {}).get("warmup_iterations", 1)
        return {"runs": runs, "gradcheck": checks, "warmup": warmup}


EMBED_DIR = "results/embeddings"
PRETRAINED_DIR = "results/pretrained"
SWEEP = Sweep(config)
