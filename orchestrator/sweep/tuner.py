"""`elastimesh tune JOB.toml --search KEY=SPACE ... --samples N`: a Ray Tune sweep of elastimesh jobs.

Ray Tune (`ray.tune.Tuner`, a function trainable) runs the trials; each trial is a whole elastic job
(`orchestrator/sweep/trial.py` says how it reserves and releases its ranks). `--scheduler asha` stops
bad trials early (`ASHAScheduler` on the per-step loss, `step` as its time axis); `--search-alg
optuna` samples with Optuna's TPE (the optional `tune` extra) instead of at random.

The sweep lives in `--dir`: `sweep.json` (the arguments and the job it was started with), Tune's
experiment `trials/` (one directory per trial: job.toml, metrics.jsonl, ...) and, at the end,
`best.toml`. Running the same command again resumes an interrupted sweep with `Tuner.restore`:
finished trials are not run again; trials that were running start over, from their own newest
checkpoint when the job has `checkpoint.dir`. Different arguments for an existing `--dir` are refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from meshspeak.schema import ConfigError, dump_toml
from meshspeak.sections import JobConfig, config_to_dict
from orchestrator.config.load import load_config
from orchestrator.metrics import unwritable
from orchestrator.sweep.space import Space, apply, parse_search, plain
from orchestrator.sweep.trial import run_trial, trial_resources

logger = logging.getLogger(__name__)

EXPERIMENT = "trials"  # Tune's experiment directory inside --dir
SWEEP_FILE = "sweep.json"
BEST_FILE = "best.toml"
SCHEDULERS = ("fifo", "asha")
SEARCH_ALGS = ("random", "optuna")


@dataclass
class Sweep:
    cfg: JobConfig
    spaces: dict[str, Space]
    samples: int
    scheduler: str = "fifo"
    search_alg: str = "random"
    max_concurrent: int = 0  # 0 = as many as the cluster holds
    seed: int = 0
    grace_steps: int = 0  # 0 = a quarter of the largest train.steps
    directory: str = "."
    base: dict = field(init=False)

    def __post_init__(self) -> None:
        self.base = config_to_dict(self.cfg)

    @property
    def max_world(self) -> int:
        """Ranks of the largest trial the search can draw."""
        return math.prod(int(self.spaces[f"mesh.{axis}"].largest()) if f"mesh.{axis}" in self.spaces
                         else getattr(self.cfg.mesh, axis) for axis in ("dp", "pp", "tp"))

    @property
    def max_steps(self) -> int:
        space = self.spaces.get("train.steps")
        return int(space.largest()) if space else self.cfg.train.steps

    def settings(self) -> dict[str, Any]:
        """What must match for a later invocation on the same --dir to be a resume."""
        return {"job": self.base, "search": [s.text for s in self.spaces.values()], "samples": self.samples,
                "scheduler": self.scheduler, "search_alg": self.search_alg, "seed": self.seed,
                "grace_steps": self.grace_steps}


def prepare(config_path: str | None, search: list[str], *, samples: int, scheduler: str = "fifo",
            search_alg: str = "random", max_concurrent: int = 0, seed: int = 0, grace_steps: int = 0,
            directory: str | None = None, overrides: list[str] = ()) -> Sweep:
    """Check every argument before anything starts (ConfigError: one line, exit 2)."""
    cfg = load_config(config_path, overrides)
    if samples < 1:
        raise ConfigError("--samples", f"--samples {samples}: a sweep needs at least one trial "
                                       "(--samples 1 or more)")  # fmt: skip
    if max_concurrent < 0 or grace_steps < 0:
        raise ConfigError("--max-concurrent", "--max-concurrent and --grace-steps must be >= 0 (0 = the default)")
    if not search:
        raise ConfigError("--search", "tune needs at least one --search KEY=SPACE, e.g. --search "
                                      "'train.lr=loguniform(1e-4,1e-2)'")  # fmt: skip
    spaces = parse_search(search)
    if search_alg == "optuna":
        grids = [s.text for s in spaces.values() if s.kind == "grid"]
        if grids:  # Tune's OptunaSearch refuses grid_search values
            raise ConfigError("--search-alg", f"--search {grids[0]!r}: --search-alg optuna samples every key "
                                              "itself and takes no grid(...): use choice(...) with optuna, or the "
                                              "default random search")  # fmt: skip
        _require_optuna()
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "tiny"
    sweep = Sweep(cfg, spaces, samples, scheduler, search_alg, max_concurrent, seed, grace_steps,
                  os.path.abspath(directory or os.path.join("sweeps", stem)))
    check_spaces(sweep.base, spaces)
    _check_resume(sweep)
    _check_writable(sweep.directory)
    return sweep


def _check_writable(directory: str) -> None:
    why = unwritable(directory)
    if why is not None:
        raise ConfigError("--dir", f"--dir {directory}: cannot write there ({why}): give a writable "
                                   "directory for the sweep")  # fmt: skip


def _require_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("--search-alg", "--search-alg optuna needs the optuna package: pip install "
                                          "'elastimesh[tune]' (or optuna), or use the default random "
                                          "search") from None  # fmt: skip


def check_spaces(base: dict, spaces: dict[str, Space]) -> None:
    """Every choice and both ends of every range must give a job `elastimesh train` accepts (checked
    one key at a time against the job's other values: combinations of two searched keys that do not
    fit each other fail as trials)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.toml")
        for space in spaces.values():
            for value in space.probes():
                with open(path, "w") as fh:
                    fh.write(dump_toml(apply(base, {space.key: value})))
                try:
                    load_config(path)
                except ConfigError as exc:
                    message = exc.message.removeprefix(f"{path}: ")
                    raise ConfigError(space.key, f"--search {space.text!r}: with {space.key}="
                                                 f"{value!r}: {message}") from None  # fmt: skip


