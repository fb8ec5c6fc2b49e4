"""The Ray Train side of the bench comparisons: the same model, samples and update as elastimesh, under DDP.

Used inside ``TorchTrainer`` workers by bench/ray_train_compare.py and bench/recovery.py (after they put
the repository root on ``sys.path``), and without Ray by bench/powersgd_ddp_oracle.py. The model is
``meshmodels.gpt_model.build_stage`` over all layers (same seed, so the same initial weights as every
elastimesh mesh), wrapped by ``ray.train.torch.prepare_model`` (DDP, gloo on CPU) or the caller's
``wrap``; each replica takes its contiguous part of the same global batch
(``meshdata.order.replica_microbatches``); AdamW from ``workers.optim.build_optimizer``, global-norm
clipping and the ``lr_at`` warm-up + cosine, exactly as ``workers.runtime.RankRuntime`` does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable


class DDPLoop:
    def __init__(self, overrides: list[str], wrap: Callable | None = None, rank: int = 0, world: int = 1) -> None:
        """In a Ray Train worker (``wrap`` None): DDP by ``prepare_model``, rank and world from Ray's
        context. Else the caller has formed the default process group: ``wrap(model)`` makes the DDP
        module, ``rank``/``world`` as given (bench/powersgd_ddp_oracle.py's spawned gloo ranks)."""
        import torch

        import meshdata as data_lib
        from meshmodels.gpt_model import build_stage
        from orchestrator.config.load import load_config
        from workers.optim import build_optimizer

        torch.set_num_threads(1)
        cfg = load_config(None, overrides)
        self.train, self.model_cfg = cfg.train, cfg.model
        model = build_stage(self.model_cfg, range(self.model_cfg.n_layers), self.train.seed)
        if wrap is None:
            import ray.train
            import ray.train.torch

            ctx = ray.train.get_context()
            self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
            self.model = ray.train.torch.prepare_model(model)  # DDP (gloo on CPU)
        else:
            self.rank, self.world = rank, world
            self.model = wrap(model)
        self.optimizer = build_optimizer(self.model, self.train)
        self.params = list(self.model.parameters())
        self.source = data_lib.open_source("builtin")
        self.num_samples = self.source.num_samples(self.model_cfg.seq_len)

    @property
    def inner(self):
        """The unwrapped module (for state dicts)."""
        return getattr(self.model, "module", self.model)

    def report_checkpoint(self, step: int) -> None:
        """``ray.train.report`` the step, rank 0 with a checkpoint of model + optimizer + step (what the
        Ray Train loops of bench/recovery.py and bench/preemption.py resume from)."""
        import shutil
        import tempfile

        import ray.train
        import torch
        from ray.train import Checkpoint

        if self.rank != 0:
            ray.train.report({"step": step})
            return
        d = tempfile.mkdtemp()
        torch.save({"model": self.inner.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step},
                   os.path.join(d, "state.pt"))
        ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
        shutil.rmtree(d, ignore_errors=True)

    def step(self, step: int, before_microbatch: Callable[[int], None] | None = None) -> float:
        """One optimizer step; returns this replica's share of the global-mean loss."""
        import torch

        import meshdata as data_lib
        from meshmodels.gpt_model import lm_loss_sum
        from workers.optim import lr_at, set_lr

        train, seq_len = self.train, self.model_cfg.seq_len
        mbs = data_lib.replica_microbatches(step, train.global_batch_size, train.micro_batch_size,
                                            self.rank, self.world, train.seed, self.num_samples)
        global_tokens = train.global_batch_size * seq_len
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, ids in enumerate(mbs):
            if before_microbatch is not None:
                before_microbatch(i)
            x, y = data_lib.microbatch_tokens(self.source, ids, seq_len)
            # All-reduce once per step, on the last microbatch (as elastimesh reduce-scatters once).
            sync = i == len(mbs) - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = lm_loss_sum(self.model(torch.from_numpy(x)), torch.from_numpy(y)) / global_tokens
                # DDP averages gradients over the world; the reference sums over replicas.
                (loss * self.world).backward()
            total += float(loss.detach())
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, train.grad_clip, foreach=True)
        set_lr([self.optimizer], lr_at(step, train))
        self.optimizer.step()
        return total
