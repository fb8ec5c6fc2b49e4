"""The single-process reference trainer: the math every mesh, resize and resume must reproduce.

One process, no process groups, the whole model, the whole global batch. Tests compare the mesh's
per-step losses and final parameters against this; the step-overhead benchmark times it as the
"plain PyTorch loop".
"""

from __future__ import annotations

import numpy as np
import torch

import meshdata as data_lib
from meshdata.masks import counted, mask_targets
from meshmodels.build import build_local_stage
from meshmodels.family import resolve_model
from workers.optim import build_optimizer, clip_grad_norm, lr_at, set_lr


class ReferenceTrainer:
    def __init__(self, model_cfg, train, data_path: str | tuple = data_lib.BUILTIN, init_from: str = "",
                 mask_eos_id: int | None = None) -> None:
        """``data_path``: data.path, or data.mix's ((path, weight), ...)."""
        self.model_cfg, self.train = model_cfg, train
        resolved = resolve_model(model_cfg)
        self.family, self.shape = resolved.family, resolved.shape
        # The same build as a rank's (meta device, then init from (seed, name)), without any sharding.
        self.model = build_local_stage(
            self.family, self.shape, range(self.shape.n_layers), device=torch.device("cpu"), seed=train.seed,
            activation_checkpointing=train.activation_checkpointing, init=not init_from,
            dtype=torch.float64 if train.dtype == "float64" else None,
        )
        if init_from:  # Hugging Face weights instead of the (seed, name) init
            from meshmodels.hf_io import load_hf

            load_hf([self.model], self.family, init_from)
        self.optimizer = build_optimizer(self.model, train)
        self.data = data_lib.open_mixture(data_path, model_cfg.seq_len)
        self.source = self.data.reader
        self.num_samples = self.data.num_samples()
        self.mask_eos_id = mask_eos_id  # data.mask_document_boundaries, resolved (meshdata.masks)

    def step(self, step: int) -> float:
        """Optimizer step ``step`` (1-based) on samples [(step-1)*G, step*G); returns the mean loss."""
        train, seq_len = self.train, self.model_cfg.seq_len
        ids = self.data.step_ids(step, train.global_batch_size, train.seed)
        # --- loss normalisation: sum over counted targets / their count over the whole batch ---
        batches = []
        for start in range(0, len(ids), train.micro_batch_size):
            x, y = data_lib.microbatch_tokens(self.source, ids[start : start + train.micro_batch_size], seq_len)
            batches.append((x, mask_targets(x, y, self.mask_eos_id)))
        global_tokens = max(1, sum(counted(y) for _, y in batches))
        # --- loss normalisation: end ---
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in batches:
            loss = self.family.loss_sum(self.model(torch.from_numpy(x)), torch.from_numpy(y)) / global_tokens
            loss.backward()
            total += float(loss.detach())
        params = list(self.model.parameters())
        if train.grad_clip > 0:
            clip_grad_norm(params, train.grad_clip, None)
        set_lr([self.optimizer], lr_at(step, train))
        self.optimizer.step()
        return total

    def eval_loss(self, path, batches: int, mask_eos_id: int | None = None) -> float:
        """Held-out loss over samples [0, batches * G) of ``path`` in order, or over an eval.mix's first
        ``batches`` batches (orchestrator/control/evaluation.py)."""
        held_out = data_lib.open_mixture(path, self.model_cfg.seq_len)
        g, mbs, seq_len = self.train.global_batch_size, self.train.micro_batch_size, self.model_cfg.seq_len
        ids = np.concatenate([held_out.eval_ids(b, g) for b in range(batches)])
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(ids), mbs):
                x, y = data_lib.microbatch_tokens(held_out.reader, ids[start : start + mbs], seq_len)
                y = mask_targets(x, y, mask_eos_id)
                total += float(self.family.loss_sum(self.model(torch.from_numpy(x)), torch.from_numpy(y)))
                count += counted(y)
        return total / max(1, count)

    def run(self, first_step: int, last_step: int, skip: set[int] = frozenset()) -> list[float | None]:
        """Steps ``first_step..last_step``; a step in ``skip`` (a bad step the mesh skipped) changes
        nothing and has no loss (None): its batch is passed over, the next step trains the next one."""
        return [None if s in skip else self.step(s) for s in range(first_step, last_step + 1)]

    def params(self) -> dict[str, np.ndarray]:
        return {n: (p.detach() if p.dtype == torch.float64 else p.detach().float()).numpy().copy()
                for n, p in self.model.named_parameters()}