def _check_resume(sweep: Sweep) -> None:
    path = os.path.join(sweep.directory, SWEEP_FILE)
    if not os.path.exists(path):
        return
    with open(path) as fh:
        before = json.load(fh)
    now = json.loads(json.dumps(sweep.settings()))
    if before != now:
        changed = sorted(k for k in now if before.get(k) != now.get(k))
        raise ConfigError("--dir", f"{sweep.directory} holds a sweep started with other {', '.join(changed)}: "
                                   "repeat its command to resume it, or give another --dir")  # fmt: skip


# --- running ----------------------------------------------------------------------------------------


def _scheduler(sweep: Sweep):
    if sweep.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    max_t = sweep.max_steps
    grace = min(sweep.grace_steps or max(1, max_t // 4), max_t)
    # reduction_factor 2: with a handful of trials, keep the better half at each rung.
    return ASHAScheduler(time_attr="step", max_t=max_t, grace_period=grace, reduction_factor=2)


def _search_alg(sweep: Sweep):
    if sweep.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=sweep.seed)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # Its own max_concurrent: Tune ignores TuneConfig.max_concurrent_trials for a search generator.
    return BasicVariantGenerator(random_state=sweep.seed, max_concurrent=sweep.max_concurrent)


def trial_dirname(trial) -> str:
    """`trial_<id>`: short and stable (Tune's default embeds the values, rounded)."""
    return f"trial_{trial.trial_id}"


def build_tuner(sweep: Sweep, use_gpu: bool, callbacks=(), verbose: bool = False):
    """A new Tuner, or the interrupted one restored from ``sweep.directory`` (which keeps the
    ``callbacks``, ray.tune.Callback objects, it was first made with). ``verbose``: Tune's own
    per-trial status tables (off: the sweep prints its result table only)."""
    from ray import tune

    base = apply(sweep.base, {"resources.use_gpu": use_gpu})  # trials and their reservation agree
    bundle = {"CPU": sweep.cfg.resources.cpus_per_worker}
    if use_gpu:
        bundle["GPU"] = 1.0
    trainable = tune.with_resources(tune.with_parameters(run_trial, base=base),
                                    resources=partial(trial_resources, base=base, bundle=bundle))
    path = os.path.join(sweep.directory, EXPERIMENT)
    if tune.Tuner.can_restore(path):
        logger.info("resuming the sweep in %s (finished trials are kept)", path)
        return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True)
    os.makedirs(sweep.directory, exist_ok=True)
    with open(os.path.join(sweep.directory, SWEEP_FILE), "w") as fh:
        json.dump(sweep.settings(), fh, indent=2)
    return tune.Tuner(
        trainable,
        param_space={key: space.to_tune() for key, space in sweep.spaces.items()},
        tune_config=tune.TuneConfig(
            metric="loss", mode="min", num_samples=sweep.samples, scheduler=_scheduler(sweep),
            search_alg=_search_alg(sweep), trial_dirname_creator=trial_dirname,
            max_concurrent_trials=(sweep.max_concurrent or None) if sweep.search_alg == "optuna" else None,
        ),
        # A trial's ranks recover inside the job; a trial that fails anyway failed for good.
        run_config=tune.RunConfig(name=EXPERIMENT, storage_path=sweep.directory, verbose=1 if verbose else 0,
                                  failure_config=tune.FailureConfig(max_failures=0), callbacks=list(callbacks)),
    )


def run_sweep(sweep: Sweep, callbacks=(), verbose: bool = False) -> list[dict]:
    """Run (or resume) the sweep on RAY_ADDRESS's cluster or an embedded local Ray; the trial rows."""
    import ray

    from orchestrator.launch import connect, resolve_gpu

    started_local = connect(sweep.cfg)
    try:
        if started_local:  # no autoscaler will add room: a trial that cannot fit would wait forever
            _check_fits(sweep, ray.cluster_resources().get("CPU", 0.0))
        tuner = build_tuner(sweep, resolve_gpu(sweep.cfg), callbacks, verbose)
        tuner.fit()
    finally:
        if started_local:
            ray.shutdown()
    return trial_rows(sweep)


