"""Other model families train on any mesh exactly like one process (10 AdamW steps, fp32).

The same comparison as ``test_mesh_equivalence``, for the example user family
(``examples/posnorm_family.py``: LayerNorm, learned positions) and for the ``llama`` family shaped from a
Hugging Face ``config.json`` (GQA 4 heads / 2 KV heads, q/k/v bias, tied embeddings: at pp=2 the
embedding and the head live on different ranks and their gradients are summed each step).
"""

from __future__ import annotations

import pytest

from tests.distributed.test_mesh_equivalence import STEPS, assert_matches_reference
from testbed.world import reference, run_mesh, shutdown_pool

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


# --- llama from Hugging Face weights ------------------------------------------------------------
# GQA 4 heads / 2 KV heads, q/k/v(/o) bias, tied embeddings; 6 sequences per step so that dp=3 works
# (uneven FSDP shards: 256 vocab rows over 3 ranks are 86/85/85, 32 K/V rows 11/11/10).
HF_BATCH = ("train.global_batch_size=6", "train.micro_batch_size=1", "model.seq_len=32")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    from testbed.hf_models import save_tiny_llama

    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_llama(directory, tie=True, bias=True, layers=2)
    return directory


def tied_copy(runtime):
    """An ``instrument`` hook: the last stage's own copy of the tied embedding, on a rank that holds one."""
    from torch.distributed.tensor import DTensor

    def finish():
        out = {}
        for param in runtime.tied.params:
            if runtime.tied.is_copy(param):
                full = param.full_tensor() if isinstance(param, DTensor) else param
                out["copy"] = full.detach().numpy().copy()
        return out

    return finish


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(3, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 2)],
                         ids=lambda s: "dp{}-pp{}-tp{}".format(*s))
def test_llama_from_hf_matches_one_process(hf_dir, shape) -> None:
    import numpy as np

    dp, pp, tp = shape
    overrides = (f"model.from_hf={hf_dir}", f"checkpoint.init_from={hf_dir}", *HF_BATCH)
    run = run_mesh(dp, pp, tp, overrides, STEPS, instrument=tied_copy if pp > 1 else None)
    assert_matches_reference(run, reference(overrides, STEPS))
    if pp > 1:  # the last stage's copy of the tied embedding stayed bit-identical to the first stage's
        copies = [e["copy"] for e in run.extras.values() if e and "copy" in e]
        assert len(copies) == dp * tp
        for copy in copies:
            np.testing.assert_array_equal(copy, run.params["tok_embeddings.weight"])


@pytest.mark.timeout(300)
def test_llama_random_init_at_2x2x2_matches_one_process(hf_dir) -> None:
    """Shape from config.json, weights drawn shard by shard (init_slice): still the one-process weights."""
    overrides = (f"model.from_hf={hf_dir}", *HF_BATCH)
    run = run_mesh(2, 2, 2, overrides, STEPS)
    assert_matches_reference(run, reference(overrides, STEPS))
