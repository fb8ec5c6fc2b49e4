"""Metrics sinks: the JSONL contract, a progress display, TensorBoard, Ray metrics, step timelines.

JSONL records follow README.md ("Metrics") exactly (one object per line, flushed as written); we add
``bubble`` (measured pipeline bubble fraction) to step records, which ``step_record`` makes from the
ranks' ``StepResult``s. The Chrome-trace/Perfetto timeline
(``metrics.timeline``) shows one row per rank with every pipeline action of the latest step.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from meshspeak.lr_schedule import lr_at
from meshspeak.mesh import MeshShape
from meshspeak.messages import StepResult
from orchestrator.errors import UserInputError

logger = logging.getLogger(__name__)


def check_outputs(cfg) -> None:
    """Prove every metrics output writable before any actor starts (bad input: one line, exit 2).

    ``MetricsLog`` opens the files only once the actors are up, and the timeline is first written
    after the first step: without this, a bad path ends a run that already spent its start-up, with
    a traceback. Creates missing parent directories (``MetricsLog`` would) and nothing else.
    """
    if cfg.path:
        _check_file("metrics.path", cfg.path, 'a file in a writable directory, or metrics.path="" for no JSONL')
    if cfg.timeline:
        _check_file("metrics.timeline", cfg.timeline, "a file in a writable directory, or unset it")
    if cfg.tensorboard_dir:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise UserInputError(
                "metrics.tensorboard_dir needs tensorboardX: pip install 'elastimesh[tensorboard]', "
                "or unset metrics.tensorboard_dir") from None
        if "://" not in cfg.tensorboard_dir:  # remote URIs are tensorboardX's business
            _check_dir("metrics.tensorboard_dir", cfg.tensorboard_dir,
                       "set metrics.tensorboard_dir to a writable directory, or unset it")
    from orchestrator.tracking.sinks import check_trackers

    check_trackers(cfg)  # metrics.mlflow_uri / metrics.wandb_project: their extras are installed
    if cfg.profile_steps:  # the ranks write the traces; on one machine this is their directory too
        from meshspeak.profile import profile_dir

        _check_dir("metrics.profile_dir", profile_dir(cfg), "set metrics.profile_dir to a writable directory")


def _check_file(key: str, path: str, fix: str) -> None:
    if os.path.isdir(path):
        raise UserInputError(f"{key}={path} is a directory; set {key} to {fix}")
    _check_dir(key, os.path.dirname(os.path.abspath(path)), f"set {key} to {fix}", shown=path)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UserInputError(f"{key}={path} is not writable; set {key} to {fix}")


def unwritable(directory: str) -> str | None:
    """Why ``directory`` cannot be created and written (a probe file, then removed), or None if it can."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _check_dir(key: str, directory: str, fix: str, shown: str | None = None) -> None:
    why = unwritable(directory)
    if why is not None:
        raise UserInputError(f"{key}={shown or directory}: cannot write in {directory} ({why}); {fix}")


def bubble_fraction(results: list[StepResult]) -> float:
    """1 - (compute time summed over ranks) / (ranks x slowest rank's step time)."""
    if not results:
        return 0.0
    wall = max(r.step_time_s for r in results)
    if wall <= 0:
        return 0.0
    return max(0.0, 1.0 - sum(r.compute_s for r in results) / (len(results) * wall))


def step_record(step: int, results: list[StepResult], *, train, seq_len: int, shape: MeshShape,
                generation: int) -> dict[str, Any]:
    """The JSONL record of one completed step: the global-batch loss (each replica reports its share),
    the slowest rank's wall time, throughput, the learning rate, the mesh, the bubble, and the most CPU
    seconds one rank's training thread spent in the step (``StepResult.own_s``: other processes on a
    loaded machine do not inflate it, so a wall time far above it means the step waited)."""
    loss = sum(r.loss for r in results if r.loss is not None)
    wall = max(r.step_time_s for r in results)
    tokens = train.global_batch_size * seq_len
    return {
        "step": step, "loss": loss, "lr": lr_at(step, train), "tokens": tokens,
        "step_time_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "dp": shape.dp, "pp": shape.pp, "tp": shape.tp, "generation": generation,
        "bubble": bubble_fraction(results), "cpu_s": max(r.own_s for r in results),
        **_loss_scale_fields(results),
        **_dp_bytes_field(results),
        **_recompiles_field(results),
    }


def _recompiles_field(results: list[StepResult]) -> dict[str, Any]:
    """train.compile: the most graphs one rank compiled again in the step (workers/compile_stats.py)."""
    counts = [r.recompiles for r in results if getattr(r, "recompiles", None) is not None]
    return {"recompiles": max(counts)} if counts else {}


def _dp_bytes_field(results: list[StepResult]) -> dict[str, Any]:
    """dp > 1: the most bytes one rank sent over dp in the step (compressed, where it is: PowerSGD's P/Q,
    int8/int4 rows, 1-bit Adam's signs)."""
    sent = [r.dp_bytes for r in results if getattr(r, "dp_bytes", None) is not None]
    return {"dp_bytes": max(sent)} if sent else {}


