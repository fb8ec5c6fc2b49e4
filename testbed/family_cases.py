"""What the model-family mesh tests and the stress script share: the example user family's overrides,
the Hugging Face llama batch, and the hook that reads a pipeline's own copy of a tied embedding.

Used by tests/distributed/test_model_families.py and testbed/stress_meshes.py.
"""

from __future__ import annotations

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
