"""A checkpoint moves between data-parallel strategies: ZeRO-0 -> ZeRO-3 -> HSDP -> ZeRO-0.

Each leg is a ``run_mesh`` run that loads the previous leg's checkpoint before its first step and
saves after its last (``RankRuntime.save_checkpoint``: DCP, resharding on load). The eight losses
and the final parameters must equal one process's uninterrupted eight steps (1e-5), so parameters
*and* optimizer state crossed every change of layout: ZeRO-0 on plain dp (torch DDP: plain
replicated tensors, ``meshspeak.dp_plan.ddp_applies``), sharded (Shard(0) over dp, TP DTensors on
(dp, tp)), and HSDP (Replicate, Shard(0)) on (2, 2).
"""

from __future__ import annotations

import os

import pytest

from checkpoints.layout import step_dir_name
from testbed.mesh_cases import SMALL
from testbed.reference import assert_matches_reference, reference
from testbed.world import run_mesh, shutdown_pool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


class LoadTrainSave:
    """An ``instrument``: load ``load`` (if any) before the first step, save step ``save`` under ``root``."""

    def __init__(self, load: str | None, root: str, save: int) -> None:
        self.load, self.root, self.save = load, root, save

    def __call__(self, runtime):
        if self.load:
            runtime.load_checkpoint(self.load)
        real = runtime.train_step

        def train_step(step, actions):
            result = real(step, actions)
            if step == self.save:
                runtime.save_checkpoint(os.path.join(self.root, step_dir_name(step)), step)
                runtime.wait_checkpoint()
            return result

        runtime.train_step = train_step
        return None


LEGS = [  # (dp, pp, tp), overrides
    ((2, 1, 1), ("mesh.zero=0",)),
    ((2, 1, 2), ("mesh.zero=3",)),
    ((4, 1, 1), ("mesh.zero=3", "mesh.dp_replicate=2")),
    ((2, 1, 1), ("mesh.zero=0",)),
]


@pytest.mark.timeout(360)
def test_checkpoint_round_trip_zero0_zero3_hsdp_zero0(tmp_path):
    assert_legs_match_one_process(LEGS, str(tmp_path))


def assert_legs_match_one_process(legs, root: str) -> None:
    """Two steps per leg, each leg loading the checkpoint the one before saved: together they equal
    one process's 2 * len(legs) steps (losses and final parameters, 1e-5)."""
    load, losses, run = None, [], None
    for i, (shape, extra) in enumerate(legs):
        first, last = 2 * i + 1, 2 * i + 2
        run = run_mesh(*shape, (*SMALL, *extra), 2, first_step=first,
                       collect_params=i == len(legs) - 1, instrument=LoadTrainSave(load, root, last))
        losses += run.losses
        load = os.path.join(root, step_dir_name(last))
    assert_matches_reference(losses, run.params, reference(SMALL, 2 * len(legs)))


PSGD = ("mesh.zero=0", 'train.grad_compression="powersgd"')


@pytest.mark.timeout(360)
def test_powersgd_layout_checkpoints_round_trip(tmp_path):
    """PowerSGD's layout (FSDP2 over the one-rank shard axis) saves and loads like the others, and
    its compressor starts afresh in every generation: its first two steps are plain all-reduces, so
    two-step legs powersgd -> ZeRO-3 (2,1,2) -> powersgd equal one process's six steps exactly."""
    assert_legs_match_one_process([((2, 1, 1), PSGD), ((2, 1, 2), ("mesh.zero=3",)), ((2, 1, 1), PSGD)],
                                  str(tmp_path))
