"""A step's tensors from sample ids, with the loss normalisation every mesh shares, and held-out eval.

``step_data`` turns one replica's microbatch ids into a ``StepData``: windows read from the source,
targets after an EOS masked (``data.mask_document_boundaries``, meshdata/masks.py), and the
scales that make the summed loss the *global* mean over counted targets — ``grad_scale = dp /
count`` (FSDP averages gradients over dp) and ``report_scale = 1 / count``. Without masking the count
is ``G * seq_len``; with it, one scalar all-reduce over dp adds up every replica's count (tp and pp
peers of a replica read the same windows, so they agree).

``eval_forward`` runs the held-out batch ``b`` (samples ``[b*G, (b+1)*G)`` of the eval source, in
order: a fixed set of windows) forward only through the same pipeline actions, without the backward
ones. Dropping actions cannot deadlock a schedule that was deadlock-free with them: a forward
receive's matching send is still preceded only by forward work on its sender.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import meshdata as data_lib
from meshdata.masks import counted, mask_targets
from meshspeak.schedule import Action, Op
from workers.pipeline import StepData

FORWARD_OPS = (Op.RECV_F, Op.FORWARD, Op.SEND_F)


def step_data(runtime, source, microbatch_ids: list[np.ndarray], eos: int | None) -> tuple[StepData, int]:
    """(StepData, global count of counted targets) for this replica's microbatches."""
    groups, seq_len = runtime.groups, runtime.spec.model.seq_len
    dp = groups.shape.dp
    inputs, targets = [], []
    local = 0
    for ids in microbatch_ids:
        x, y = data_lib.microbatch_tokens(source, ids, seq_len)
        y = mask_targets(x, y, eos)
        local += counted(y)
        inputs.append(torch.from_numpy(x).to(groups.device))
        targets.append(torch.from_numpy(y).to(groups.device))
    total = local * dp  # unmasked: every replica holds the same number of targets
    if eos is not None and dp > 1:
        count = torch.tensor([local], dtype=torch.float64, device=groups.device)
        dist.all_reduce(count, group=groups.dp_group)
        total = int(count.item())
    total = max(1, total)
    return StepData(inputs=inputs, targets=targets, grad_scale=dp / total, report_scale=1.0 / total), total


def eval_forward(runtime, path: str, batch: int, actions: list[Action], eos: int | None) -> dict:
    """Held-out batch ``batch``: {"loss": this replica's share of the batch mean (last stage, tp 0;
    else None), "count": the batch's global count of counted targets}."""
    train, groups = runtime.spec.train, runtime.groups
    source = data_lib.open_source(path)
    g, dp, mbs = train.global_batch_size, groups.shape.dp, train.micro_batch_size
    per = g // dp
    ids = np.arange(batch * g, (batch + 1) * g)[groups.coords.dp * per : (groups.coords.dp + 1) * per]
    data, total = step_data(runtime, source, [ids[i : i + mbs] for i in range(0, per, mbs)], eos)
    forward = [a for a in actions if a.op in FORWARD_OPS]
    with torch.no_grad():
        loss, _, _ = runtime.executor.run(forward, data)
    reports = runtime.num_stages - 1 in runtime.stages and groups.coords.tp == 0
    return {"loss": loss if reports else None, "count": total}
