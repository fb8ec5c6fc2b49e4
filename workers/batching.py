"""A step's tensors from sample ids, with the loss normalisation every mesh shares, and held-out eval.

``step_data`` turns one replica's microbatch ids into a ``StepData``: windows read from the source,
targets after an EOS masked (``data.mask_document_boundaries``, meshdata/masks.py) or, on chat
shards, every target outside the assistant's tokens (meshdata/chat_source.py), and the
scales that make the summed loss the *global* mean over counted targets — ``grad_scale = dp /
count`` (FSDP averages gradients over dp) and ``report_scale = 1 / count``. Without masking the count
is ``G * seq_len``, whatever each replica's share (``elastic.rebalance``); with a mask, one scalar
all-reduce over dp adds up every replica's count (tp and pp peers of a replica read the same
windows, so they agree).

``eval_forward`` runs the held-out batch ``b`` (samples ``[b*G, (b+1)*G)`` of the eval source, in
order, or an ``eval.mix``'s batch ``b``: a fixed set of windows) forward only through the same pipeline actions, without the backward
ones (``meshspeak.schedule.forward_only``; on NCCL the executor's lockstep batches are planned
from every rank's forward-only list: ``meshspeak.p2p_rounds.rank_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import meshdata as data_lib
from meshdata.masks import counted, counts_every_target, mask_targets
from meshspeak.schedule import Action, forward_only
from workers.optim import checked_all_reduce
from workers.pipeline import StepData


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A microbatch's tokens on ``device``. On CUDA through pinned memory, copied asynchronously: a
    pageable source makes the copy synchronous (the driver stages it through its own pinned buffer),
    so every microbatch would stall the host until the GPU caught up. The pinned block is not reused
    before the copy ends (torch's caching host allocator records the copy's stream). On the CPU the
    array's memory is used as it is (no copy)."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


@dataclass(frozen=True)
class ReplicaBatching:
    """What ``step_data`` needs of the generation: the window length, the global batch, where the
    tensors go, and the dp replicas whose counts one normalisation adds up."""

    seq_len: int
    global_batch_size: int
    device: torch.device
    dp: int
    dp_group: object  # torch.distributed.ProcessGroup of this rank's dp replicas (None: dp = 1)
    timeout_s: float  # elastic.collective_timeout_s: the count's all-reduce is checked

    @classmethod
    def of(cls, spec, groups) -> ReplicaBatching:
        """For one rank of a generation (``RuntimeSpec``, ``RankGroups``)."""
        return cls(seq_len=spec.model.seq_len, global_batch_size=spec.train.global_batch_size,
                   device=groups.device, dp=groups.shape.dp,
                   dp_group=groups.dp_group if groups.shape.dp > 1 else None,
                   timeout_s=spec.collective_timeout_s)


def step_data(batching: ReplicaBatching, source, microbatch_ids: list[np.ndarray],
              eos: int | None) -> tuple[StepData, int]:
    """(StepData, global count of counted targets) for this replica's microbatches."""
    dp, device = batching.dp, batching.device
    inputs, targets = [], []
    local = 0
    for ids in microbatch_ids:
        x, y = data_lib.microbatch_tokens(source, ids, batching.seq_len)
        y = mask_targets(x, y, eos)
        local += counted(y)
        inputs.append(to_device(x, device))
        targets.append(to_device(y, device))
    # Unmasked, every target counts: the global batch's G * seq_len, however the replicas split it
    # (elastic.rebalance gives them different numbers of microbatches: meshspeak/rebalance.py).
    # Masked (document boundaries, or chat shards' loss mask), one all-reduce adds the replicas' counts.
    every = counts_every_target(source, eos)
    total = batching.global_batch_size * batching.seq_len if every else local
    if not every and dp > 1:
        count = torch.tensor([local], dtype=torch.float64, device=device)
        # Checked: the count scales every gradient (workers.optim.checked_all_reduce).
        checked_all_reduce(count, batching.dp_group, batching.timeout_s)
        total = int(count.item())
    total = max(1, total)
    return StepData(inputs=inputs, targets=targets, grad_scale=dp / total, report_scale=1.0 / total), total


def eval_forward(runtime, path, batch: int, actions: list[Action], eos: int | None) -> dict:
    """Held-out batch ``batch``: {"loss": this replica's share of the batch mean (last stage, tp 0;
    else None), "count": the batch's global count of counted targets}. ``path``: eval.path, or
    eval.mix's ((path, weight), ...) (meshdata/mixture.py lays its batches out)."""
    train, groups = runtime.spec.train, runtime.groups
    held_out = data_lib.open_mixture(path, runtime.spec.model.seq_len)
    g, dp, mbs = train.global_batch_size, groups.shape.dp, train.micro_batch_size
    per = g // dp
    ids = held_out.eval_ids(batch, g)[groups.coords.dp * per : (groups.coords.dp + 1) * per]
    data, total = step_data(runtime.batching, held_out.reader, [ids[i : i + mbs] for i in range(0, per, mbs)], eos)
    forward = forward_only(actions)
    with torch.no_grad():
        loss, _, _ = runtime.executor.run(forward, data)
    reports = runtime.holds_last_stage and groups.coords.tp == 0
    return {"loss": loss if reports else None, "count": total}
