"""One trial of `elastimesh tune`: a whole elastimesh job, run by a Ray Tune function trainable.

Resources: Tune reserves each trial one placement group, `trial_resources`: an empty head bundle for
the trainable itself (the job's driver loop waits on its actors and needs no CPU) and one bundle per
rank, as `elastimesh train` would reserve. The trial hands that group to its `WorkerGroup`
(`run_job(reserved=...)`), so Tune starts a trial only when all its ranks fit, `--max-concurrent K`
trials run side by side, and no rank lands outside the trial's reservation. The job is elastic as
always: a rank that dies is dropped and its bundle refilled by a replacement, inside the trial.

Every step record goes to Tune (`ray.tune.report`, from a MetricsLog step listener) with `step` as
the time axis ASHA reads. Steps re-run after a rebuild are not reported again: their loss is the same
math, and Tune's history stays one value per step.

Stopping: when ASHA (or Ctrl-C) stops a trial, Tune's function runner makes the pending `report`
raise SystemExit in the trial's thread; that unwinds `run_job`, whose `finally` kills the rank actors
(`WorkerGroup.shutdown`) and drops the store. Tune does not wait for that thread: once `stop()` has
returned it removes the trial's placement group, and Ray then ends every actor placed in it -- the
ranks and the trainable (the store, not placed in it, is owned by the trainable and ends with it).
Either way nothing outlives the trial (tests/ray/test_sweep.py checks the actor and placement group
tables); measured here, the `finally` ran first (the ranks died by `ray.kill`).

Per trial, in the trial directory: `job.toml` (the exact config; `elastimesh train` accepts it),
`metrics.jsonl`, and `tensorboard/`, `timeline.json`, `profiles/` when the job asks for them. A
`checkpoint.dir` gets one subdirectory per trial id, so trials never share checkpoints and an
interrupted trial that Tune restarts resumes from its own newest one.
"""

from __future__ import annotations

import math
import os
from typing import Any

from meshspeak.schema import dump_toml
from orchestrator.config.load import load_config
from orchestrator.sweep.space import apply

JOB_FILE = "job.toml"
METRICS_FILE = "metrics.jsonl"
REPORTED = ("loss", "lr", "tokens_per_s", "generation", "dp", "pp", "tp")


def trial_world(base: dict, config: dict[str, Any]) -> int:
    mesh = apply(base, config)["mesh"]
    return math.prod(int(mesh[axis]) for axis in ("dp", "pp", "tp"))


def trial_resources(config: dict[str, Any], *, base: dict, bundle: dict[str, float]):
    """Tune's reservation for one trial: an empty head bundle (the trainable) + one bundle per rank."""
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory([{}] + [dict(bundle)] * trial_world(base, config), strategy="PACK")


def trial_doc(base: dict, config: dict[str, Any], trial_dir: str, trial_id: str) -> dict:
    """The trial's job: the sweep's job with the sampled values, and the trial's own output paths."""
    doc = apply(base, config)
    metrics = doc["metrics"]
    metrics["path"] = os.path.join(trial_dir, METRICS_FILE)
    if metrics.get("tensorboard_dir"):
        metrics["tensorboard_dir"] = os.path.join(trial_dir, "tensorboard")
    if metrics.get("timeline"):
        metrics["timeline"] = os.path.join(trial_dir, "timeline.json")
    if metrics.get("profile_steps"):
        metrics["profile_dir"] = os.path.join(trial_dir, "profiles")
    ckpt = doc["checkpoint"]
    if ckpt.get("dir"):
        ckpt["dir"] = ckpt["dir"].rstrip("/") + "/" + trial_id
    return doc


class StepReporter:
    """MetricsLog step listener: each step's record to Tune, once per step."""

    def __init__(self, report) -> None:
        self._report = report
        self.last_step = 0

    def __call__(self, rec: dict) -> None:
        if rec["step"] <= self.last_step:
            return  # re-run after a rebuild: reported already
        self.last_step = rec["step"]
        self._report({"step": rec["step"], **{k: rec[k] for k in REPORTED if k in rec}})


def run_trial(config: dict[str, Any], *, base: dict) -> None:
    """The function trainable: write the trial's job.toml, load it as `train` would, run the job."""
    import ray
    from ray import tune

    from orchestrator.launch import run_job

    ctx = tune.get_context()
    trial_dir = ctx.get_trial_dir()
    os.makedirs(trial_dir, exist_ok=True)
    path = os.path.join(trial_dir, JOB_FILE)
    with open(path, "w") as fh:
        fh.write(dump_toml(trial_doc(base, config, trial_dir, ctx.get_trial_id())))
    cfg = load_config(path)
    run_job(cfg, progress=False, reserved=ray.util.get_current_placement_group(),
            step_listeners=[StepReporter(tune.report)])
