"""Other model families train on any mesh exactly like one process (10 AdamW steps, fp32).

The same comparison as ``test_mesh_equivalence``, for the example user family
(``examples/posnorm_family.py``: LayerNorm, learned positions) and for the ``llama`` family shaped from a
Hugging Face ``config.json`` (GQA 4 heads / 2 KV heads, q/k/v bias, tied embeddings: at pp=2 the
embedding and the head live on different ranks and their gradients are summed each step).
"""

from __future__ import annotations

import pytest

from tests.distributed.test_mesh_equivalence import STEPS, assert_matches_reference
from tests.helpers.world import reference, run_mesh, shutdown_pool

BATCH = ("train.global_batch_size=8", "train.micro_batch_size=1")
POSNORM = ('model.family="examples.posnorm_family:PosNormFamily"', "model.d_model=32", "model.n_heads=4",
           "model.seq_len=32", "model.n_layers=4", *BATCH)


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


@pytest.mark.timeout(300)
def test_example_user_family_at_2x2x2_matches_one_process() -> None:
    run = run_mesh(2, 2, 2, POSNORM, STEPS)
    assert_matches_reference(run, reference(POSNORM, STEPS))
