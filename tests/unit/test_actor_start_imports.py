"""A rank actor's start imports no more than its run needs: every actor of a run imports torch, FSDP2,
DTensor and DCP as it starts (``RankActor.warm``), and on a 2-core machine five of them at once take
most of a run's start-up. dynamo (``torch._dynamo``, with ``torch.distributed.pipelining``) costs
0.7-0.9 s of CPU more per actor (of ~4 s) and is needed only by ``train.compile`` and the zero-bubble schedules;
it was imported by a decorator (``torch.compiler.disable`` on the compute clock's hooks) and by a
module-level import of pipelining's helpers (``workers/split_backward.py``). Each check runs in a
fresh interpreter: this one has imported dynamo long ago."""

from __future__ import annotations

import subprocess
import sys

import pytest

WARM_AND_CLOCK = """
import sys
import types
from workers.actor import RankActor
RankActor.warm(types.SimpleNamespace(dynamo=False))  # the imports an actor makes as it starts
import torch
from workers.compute_clock import ComputeClock
import workers.split_backward  # noqa: F401  (the executor's, for every schedule)
block = torch.nn.Linear(2, 2)
clock = ComputeClock([block], compiled={compiled})
block(torch.zeros(1, 2))
print(sorted(m for m in ("torch._dynamo", "torch.distributed.pipelining") if m in sys.modules))
"""


def _loaded(compiled: bool) -> str:
    out = subprocess.run([sys.executable, "-c", WARM_AND_CLOCK.format(compiled=compiled)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_an_uncompiled_rank_start_imports_no_dynamo():
    assert _loaded(compiled=False) == "[]"


def test_a_compiled_run_clock_wraps_its_hooks_out_of_dynamo():
    assert "'torch._dynamo'" in _loaded(compiled=True)  # the check above can fail


def test_a_run_that_needs_dynamo_imports_it_as_its_actors_start():
    """``train.compile`` or a zero-bubble schedule (``launch.py`` passes ``dynamo``): imported in
    ``warm``, before the heap is frozen, so the rebuilds' full collections never scan it."""
    code = ("import gc, sys, types\nfrom workers.actor import RankActor\n"
            "RankActor.warm(types.SimpleNamespace(dynamo=True))\n"
            "print('torch._dynamo' in sys.modules, gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True True"


@pytest.mark.parametrize("overrides,dynamo", [([], False), (["train.compile=true"], True),
                                              (["mesh.pp=2", "pipeline.schedule=zb-h1"], True)])
def test_the_launch_tells_the_actors_whether_the_run_needs_dynamo(overrides, dynamo):
    from orchestrator.config.load import load_config
    from orchestrator.launch import actor_kwargs

    assert actor_kwargs(load_config(None, overrides))["dynamo"] is dynamo
