"""RankRuntime: everything one rank trains with during one generation.

It owns the generation's ``RankGroups``, this rank's pipeline stages (built, TP'd and FSDP'd),
their optimizers and the data source, built in order by the steps of workers/runtime_build.py. A
rebuild throws the whole object away and makes a new one from the next generation's groups; state
crosses generations only through a checkpoint or an in-memory snapshot (taken every
``elastic.snapshot_every`` steps by default, pushed to another rank: docs/design.md, In-memory
snapshots), never through cached groups or meshes.

A training step reads as TorchTitan's ``train_step``: zero the gradients, run the microbatches
(the driver's pipeline actions: forward and backward), decide the update (clip, the finite check,
float16's loss scale: workers/update_check.py), step the optimizers. Something outside may act at
the step's hook points (``StepHooks``: fault injection on purpose), which the runtime never names.

Usable without Ray (the single-rank benchmark and the spawned-process tests build it directly).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import meshdata as data_lib
from meshdata.prefetch import ReadAhead
from meshmodels.family import runtime_family
from meshspeak.messages import RuntimeSpec, StepResult, WriteAck
from meshspeak.schedule import Action
from workers import compile_stats
from workers.batching import ReplicaBatching, eval_forward, step_data
from workers.groups import RankGroups
from workers.optim import lr_at, set_lr
from workers.pipeline import StepData
from workers.runtime_build import (
    apply_checkpoint_group_bound,
    apply_dp_reduction,
    apply_initial_weights,
    apply_tied_parameters,
    build_compute_clock,
    build_executor,
    build_loss_scale,
    build_stages,
)
from workers.step_hooks import StepHooks
from workers.update_check import UpdateCheck, bad_reason

logger = logging.getLogger(__name__)


class RankRuntime:
    def __init__(self, spec: RuntimeSpec, groups: RankGroups, *, hooks: StepHooks | None = None,
                 before_update: Callable[[], None] | None = None) -> None:
        """Build this rank's share of the generation, step by step (workers/runtime_build.py).

        ``hooks``: the step's hook points (none by default). ``before_update``: called before the
        optimizers write the state (the actor's snapshot worker waits there for a copy still reading it:
        workers/snapshot_push.py)."""
        self.spec, self.groups = spec, groups
        self.family, self.shape = runtime_family(spec)
        self.stages, self.optimizers = build_stages(spec, groups, self.family, self.shape)
        self.params: list[nn.Parameter] = [p for st in self.stages.values() for p in st.module.parameters()]
        self.dp_bytes = apply_dp_reduction(self.stages, self.optimizers, spec, groups)
        self.compute_clock = build_compute_clock(self.stages, self.family, groups.device)
        apply_checkpoint_group_bound(self.params, groups, spec.collective_timeout_s)
        self.tied = apply_tied_parameters(self.stages, self.family, self.shape, spec, groups)
        apply_initial_weights(self.stages, self.family, spec, groups)
        self.executor = build_executor(self.stages, self.family, self.shape, spec, groups)
        self.loss_scale = build_loss_scale(spec.train)
        self.update_check = UpdateCheck(self.params, self.tied.not_in_norm, groups, spec.train.grad_clip,
                                        spec.collective_timeout_s, self.loss_scale)
        self.data = data_lib.open_mixture(spec.data_mix or spec.data_path, spec.model.seq_len)
        self.read_ahead = ReadAhead(self.data.reader)  # the next step's windows, read on a thread of its own
        self.batching = ReplicaBatching.of(spec, groups)
        self.hooks = hooks or StepHooks()
        self.before_update = before_update or (lambda: None)
        # Built uninitialised because the driver announced a load (RuntimeSpec.load_follows): nothing
        # may train, evaluate or save before it came (e.g. the snapshot's holder died in between).
        self._awaiting_load = spec.load_follows
        self._ckpt_state = None  # checkpoints.state.TrainingState, made at the first save or snapshot
        self._writer = None  # checkpoints.writer.AsyncCheckpointWriter, made at the first save
        self._save_future = None
        self._save_call_s = 0.0
        self._snapshots = None  # checkpoints.snapshot_taker.SnapshotTaker, made at the first snapshot
        self._warmed_up = False  # train.compile: the generation's first step ran (its compiles done)

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the one that computes the loss)."""
        return self.executor.num_stages - 1 in self.stages

    def model_parts(self) -> list[nn.Module]:
        return [stage.module for stage in self.stages.values()]

    # -- training ---------------------------------------------------------------------------------
    def train_step(self, step: int, actions: list[Action], split: tuple[int, ...] | None = None) -> StepResult:
        """One training step (``_train_step``). The generation's first one under ``train.compile`` runs
        with the training groups' timeout raised (``compile_stats.warm_up_timeout_s``): a peer compiling
        its blocks for minutes keeps the others waiting in their first collective, and that is work."""
        if not self.spec.train.compile or self._warmed_up:
            return self._train_step(step, actions, split)
        with self.groups.collective_timeout(compile_stats.warm_up_timeout_s(self.spec.collective_timeout_s)):
            result = self._train_step(step, actions, split)
        self._warmed_up = True
        return result

    def _train_step(self, step: int, actions: list[Action], split: tuple[int, ...] | None = None) -> StepResult:
        """Zero the gradients, run the microbatches (forward/backward over the schedule), decide the
        update (clip, the finite check) and step. Collective errors propagate.

        ``split``: the step's microbatches per dp replica as the driver decided them
        (``elastic.rebalance``: meshspeak/rebalance.py); ``actions`` is then the schedule for this
        replica's count. None: the even split.

        A step whose loss or global grad norm is not finite is skipped on every rank: parameters and
        optimizer state untouched, reported as ``StepResult.bad`` (docs/design.md, Bad steps).
        """
        self._check_loaded()
        t0, own0 = time.perf_counter(), time.thread_time()
        compiled = self.spec.train.compile
        if compiled:
            compile_stats.PROCESS.start()
        self.compute_clock.take()  # drop what an eval forward counted since the last step
        self.executor.mark_progress()
        self.hooks.step_begins(self, step)
        data = self._step_data(step, split)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        scale_used = self.loss_scale.scale if self.loss_scale is not None else None
        if scale_used is not None:  # float16: the last stage's loss is multiplied by it before backward
            self.executor.loss_scale = scale_used
        loss, timings, compute = self.executor.run(actions, data)
        self.hooks.backward_done(self, step)
        self.tied.sync()
        self.executor.mark_progress()
        self.hooks.gradients_ready(self, step)
        verdict = self.update_check.verdict(step, loss if self.holds_last_stage else None)
        self.executor.mark_progress()
        if not verdict:
            self._optimizer_step(step)
        return StepResult(
            step=step,
            world_rank=self.groups.world_rank,
            ok=True,
            loss=loss if self.holds_last_stage and self.groups.coords.tp == 0 else None,
            step_time_s=time.perf_counter() - t0,
            compute_s=compute,
            timings=tuple(timings),
            loss_scale=scale_used,
            skipped=bool(verdict),
            bad=bad_reason(verdict),
            own_s=time.thread_time() - own0,
            forward_s=self.compute_clock.take(),
            dp_bytes=self.dp_bytes.take() if self.dp_bytes is not None else None,
            recompiles=compile_stats.PROCESS.stop() if compiled else None,
        )

    def stalled_s(self) -> float:
        """Seconds since this rank last made progress in the step it runs: an action of the schedule
        done (the executor), the tied gradients synced, the update decided, the step begun. What the
        driver reads (``WorkerStatus.stalled_s``) before it counts a step slower than
        ``elastic.step_timeout_s`` as a hang: a live rank still progressing is waited for."""
        return time.monotonic() - self.executor.progressed_at

    def _optimizer_step(self, step: int) -> None:
        """The update: the learning rate of ``step`` (a pure function of it: meshspeak/lr_schedule.py),
        then every optimizer's step, once nothing still copies the state they write."""
        self.before_update()  # a snapshot may still be copying the state set_lr and opt.step() update
        self.executor.mark_progress()
        set_lr(self.optimizers, lr_at(step, self.spec.train))
        self._wait_checkpoint_staging()  # a save may still be copying the state opt.step() updates
        self.executor.mark_progress()
        for opt in self.optimizers:
            opt.step()

    def _step_data(self, step: int, split: tuple[int, ...] | None) -> StepData:
        train, shape = self.spec.train, self.groups.shape

        def replica_ids(at: int) -> list[np.ndarray]:  # this replica's microbatches of step ``at``
            return data_lib.replica_slice(self.data.step_ids(at, train.global_batch_size, train.seed),
                                          train.micro_batch_size, self.groups.coords.dp, shape.dp, counts=split)

        # Loss normalisation (global count of counted targets, document masks): workers/batching.py.
        data = step_data(self.batching, self.read_ahead, replica_ids(step), self.spec.mask_eos_id)[0]
        # Step + 1's windows are read while this step trains, and served only if asked for exactly
        # (a rollback, a re-plan or another split reads anew: meshdata/prefetch.py).
        self.read_ahead.prefetch(replica_ids(step + 1), self.spec.model.seq_len)
        return data

    def eval_step(self, path: str, batch: int, actions: list[Action], mask_eos_id: int | None) -> dict:
        """Held-out loss of eval batch ``batch`` (forward only; see workers/batching.py)."""
        self._check_loaded()
        return eval_forward(self, path, batch, actions, mask_eos_id)

    def _check_loaded(self) -> None:
        if self._awaiting_load:
            raise RuntimeError("the parameters were left uninitialised for a checkpoint or snapshot load "
                               "that never came: this generation cannot train")

    # -- inspection -------------------------------------------------------------------------------
    def full_state(self) -> dict[str, np.ndarray]:
        """Unsharded parameters of this rank's stages (a collective over dp/tp: all ranks must call).

        Returned on (dp=0, tp=0) ranks only, so the driver gets each stage's parameters exactly once.
        """
        from torch.distributed.tensor import DTensor

        out: dict[str, np.ndarray] = {}
        keep = self.groups.coords.dp == 0 and self.groups.coords.tp == 0
        for stage in self.stages.values():
            for name, param in stage.module.named_parameters():
                # Offloaded shards live on the host: gather them on the mesh's device (NCCL).
                full = (param.to(param.device_mesh.device_type).full_tensor() if isinstance(param, DTensor)
                        else param).detach()
                if keep and not self.tied.is_copy(param):  # a tied copy is reported by the first stage
                    out[name] = (full if full.dtype == torch.float64 else full.float()).cpu().numpy().copy()
        return out

    def local_state_bytes(self) -> int:
        """This rank's own training state: its parameters' and optimizer states' local (shard) bytes."""
        from torch.distributed.tensor import DTensor

        def local(t) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        # Without grad, to_local is the local tensor itself; with it, an autograd function per tensor
        # (20 ms of a restore's 150 under cProfile, which sends this figure back in its ack).
        with torch.no_grad():
            total = sum(local(p) for p in self.params)
            for opt in self.optimizers:
                for state in opt.state.values():
                    total += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor))
        return total

    # -- checkpoints ------------------------------------------------------------------------------
    def _training_state(self, step: int) -> dict:
        """Step ``step``'s state as checkpoints and snapshots save it (``TrainingState.snapshot``): the
        model's and optimizers' state dicts, kept for the generation so that later saves take the
        verified fast path, and the extras (the data cursor, float16's loss scale; no RNG state)."""
        from checkpoints.state import TrainingState

        if self._ckpt_state is None:
            self._ckpt_state = TrainingState(self.model_parts(), self.optimizers)
        loss_scale = None if self.loss_scale is None else self.loss_scale.state_dict()
        cursor = step * self.spec.train.global_batch_size
        return self._ckpt_state.snapshot(step=step, data_cursor=cursor, rng=False, loss_scale=loss_scale)

    def save_checkpoint(self, path: str, step: int) -> float:
        """Stage this rank's shard of step ``step`` and start writing it; returns the stall seconds."""
        from checkpoints.writer import AsyncCheckpointWriter

        t0 = time.perf_counter()
        if self._writer is None:
            # Dedicated group: async DCP on a training group aborts gloo (docs/design.md, F9).
            # Staging in the background overlaps the copy with the next forward/backward, which only
            # read the parameters; train_step waits for it before the optimizer writes them.
            self._writer = AsyncCheckpointWriter(self.groups.ckpt_group, use_async=self.spec.async_checkpoint,
                                                 stage_in_background=True)
        state = self._training_state(step)
        state["extra"]["model"] = self._model_record()
        self._save_future = self._writer.save(state, path)
        self._save_call_s = time.perf_counter() - t0
        return self._save_call_s

    def _model_record(self) -> str:
        """What ``elastimesh export`` needs besides the tensors (JSON, the same on every rank): the
        family, for a family with a Hugging Face map the config.json of the trained shape, and where
        the data is (its tokenizer files are exported with the weights)."""
        record = {"family": self.spec.family or "gpt", "data_path": self.spec.data_path}
        try:
            record["hf_config"] = self.family.hf_config(self.shape)
        except NotImplementedError:
            pass
        return json.dumps(record, sort_keys=True)

    def wait_checkpoint(self) -> WriteAck:
        """Block until the shard is durable (called on a second actor thread); the ack.

        ``stall_s`` is what training paid: the save call plus any wait for staging before the next
        optimizer step. Staging ends before the write does, so that wait is final by now.
        """
        timing = self._save_future.result()
        stall = self._save_call_s + self._writer.fence_wait_s
        return WriteAck(write_s=timing.write_s, files=dict(timing.files), stall_s=stall,
                        staging_s=timing.staging_s)

    # -- what a benchmark of staging modes sets and reads (bench/checkpoint_stall.py) -----------------
    def use_checkpoint_writer(self, writer) -> None:
        """Save through ``writer`` from now on: a ``checkpoints.writer.AsyncCheckpointWriter`` on
        ``groups.ckpt_group`` (e.g. one that stages before ``save`` returns). The writer before it is
        closed first, its write waited for. Without this call the first save makes the default one."""
        if self._writer is not None:
            self._writer.close()
        self._writer = writer

    def last_save_timing(self):
        """How the latest save went (``checkpoints.writer.SaveTiming``: its staging, its wait for the save
        before it), once its write ended."""
        return self._save_future.result()

    def state_dict_shortcuts(self) -> tuple[bool | None, bool | None]:
        """Whether the model's and the optimizers' state dicts took the verified shortcut
        (checkpoints/state.py) at the latest save or snapshot; (None, None) before the first."""
        kept = self._ckpt_state
        return (None, None) if kept is None else (kept.model.shortcut, kept.optim.shortcut)

    def _wait_checkpoint_staging(self) -> None:
        if self._writer is not None:
            self._writer.wait_staged()

    def _finish_checkpoint_write(self) -> None:
        """Before a load: the save in flight is done, staged and written. Loading overwrites the tensors
        its staging may be copying, and its write runs DCP's collectives on the checkpoint group a load
        uses too (two collectives at once on one gloo group hang or abort it). An in-place rollback can
        come while the save queued behind the rolled-back step still writes (orchestrator/control/
        window.py). Its outcome stays the driver's to read (``wait_checkpoint``) or to drop."""
        from concurrent.futures import wait

        self._wait_checkpoint_staging()
        if self._save_future is not None:
            wait([self._save_future])  # not .result(): a failure is reported where it is read

    def _load(self, what: str, reader=None) -> int:
        """Load a training state (resharding it into this generation's mesh), collectively, and return
        its step: the checkpoint directory ``what``, or through ``reader`` (``what`` then names it for
        errors). Checkpoints and snapshots differ only in where the bytes come from."""
        from checkpoints.reader import load_training_state

        self._finish_checkpoint_write()
        return self._loaded(load_training_state(what, self.model_parts(), self.optimizers, restore_rng=False,
                                                process_group=self.groups.ckpt_group, reader=reader))

    def _loaded(self, point) -> int:
        """A load put ``point`` (``checkpoints.state.ResumePoint``) in place: float16's loss scale
        follows it and the generation may train; its step."""
        if self.loss_scale is not None and point.loss_scale:
            self.loss_scale.load_state_dict(point.loss_scale)
        self._awaiting_load = False
        return point.step

    def load_checkpoint(self, path: str) -> int:
        """Load (resharding into this generation's mesh) and return the checkpoint's step."""
        return self._load(path)

    # -- in-memory snapshots (checkpoints/snapshot_taker.py; docs/design.md, In-memory snapshots) ---
    def plan_snapshot(self, step: int, slot: int):
        """This rank's shard of step ``step``, planned into host buffer set ``slot``: the copies are the
        caller's to run off this thread (``PlannedSnapshot.copy``) before the next update; or, at the
        first take of the generation, a complete snapshot taken now."""
        from checkpoints.snapshot_taker import SnapshotTaker

        if self._snapshots is None:  # plans once per generation
            self._snapshots = SnapshotTaker()
        return self._snapshots.plan(self._training_state(step), step=step, rank=self.groups.world_rank, slot=slot)

    def plan_snapshots_from(self, metadata) -> None:
        """This generation's snapshots take the layout of ``metadata``, an old rank's snapshot this rank
        was restored from in place (``checkpoints.snapshot_taker.SnapshotTaker.seed``)."""
        from checkpoints.snapshot_taker import SnapshotTaker

        taker = SnapshotTaker()
        if taker.seed(metadata):
            self._snapshots = taker

    def load_snapshot(self, source, store, actor_id: int, asked: dict | None = None):
        """Load snapshot set ``source.key`` (every old rank's shard of one step, held by the actors
        ``source.providers`` names) into this generation's mesh, collectively as ``load_checkpoint``:
        copied in place when every rank's layout is an old rank's, else resharded through DCP,
        fetching only the pieces this rank needs (workers/snapshot_restore.py). ``asked``: the old
        ranks' metadata already asked for (``workers.snapshot_push.ask_metadata``)."""
        from workers.snapshot_restore import restore_snapshot

        return restore_snapshot(self, source, store, actor_id, asked)

    def destroy(self) -> None:
        if self._writer is not None:
            # A write still running belongs to a generation being torn down: never committed. Its
            # staging buffers are released when it ends (at once if none runs).
            self._writer.abandon(release=True)
            self._writer = None
        self._ckpt_state = None
        self.stages.clear()
        self.optimizers.clear()
        self.params.clear()
        self.groups.destroy()
