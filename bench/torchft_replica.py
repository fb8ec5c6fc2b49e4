"""One torchft replica group (one process, group world size 1) for bench/torchft_compare.py.

    python bench/torchft_replica.py --group G --groups 4 --lighthouse HOST:PORT --steps N --logdir DIR
        [--attempt A] [--set SECTION.KEY=VALUE ...]

torchft 0.2.0's FT-DDP as its ``train_ddp.py`` example sets it up on CPU: ``ProcessGroupGloo``, a
``PGTransport`` for healing, a ``Manager`` (``min_replica_size=1``) whose ManagerServer joins the
Lighthouse, ``torchft.DistributedDataParallel`` (gradients all-reduced through the Manager, averaged over
the step's participants) and ``use_async_quorum=True`` (the quorum overlaps the forward). The model,
samples and update are elastimesh's, as in ``bench/ddp_loop.py``: ``build_stage`` over all layers (same
seed), group G's contiguous part of the global batch (``replica_microbatches`` with G of ``--groups``),
one all-reduce per step on the last microbatch, global-norm clipping, AdamW with the ``lr_at`` schedule.

Three departures from the example, none a speed-up:

* the gradients are all-reduced by ``Manager.allreduce`` on one flat buffer after the backward (one
  bucket, as DDP with a large bucket), not by ``torchft.DistributedDataParallel``'s comm hook: in
  torchft 0.2.0 that hook (``torchft/ddp.py``, ``assert fut._fut`` after ``work.wait()``) raises
  AssertionError when the all-reduce fails because a peer died, so every survivor crashed at the first
  SIGKILL (measured here). ``Manager.allreduce`` is what the hook calls; its error path (the step is not
  committed, the next quorum re-forms) is torchft's own.
* the model is built before the Manager (a restarted group heartbeats only once it can join at once, so
  the others do not wait on its model build);
* the step calls ``Manager.should_commit`` itself and sets the learning rate after it (a healing
  group's optimizer state arrives inside ``should_commit``, and with it the peer's last learning rate:
  setting it before, as ``torchft.Optimizer`` would have us, gives the healed group a different update
  from its peers on its first step).

A restarted group (``--attempt`` > 1) heals from a live peer (torchft's live recovery); a group
stops at step N or once the bench has written ``DIR/done`` (the run reached step N: a group
restarted too late must not train on alone from its own step 0). Every
committed or dropped step appends one JSON line to ``DIR/ft_g{G}.jsonl``: the step the Manager
counted, committed or not, the participants, this group's share of the global-mean loss, the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class Replica:
    """The model, optimizer and samples of one group (``bench/ddp_loop.py``'s, without the DDP wrap)."""

    def __init__(self, overrides: list[str], group: int, groups: int) -> None:
        import torch

        import meshdata as data_lib
        from meshmodels.gpt_model import build_stage
        from orchestrator.config.load import load_config
        from workers.optim import build_optimizer

        torch.set_num_threads(1)
        cfg = load_config(None, overrides)
        self.train, self.model_cfg = cfg.train, cfg.model
        self.group, self.groups = group, groups
        self.module = build_stage(self.model_cfg, range(self.model_cfg.n_layers), self.train.seed)
        self.optimizer = build_optimizer(self.module, self.train)
        self.params = list(self.module.parameters())
        self.source = data_lib.open_source("builtin")
        self.num_samples = self.source.num_samples(self.model_cfg.seq_len)

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def forward_backward(self, step: int) -> float:
        """Group's microbatches of ``step`` (local gradients); returns its share of the global-mean loss."""
        import torch

        import meshdata as data_lib
        from meshmodels.gpt_model import lm_loss_sum

        train, seq_len = self.train, self.model_cfg.seq_len
        mbs = data_lib.replica_microbatches(step, train.global_batch_size, train.micro_batch_size,
                                            self.group, self.groups, train.seed, self.num_samples)
        global_tokens = train.global_batch_size * seq_len
        total = 0.0
        for ids in mbs:
            x, y = data_lib.microbatch_tokens(self.source, ids, seq_len)
            loss = lm_loss_sum(self.module(torch.from_numpy(x)), torch.from_numpy(y)) / global_tokens
            # torchft averages over the participants; x groups makes it the sum over replicas.
            (loss * self.groups).backward()
            total += float(loss.detach())
        return total

    def allreduce_grads(self, manager) -> None:
        """One fault-tolerant all-reduce of every gradient (a failure is reported to the Manager, which
        then does not commit the step)."""
        import torch

        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def make_manager(replica: Replica, group: int, lighthouse: str):
    """The group's Manager, as torchft's train_ddp.py makes it on CPU (its own TCPStore: world 1)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    import torch

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=replica.load_state_dict,
                      state_dict=replica.state_dict, replica_id=f"bench_ft_{group}",
                      timeout=timedelta(seconds=30), checkpoint_transport=transport, rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                      hostname="127.0.0.1", use_async_quorum=True)
    return manager, store


def wait_for_peers(logdir: Path, group: int, groups: int) -> None:
    """First start only: every group's Manager is up before any quorum, so all start at world 4."""
    (logdir / f"ready_g{group}").touch()
    while sum((logdir / f"ready_g{g}").exists() for g in range(groups)) < groups:
        time.sleep(0.05)


def run(args: argparse.Namespace) -> None:
    import torch

    from workers.optim import lr_at, set_lr

    logdir = Path(args.logdir)
    replica = Replica(args.set, args.group, args.groups)
    manager, _store = make_manager(replica, args.group, args.lighthouse)
    if args.attempt == 1:
        wait_for_peers(logdir, args.group, args.groups)
    log = open(logdir / f"ft_g{args.group}.jsonl", "a", buffering=1)
    log.write(json.dumps({"event": "start", "attempt": args.attempt, "pid": os.getpid(), "time": time.time()}) + "\n")
    while manager.current_step() < args.steps and not (logdir / "done").exists():
        step = manager.current_step() + 1  # a healing group contributes zeros this step: its data does not matter
        manager.start_quorum()
        replica.optimizer.zero_grad(set_to_none=True)
        loss_share = replica.forward_backward(step)
        replica.allreduce_grads(manager)
        if replica.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(replica.params, replica.train.grad_clip, foreach=True)
        committed = manager.should_commit()
        if committed:  # the learning rate after any heal (see the module docstring)
            set_lr([replica.optimizer], lr_at(manager.current_step(), replica.train))
            replica.optimizer.step()
        log.write(json.dumps({"step": manager.current_step() if committed else step, "committed": committed,
                              "participants": manager.num_participants(), "participating":
                              manager.is_participating(), "loss_share": loss_share, "attempt": args.attempt,
                              "time": time.time()}) + "\n")
    log.close()
    manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--attempt", type=int, default=1)
    ap.add_argument("--set", action="append", default=[])
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