def _check_fits(sweep: Sweep, cpus: float) -> None:
    from orchestrator.errors import WorkerGroupStartupError

    need = sweep.max_world * sweep.cfg.resources.cpus_per_worker
    if need > cpus:
        raise WorkerGroupStartupError(
            f"the largest trial has {sweep.max_world} ranks x resources.cpus_per_worker="
            f"{sweep.cfg.resources.cpus_per_worker:g} = {need:g} CPUs but the local Ray has {cpus:g}: "
            "lower resources.cpus_per_worker or the mesh values searched, or set RAY_ADDRESS to a cluster")


# --- results ----------------------------------------------------------------------------------------


def trial_rows(sweep: Sweep) -> list[dict]:
    """One row per trial from Tune's saved experiment state: its values, last step and loss, outcome."""
    from ray.tune import ExperimentAnalysis

    analysis = ExperimentAnalysis(os.path.join(sweep.directory, EXPERIMENT))
    rows = []
    for trial in sorted(analysis.trials, key=lambda t: t.trial_id):
        values = {key: plain(trial.config.get(key)) for key in sweep.spaces}
        steps = apply(sweep.base, values)["train"]["steps"]
        last = trial.last_result or {}
        step, loss = last.get("step"), last.get("loss")
        if trial.status == "ERROR":
            outcome = "failed"
        elif trial.status != "TERMINATED":
            outcome = "not finished"  # pending, or running when the sweep was interrupted
        elif step is not None and step < steps:
            outcome = f"stopped early at step {step}"
        else:
            outcome = "completed"
        rows.append({"trial": trial.trial_id, "values": values, "step": step, "steps": steps,
                     "loss": loss, "outcome": outcome, "status": trial.status,
                     "path": trial.path if hasattr(trial, "path") else ""})
    return rows


def best_row(rows: list[dict]) -> dict | None:
    """The completed trial with the lowest final loss (None if no trial completed)."""
    done = [r for r in rows if r["outcome"] == "completed" and r["loss"] is not None and math.isfinite(r["loss"])]
    return min(done, key=lambda r: r["loss"]) if done else None


def best_toml(sweep: Sweep, row: dict) -> str:
    """The job with the best trial's values, as TOML (checked with load_config before it is returned)."""
    text = dump_toml(apply(sweep.base, row["values"]))
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(text)
    try:
        load_config(fh.name)
    finally:
        os.unlink(fh.name)
    return text


def write_best(sweep: Sweep, text: str) -> str:
    path = os.path.join(sweep.directory, BEST_FILE)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def render_table(sweep: Sweep, rows: list[dict], best: dict | None):
    from rich.table import Table

    table = Table(title=f"elastimesh tune: {len(rows)} trial(s) in {sweep.directory}")
    table.add_column("trial")
    for key in sweep.spaces:
        table.add_column(key, justify="right")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("outcome")
    for r in sorted(rows, key=lambda r: (r["loss"] is None, r["loss"] if r["loss"] is not None else 0.0)):
        mark = " (best)" if best is not None and r["trial"] == best["trial"] else ""
        table.add_row(
            r["trial"] + mark, *(_show(r["values"][k]) for k in sweep.spaces),
            f"{r['step'] or 0}/{r['steps']}", "-" if r["loss"] is None else f"{r['loss']:.4f}",
            r["outcome"], style="bold" if mark else None,
        )
    return table


def _show(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def tune_command(args, callbacks=()) -> int:
    """`elastimesh tune`: 0 with a best config, 1 when no trial completed, 130 when interrupted.
    ``callbacks``: ray.tune.Callback objects for the driver's loop (tests inject faults with them)."""
    import sys

    from rich.console import Console

    sweep = prepare(args.config, args.search, samples=args.samples, scheduler=args.scheduler,
                    search_alg=args.search_alg, max_concurrent=args.max_concurrent, seed=args.seed,
                    grace_steps=args.grace_steps, directory=args.dir, overrides=args.overrides)
    rows = run_sweep(sweep, callbacks, verbose=getattr(args, "verbose", False))
    best = best_row(rows)
    Console().print(render_table(sweep, rows, best))
    if any(r["outcome"] == "not finished" for r in rows):
        sys.stderr.write(f"elastimesh: the sweep was interrupted: run the same command again to resume "
                         f"it from {sweep.directory}\n")
        return 130
    if best is None:
        sys.stderr.write("elastimesh: error: no trial completed, so there is no best config: see the "
                         f"trials' metrics.jsonl under {os.path.join(sweep.directory, EXPERIMENT)}\n")
        return 1
    text = best_toml(sweep, best)
    path = write_best(sweep, text)
    sys.stdout.write(f"# best: trial {best['trial']}, loss {best['loss']:.4f} at step {best['step']}; "
                     f"train with `elastimesh train {path}`\n{text}")
    return 0
