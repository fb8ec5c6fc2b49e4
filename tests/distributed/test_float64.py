"""``train.dtype = "float64"``: a sharded mesh reproduces the fp64 single-process reference to 1e-9.

fp64 end to end (parameters, gradients, Adam moments, FSDP2's reductions, pipeline boundaries, the
loss) is what lets long fault runs be compared with the reference at 1e-9 instead of fp32's 1e-5:
any difference left is the summation order of the reductions. A (2, 1, 2) mesh covers FSDP2 over dp
and TP over tp in one run; 10 steps on the small model (a wrong reduction or a lost upcast shows from
the first steps on).
"""

from __future__ import annotations

import numpy as np
import pytest

from testbed.reference import MESH_FP64, assert_matches_reference, reference
from testbed.world import run_mesh, shutdown_pool

FP64 = ("model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4", 'train.dtype="float64"',
        "train.global_batch_size=8", "train.micro_batch_size=1")
STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


@pytest.mark.timeout(300)
def test_fp64_mesh_matches_fp64_reference_to_1e9() -> None:
    ref = reference(FP64, STEPS)
    run = run_mesh(2, 1, 2, FP64, STEPS)
    assert_matches_reference(run.losses, run.params, ref, MESH_FP64)
    for name, expected in ref.params.items():
        assert expected.dtype == np.float64 and run.params[name].dtype == np.float64, name
