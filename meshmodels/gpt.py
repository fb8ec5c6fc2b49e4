"""The built-in GPT as a family (its modules live in ``meshmodels/gpt_model.py``): shape from ``[model]``.

It is the default family. Parameter names, initialisation and the TP plan are the ones the built-in
model always had, so its checkpoints and the mesh-equivalence tests are unchanged. It rotates RoPE
by (even, odd) pairs, so it has no Hugging Face name map (the ``llama`` family does).
"""

from __future__ import annotations

import math
from typing import Any

from meshmodels.family import FamilyBase
from meshspeak.schema import ConfigError


def _next_multiple(value: int, divisor: int) -> int:
    return max(divisor, -(-value // divisor) * divisor)


class GPTFamily(FamilyBase):
    name = "gpt"

    def shape(self, model_cfg: Any) -> Any:
        return model_cfg  # the [model] section (meshspeak.sections.ModelConfig) is the shape

    def check_mesh(self, shape: Any, tp: int) -> None:
        # TP splits the heads, the vocabulary (embedding / head) and the FFN hidden dimension.
        for key, size in (("model.n_heads", shape.n_heads), ("model.vocab_size", shape.vocab_size)):
            name = key.split(".")[1]
            if size % tp:
                raise ConfigError(key, f"{key}={size} is not divisible by mesh.tp={tp}: choose {name} as a "
                                       f"multiple of tp (e.g. {_next_multiple(size, tp)}) or a tp that divides {size}")
        if shape.ffn_hidden and shape.ffn_hidden % tp:
            raise ConfigError("model.ffn_hidden", f"model.ffn_hidden={shape.ffn_hidden} is not divisible by "
                                                  f"mesh.tp={tp}: choose a multiple of tp (e.g. "
                                                  f"{_next_multiple(shape.ffn_hidden, tp)}) or 0 for 4*d_model")

    def param_counts(self, shape: Any) -> dict[str, int]:
        d, f, v = shape.d_model, shape.ffn_dim, shape.vocab_size
        layer = 4 * d * d + 3 * d * f + 2 * d
        return {"embed": v * d, "layer": layer, "head": v * d + d, "total": 2 * v * d + d + shape.n_layers * layer}

    def build_stage(self, shape: Any, layers: range, *, activation_checkpointing: bool = False) -> Any:
        from meshmodels.gpt_model import GPT

        return GPT(shape, layers, activation_checkpointing=activation_checkpointing)

    def init_tensor(self, shape: Any, name: str, size: tuple[int, ...], seed: int) -> Any:
        import torch

        from meshmodels.gpt_model import param_seed

        if name.endswith("norm.weight"):
            return torch.ones(size)
        # GPT-2's scaled init for the projections that write into the residual stream.
        resid = name.endswith(("wo.weight", "w2.weight"))
        std = shape.init_std / math.sqrt(2 * shape.n_layers) if resid else shape.init_std
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        return torch.randn(size, generator=gen) * std

    def tp_plan(self, stage: Any) -> dict[str, Any]:
        return megatron_plan(stage)


def megatron_plan(stage: Any) -> dict[str, Any]:
    """Megatron-style TP with sequence parallelism on the norms, for stages named like ``meshmodels.gpt_model.GPT``.

    Vocab-sharded embedding whose partial sums are reduce-scattered straight into sequence shards; q/k/v
    and w1/w3 column-sharded, wo/w2 row-sharded into sequence shards; full logits on every tp rank, so
    the loss is the plain single-process loss.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    if getattr(stage, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(stage, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(stage, "output", None) is not None:
        # Logits stay sharded over the vocabulary (a DTensor): the loss runs under loss_parallel
        # (workers.parallelize.loss_context), so no rank holds full-vocabulary fp32 logits.
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    for index in stage.layers:
        p = f"layers.{index}."
        plan.update({
            p + "attention_norm": SequenceParallel(),
            p + "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            p + "ffn_norm": SequenceParallel(),
            p + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })  # fmt: skip
    return plan
