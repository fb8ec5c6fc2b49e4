"""Load Hugging Face safetensors straight into a rank's sharded stages (``checkpoint.init_from``).

Every rank calls ``load_hf`` collectively once its stages are built (on the meta device, parallelised,
then ``to_empty``: see ``build.py``). The template maps each local parameter's Hugging Face name to
the parameter itself — a DTensor shard under TP/FSDP2 — and
``torch.distributed.checkpoint.HuggingFaceStorageReader`` reads from the files only the slices each
rank holds, converting dtype on the copy: no rank ever holds the whole model, and uneven shards (DP
of 3) load as any other. Tied copies on two stages both load the one HF tensor.

The reader loads every ``*.safetensors`` in the directory: the directory must have been validated
first (``hf.check_weights``, run by the driver before any actor starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoints.state import _clean_fqn


def hf_template(parts: Sequence[nn.Module], family: Any) -> dict[str, torch.Tensor]:
    """HF name -> this rank's parameter (detached, same storage) for every parameter of ``parts``."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, param in part.named_parameters():
            out[family.to_hf(_clean_fqn(name))] = param.detach()
    return out


@torch.no_grad()
def load_hf(parts: Sequence[nn.Module], family: Any, directory: str,
            process_group: dist.ProcessGroup | None = None) -> int:
    """Load ``directory``'s safetensors into ``parts`` in place; returns the tensors this rank read.

    Collective over ``process_group`` when torch.distributed is initialised; one process otherwise.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    template = hf_template(parts, family)
    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(template, storage_reader=HuggingFaceStorageReader(directory),
             process_group=process_group if distributed else None, no_dist=not distributed)
    return len(template)
