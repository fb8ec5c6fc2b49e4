"""What the model-family mesh tests and the stress script share: the example user family's overrides,
the Hugging Face llama batch, the hook that reads a pipeline's own copy of a tied embedding, and the
hook that checkpoints a mesh run after a given step (``SaveAfter``) with ``commit_run`` committing it.

Used by tests/distributed/test_model_families.py, tests/distributed/test_hf_export.py and
testbed/stress_meshes.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

BATCH = ("train.global_batch_size=8", "train.micro_batch_size=1")
# examples/posnorm_family.py: LayerNorm and learned positions, a family from outside the package.
POSNORM = ('model.family="examples.posnorm_family:PosNormFamily"', "model.d_model=32", "model.n_heads=4",
           "model.seq_len=32", "model.n_layers=4", *BATCH)
# 6 sequences per step so that dp=3 works (uneven FSDP shards: 256 vocab rows over 3 ranks are 86/85/85).
HF_BATCH = ("train.global_batch_size=6", "train.micro_batch_size=1", "model.seq_len=32")


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


class SaveAfter:
    """An ``instrument``: after train step ``step``, save a checkpoint of it under ``root`` (all ranks)."""

    def __init__(self, root: str, step: int) -> None:
        self.root, self.step = root, step

    def __call__(self, runtime):
        from checkpoints.layout import step_dir_name

        real, acks = runtime.train_step, []

        def train_step(step, actions):
            result = real(step, actions)
            if step == self.step:
                runtime.save_checkpoint(os.path.join(self.root, step_dir_name(step)), step)
                acks.append(runtime.wait_checkpoint())
            return result

        runtime.train_step = train_step
        return lambda: acks


def commit_run(root: str, run: Any, overrides: Sequence[str], step: int) -> str:
    """Commit the checkpoint a ``SaveAfter(root, step)`` run saved (the driver's part); its directory."""
    from checkpoints.catalog import commit
    from checkpoints.manifest import CheckpointManifest
    from meshspeak.sections import config_to_dict
    from testbed.world import mesh_config

    cfg = mesh_config(run.shape.dp, run.shape.pp, run.shape.tp, overrides)
    files: dict[str, int] = {}
    for acks in run.extras.values():
        files.update(acks[0].files)
    batch = cfg.train.global_batch_size
    return commit(root, CheckpointManifest(
        step=step, generation=1, mesh=run.shape.as_dict(), model_fingerprint="test", data_cursor=step * batch,
        global_batch_size=batch, world_size=run.shape.world, ranks_acked=list(range(run.shape.world)),
        model_config=config_to_dict(cfg)["model"], files=files))