def _loss_scale_fields(results: list[StepResult]) -> dict[str, Any]:
    """fp16 runs: the step's loss scale and whether its update was skipped (every rank agrees)."""
    scales = [r.loss_scale for r in results if r.loss_scale is not None]
    if not scales:
        return {}
    return {"loss_scale": scales[0], "skipped": any(r.skipped for r in results)}


def write_timeline(path: str, step: int, results: list[StepResult]) -> None:
    """Chrome trace (chrome://tracing, ui.perfetto.dev): one row (tid) per world rank."""
    events: list[dict[str, Any]] = []
    for r in sorted(results, key=lambda r: r.world_rank):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r.world_rank,
                       "args": {"name": f"rank {r.world_rank}"}})
        for t in r.timings:
            events.append({
                "name": t.action, "ph": "X", "pid": 0, "tid": r.world_rank,
                "ts": t.start_s * 1e6, "dur": max(0.0, t.end_s - t.start_s) * 1e6,
                "cat": "compute" if t.action.rstrip("0123456789")[-1:] in "FB" else "comm",
            })
    tmp = f"{path}.tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "otherData": {"step": step}}, f)
    os.replace(tmp, path)


class MetricsLog:
    """The one place records go: the JSONL file, TensorBoard, Ray metrics, the progress display and
    the experiment trackers (``trackers``: orchestrator/tracking/sinks.py), all from the driver.

    ``launched_at``: when the run began (before Ray and the actors started); the first record, a
    ``launch`` event, carries it, so ``elastimesh report`` can count the start-up (default: now).
    """

    def __init__(self, cfg, *, progress_total: int | None = None, ray_metrics: bool = True,
                 launched_at: float | None = None, trackers=()) -> None:
        self.cfg = cfg
        self.step_listeners: list[Callable[[dict], None]] = []  # e.g. a Tune trial reporting each step
        # data.mix: step -> per-source counters after it (meshdata.mixture.source_counters), put in
        # every step record as "sources"; None for a single data.path.
        self.data_counters: Callable[[int], list[dict]] | None = None
        self.trackers = list(trackers)
        self._file = None
        if cfg.path:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.path)), exist_ok=True)
            self._file = open(cfg.path, "a", buffering=1)
        self._write({"event": "launch", "time": launched_at if launched_at is not None else time.time()})
        self._tb = None
        if cfg.tensorboard_dir:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(cfg.tensorboard_dir)
        self._ray = None
        if ray_metrics:
            try:  # the Ray half lives with the cluster code (orchestrator/cluster/ray_metrics.py)
                from orchestrator.cluster.ray_metrics import RayMetrics

                self._ray = RayMetrics()
            except Exception as exc:  # metrics are best-effort; training must not depend on them
                logger.debug("ray metrics unavailable: %s", exc)
        self._progress = None
        if progress_total:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False,
            )
            self._task = self._progress.add_task("train", total=progress_total, info="")
            self._progress.start()

    def _write(self, rec: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")

    def step(self, rec: dict) -> None:
        rec.setdefault("time", time.time())  # when it was written: the report's time axis
        if self.data_counters is not None:
            rec.setdefault("sources", self.data_counters(rec["step"]))
        self._write(rec)
        for tracker in self.trackers:
            tracker.step(rec)
        if self._tb is not None:
            for key in ("loss", "lr", "tokens_per_s", "step_time_s", "bubble"):
                if key in rec:
                    self._tb.add_scalar(f"train/{key}", rec[key], rec["step"])
        if self._ray is not None:
            self._ray.on_step(rec)
        for listener in self.step_listeners:
            listener(rec)
        line = (
            f"step {rec['step']:>5}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
            f"{rec['tokens_per_s']:,.0f} tok/s  {rec['step_time_s']:.2f}s  "
            f"mesh dp={rec['dp']} pp={rec['pp']} tp={rec['tp']} gen={rec['generation']}"
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=rec["step"], info=f"loss {rec['loss']:.4f}")
            if rec["step"] % max(1, self.cfg.log_every) == 0:
                self._progress.console.print(line, highlight=False)
        elif rec["step"] % max(1, self.cfg.log_every) == 0:
            logger.info(line)

    def event(self, event: str, **fields: Any) -> None:
        rec = {"event": event, **fields, "time": time.time()}
        self._write(rec)
        for tracker in self.trackers:
            tracker.event(rec)
        if self._ray is not None:
            self._ray.on_event(rec)
        message = f"{event}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
        if self._progress is not None:
            self._progress.console.print(message, highlight=False)
        else:
            logger.info(message)

    def eval(self, step: int, loss: float, perplexity: float, **fields: Any) -> None:
        """The held-out evaluation after step ``step``: an "eval" event, and eval/* in TensorBoard."""
        self.event("eval", step=step, loss=loss, perplexity=perplexity, **fields)
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", loss, step)
            self._tb.add_scalar("eval/perplexity", perplexity, step)

    def timeline(self, step: int, results: list[StepResult]) -> None:
        if self.cfg.timeline:
            write_timeline(self.cfg.timeline, step, results)

    def close(self, status: str = "FINISHED") -> None:
        """``status``: the trackers' run status, "FINISHED" or "FAILED"."""
        for tracker in self.trackers:
            tracker.close(status)
        self.trackers = []
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
            self._file = None
