"""Bad steps on a real gloo mesh: a NaN in one rank's gradient is skipped on *every* rank.

The skip decision is the global grad norm (reduced over dp, tp and pp), so one rank's NaN makes every
rank skip the update; the parameters then equal those of the single-process reference that skipped
the same batch (``ReferenceTrainer.run(..., skip=)``), and every rank reports the step as bad.
"""

from __future__ import annotations

import numpy as np
import pytest

from testbed.reference import MESH_FP64, assert_params_match, reference
from testbed.world import run_mesh, shutdown_pool

SMALL = ("model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4", 'train.dtype="float64"',
         "train.global_batch_size=8", "train.micro_batch_size=1")
STEPS, BAD_STEP, VICTIM = 6, 3, 3  # world rank 3 of a (2, 2, 1) mesh: dp 1, pp 1 (the last stage)


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def nan_on_rank_3_at_step_3(runtime):
    """run_mesh instrument: arm the NaN the way RankActor.arm_fault("nan") does (its fault seam,
    workers/faults.py, as the runtime's step hooks)."""
    from workers.faults import Faults

    if runtime.groups.world_rank == VICTIM:
        faults = Faults()
        faults.arm(BAD_STEP, "nan", 0.0, "step", 1)
        runtime.hooks = faults
    return None


@pytest.mark.timeout(300)
def test_nan_in_one_rank_gradient_skips_the_step_everywhere() -> None:
    run = run_mesh(2, 2, 1, SMALL, STEPS, instrument=nan_on_rank_3_at_step_3)
    bad = {rank: [r.bad for r in results] for rank, results in run.results.items()}
    for rank, flags in bad.items():  # one decision: every rank skipped step 3, and only it
        assert [i + 1 for i, f in enumerate(flags) if f] == [BAD_STEP], (rank, flags)
        assert run.results[rank][BAD_STEP - 1].skipped
    ref = reference(SMALL, STEPS, skip={BAD_STEP})
    assert ref.losses[BAD_STEP - 1] is None
    good = [i for i in range(STEPS) if i != BAD_STEP - 1]
    np.testing.assert_allclose([run.losses[i] for i in good], [ref.losses[i] for i in good], rtol=1e-9)
    assert_params_match(run.params, ref.params, MESH_FP64)
    # ... and differ from a run that trained on batch 3: the skip changed the parameters.
    trained = reference(SMALL, STEPS).params
    assert max(float(np.abs(trained[n] - ref.params[n]).max()) for n in ref.params) > 1e-4
