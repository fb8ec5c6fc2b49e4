"""Per-rank PyTorch Profiler traces of the training steps `metrics.profile_steps` names.

Every rank writes one trace per profiled step with `torch.profiler.tensorboard_trace_handler`:
`<metrics.profile_dir>/rank{R}-gen{G}-step{K}.<time stamp>.pt.trace.json`. The files are Chrome trace JSON,
so Perfetto (ui.perfetto.dev) and chrome://tracing open them, and TensorBoard's profiler plugin
(`torch-tb-profiler`) shows the directory as one run with one worker per file. Inside, the step is
the range `ProfilerStep#K`, the name that plugin's step view looks for.

Why one file per step rather than one per A..B window: a rebuild may come between two steps of the
window, after which the rank may have another world rank in another generation; a trace per step
needs no profiler state across calls (nothing to flush when a generation ends or the actor dies) and
names the rank and generation that step really ran as. A step re-run after a rebuild is profiled
again, under the new generation's name, so nothing is overwritten.

The driver builds the `ProfileSpec` (``meshspeak.profile``); torch is imported here only when a step is profiled.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

from meshspeak.profile import ProfileSpec, worker_name

logger = logging.getLogger(__name__)


@contextmanager
def profiled_step(spec: ProfileSpec | None, step: int, rank: int, generation: int) -> Iterator[None]:
    """Run the body under torch.profiler when ``spec`` covers ``step``; else run it plainly."""
    if spec is None or not spec.covers(step):
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

    write = tensorboard_trace_handler(spec.out_dir, worker_name=worker_name(rank, generation, step))

    def on_trace_ready(prof) -> None:
        try:
            write(prof)
        except Exception as exc:  # a trace that cannot be written must not fail the step
            logger.warning("profiler trace of step %d not written to %s: %s", step, spec.out_dir, exc)

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, on_trace_ready=on_trace_ready):
        with record_function(f"ProfilerStep#{step}"):
            yield
