"""``elastic.rebalance``: replicas running different numbers of microbatches train exactly like one process.

Each test trains a local gloo mesh (``testbed.world.run_mesh``) with a split forced for every step
instead of measured — uneven, changing from step to step, down to one microbatch for a replica (fewer
than pp in the pipeline cases) — each rank running its replica's schedule for its own count, as the
driver hands them out (orchestrator/control/rebalance.py). Every step's loss and every final
parameter must equal the single-process reference within 1e-5 (``MESH_FP32``), at ZeRO-0 (DDP, and
HSDP with one-rank shards under PP), ZeRO-2 with TP, ZeRO-3 with one FSDP unit per block (the case
whose all-gathers depend on the count: meshspeak/dp_plan.py), HSDP, PP 1F1B, GPipe, interleaved and
the zero-bubble ZB-H1 and ZB-V, and the full 2x2x2 mesh.

The last test is the reason for the plan's ZeRO-3 rule: the same uneven splits with units resharded
after every forward pair different all-gathers on the two replicas and time out.
"""

from __future__ import annotations

import pytest

from testbed.mesh_cases import SMALL, mesh_id
from testbed.reference import assert_matches_reference, reference
from testbed.world import MeshRunError, run_mesh, shutdown_pool

BATCH = ("train.global_batch_size=8", "train.micro_batch_size=1")  # 8 microbatches per step
ON = ("elastic.rebalance=true",)
PER_BLOCK = ("mesh.fsdp_unit_mb=0",)  # one FSDP unit per block: ZeRO-3 reshards each after forward
STEPS = 6
TWO = [(3, 5), (7, 1), (1, 7), (5, 3), (6, 2), (4, 4)]
FOUR = [(5, 1, 1, 1), (1, 1, 1, 5), (2, 3, 2, 1), (1, 2, 2, 3), (3, 3, 1, 1), (2, 2, 2, 2)]
PAIRS = [(6, 2), (2, 6), (4, 4), (6, 2), (2, 6), (6, 2)]  # interleaved at pp=2: quanta of 2

CASES = [  # (shape, overrides, splits, schedule, virtual_stages)
    ((2, 1, 1), ("mesh.zero=3", *PER_BLOCK), TWO, "1f1b", 1),
    ((2, 2, 1), ("mesh.zero=3", *PER_BLOCK), TWO, "1f1b", 1),
    ((4, 1, 1), ("mesh.zero=3", "mesh.dp_replicate=2", *PER_BLOCK), FOUR, "1f1b", 1),
    ((2, 1, 1), ("mesh.zero=0",), TWO, "1f1b", 1),  # torch DDP
    ((2, 1, 2), ("mesh.zero=2",), TWO, "1f1b", 1),  # TP inside each replica
]
SLOW_CASES = [
    ((2, 2, 1), ("mesh.zero=0",), TWO, "1f1b", 1),  # HSDP with one-rank shards
    ((2, 2, 1), ("mesh.zero=3", *PER_BLOCK), PAIRS, "interleaved_1f1b", 2),
    ((2, 2, 1), ("mesh.zero=2",), TWO, "gpipe", 1),
    ((2, 2, 1), ("mesh.zero=3", *PER_BLOCK), TWO, "zb-h1", 1),  # backward split into I and W
    ((2, 2, 1), ("mesh.zero=2",), TWO, "zbv", 2),
    ((2, 2, 2), ("mesh.zero=3", *PER_BLOCK), TWO, "1f1b", 1),
]


def _id(case) -> str:
    shape, overrides, _, schedule, _ = case
    zero = next(o for o in overrides if o.startswith("mesh.zero=")).split("=")[1]
    hsdp = "-hsdp" if any(o.startswith("mesh.dp_replicate") for o in overrides) else ""
    return f"{mesh_id(shape)}-zero{zero}{hsdp}-{schedule}"


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def _check(case) -> None:
    (dp, pp, tp), overrides, splits, schedule, virtual_stages = case
    job = SMALL + BATCH + ON + overrides
    run = run_mesh(dp, pp, tp, job, STEPS, schedule=schedule, virtual_stages=virtual_stages, splits=splits)
    assert_matches_reference(run.losses, run.params, reference(SMALL + BATCH, STEPS))
    # Each rank ran its replica's count: the forwards of its last stage's list, per step.
    for rank, results in run.results.items():
        coords = run.shape.coords(rank)
        for split, result in zip(splits, results, strict=True):
            forwards = [t for t in result.timings if "F" in t.action and "SEND" not in t.action
                        and "RECV" not in t.action]
            assert len(forwards) == split[coords.dp] * virtual_stages


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_uneven_split_matches_reference(case) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", SLOW_CASES, ids=[_id(c) for c in SLOW_CASES])
def test_uneven_split_matches_reference_more_layouts(case) -> None:
    _check(case)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_resharded_after_forward_hangs_on_uneven_splits() -> None:
    """Without ``elastic.rebalance`` in the plan (units resharded after each forward), the same forced
    splits leave the replicas in different all-gathers: the run ends in the collective timeout."""
    with pytest.raises(MeshRunError, match="Timed out|timeout"):
        run_mesh(2, 1, 1, SMALL + BATCH + ("mesh.zero=3", *PER_BLOCK), 2, splits=TWO[:2],
                 collective_timeout_s=15, timeout=120, fresh=True)
