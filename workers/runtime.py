"""RankRuntime: everything one rank trains with during one generation.

It owns the generation's ``RankGroups``, this rank's pipeline stages (built, TP'd and FSDP'd),
their optimizers and the data source. A rebuild throws the whole object away and makes a new one
from the next generation's groups; state crosses generations only through a checkpoint (or the
in-memory snapshot used by tests), never through cached groups or meshes.

Usable without Ray (the single-rank benchmark and the spawned-process tests build it directly).
"""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import torch
from torch import nn

import meshdata as data_lib
from meshmodels.build import build_local_stage
from meshmodels.family import runtime_family
from meshmodels.hf_io import load_hf
from meshspeak.mesh import layer_ranges
from meshspeak.messages import RuntimeSpec, StepResult, WriteAck
from meshspeak.schedule import Action, placement_of, stages_of_rank
from workers import compile_stats
from workers.batching import eval_forward, step_data
from workers.compression import setup_dp_reduction, wrap_ddp
from workers.compute_clock import ComputeClock
from workers.groups import RankGroups
from workers.loss_scale import DynamicLossScale
from workers.optim import build_optimizer, clip_grad_norm, lr_at, poison_grads, set_lr
from workers.parallelize import parallelize_stage
from workers.pipeline import Executor, Stage, StepData
from workers.tied import TiedGrads

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class RankRuntime:
    def __init__(self, spec: RuntimeSpec, groups: RankGroups) -> None:
        self.spec = spec
        self.groups = groups
        model_cfg, train = spec.model, spec.train
        shape, coords = groups.shape, groups.coords
        self.num_stages = shape.pp * spec.virtual_stages
        self.param_dtype = DTYPES[train.dtype]
        ranges = layer_ranges(list(spec.layers_per_stage))
        self.stages: dict[int, Stage] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.family, self.shape = runtime_family(spec)
        # The data-parallel strategy comes decided in the spec (meshspeak/dp_plan.py): DDP, FSDP2 or none.
        dp_plan = spec.dp
        use_ddp = dp_plan.wrapper == "ddp"
        placement = placement_of(spec.schedule)  # zbv: the V (meshspeak/actions.py)
        for index in stages_of_rank(coords.pp, shape.pp, spec.virtual_stages, placement):
            first, end = ranges[index]
            # Built on the meta device; only this rank's shards are ever allocated (meshmodels/build.py).
            module = build_local_stage(
                self.family, self.shape, range(first, end), device=groups.device, seed=train.seed,
                activation_checkpointing=train.activation_checkpointing,
                init=not spec.init_from and not spec.load_follows,  # a load overwrites it anyway
                dtype=torch.float64 if train.dtype == "float64" else None,  # fp64 master weights too
                cpu_offload=dp_plan.cpu_offload,
                parallelize=lambda m: parallelize_stage(
                    m, self.family, dp_plan, tp_mesh=groups.tp_mesh,
                    dp_mesh=groups.shard_mesh if dp_plan.fsdp_over == "shard" else groups.dp_mesh,
                    param_dtype=self.param_dtype, fsdp_unit_bytes=int(spec.fsdp_unit_mb * 2**20),
                    compile=train.compile,
                ),
            )
            self.stages[index] = Stage(
                index=index, module=module, is_first=index == 0, is_last=index == self.num_stages - 1,
                ddp=wrap_ddp(module, groups.dp_group) if use_ddp else None,
            )
            self.optimizers.append(build_optimizer(module, train, dp_group=groups.dp_group))
        # The dp bytes of each step, and the reduction the plan chose (workers/compression.py).
        self.dp_bytes = setup_dp_reduction([st.module for st in self.stages.values()], dp_plan, train, groups,
                                           [st.ddp for st in self.stages.values() if st.ddp is not None],
                                           self.optimizers)
        # Each step's compute time without FSDP's waits, for straggler scoring (workers/compute_clock.py).
        self.compute_clock = ComputeClock((b for st in self.stages.values() for b in self.family.blocks(st.module)),
                                          device=groups.device)
        self.params: list[nn.Parameter] = [
            p for stage in self.stages.values() for p in stage.module.parameters()
        ]
        self._bound_checkpoint_group()
        self._apply_family_specifics()
        seq_local = model_cfg.seq_len // shape.tp if shape.tp > 1 else model_cfg.seq_len
        self.executor = Executor(
            self.stages,
            num_stages=self.num_stages,
            pp=shape.pp,
            peer_of_pp_index=groups.pp_peer,
            boundary_shape=(train.micro_batch_size, seq_local, self.shape.d_model),
            boundary_dtype=self.param_dtype,
            device=groups.device,
            pp_group=groups.pp_group if shape.pp > 1 else None,
            # gloo only (see workers.p2p). 4 ahead: interleaved 1F1B's late receives went from
            # 3.7 ms (p90) with 0 ahead to 0.25 ms, and its pp=2 m=8 bubble from 0.11-0.13 to 0.086.
            recv_lookahead=4 if groups.backend == "gloo" else 0,
            nccl_plan=self._nccl_plan if groups.backend == "nccl" else None,
            loss_fn=self.family.loss_sum,
            placement=placement,
        )
        # fp16: dynamic loss scaling, one decision for all ranks (workers/loss_scale.py).
        self.loss_scale = DynamicLossScale(scale=train.loss_scale_initial, growth_interval=train.loss_scale_window,
                                           min_scale=train.loss_scale_min) if train.dtype == "float16" else None
        self._writer = None
        self._save_future = None
        self._ckpt_state = None  # checkpoints.state.TrainingState, made at the first save
        self._snapshots = None  # checkpoints.memory.SnapshotTaker, made at the first snapshot
        self._save_call_s = 0.0
        self.data = data_lib.open_mixture(spec.data_mix or spec.data_path, model_cfg.seq_len)
        self.source = self.data.reader
        # Test hooks (RankActor.arm_fault): a NaN in this rank's gradient; CPU seconds burnt / seconds
        # slept inside the step's first block forward, as a straggler would (workers/compute_clock.py).
        self.inject_nan_grad = False
        # Built uninitialised because the driver announced a load (RuntimeSpec.load_follows): nothing
        # may train, evaluate or save before it came (e.g. the snapshot's holder died in between).
        self._awaiting_load = spec.load_follows
        self.inject_busy_s = 0.0
        self.inject_sleep_s = 0.0
        # Called before the optimizer writes the state: a snapshot still copying it finishes first
        # (the actor's snapshot worker sets it; workers/snapshot_push.py).
        self.before_update = lambda: None
        self.inject_sleep_each_s = 0.0  # test hook: seconds slept in every microbatch (a slow device)

    # -- training ---------------------------------------------------------------------------------
    def _nccl_plan(self, actions: list[Action]) -> list:
        """This rank's lockstep P2P batches on NCCL (meshspeak.p2p_rounds; cached per list)."""
        from meshspeak.p2p_rounds import rank_batches

        return rank_batches(self.spec.schedule, self.groups.shape.pp, self.spec.virtual_stages,
                            self.groups.coords.pp, tuple(actions))

    def _step_data(self, step: int, split: tuple[int, ...] | None) -> StepData:
        train, shape = self.spec.train, self.groups.shape
        ids = data_lib.replica_slice(
            self.data.step_ids(step, train.global_batch_size, train.seed), train.micro_batch_size,
            self.groups.coords.dp, shape.dp, counts=split,
        )
        # Loss normalisation (global count of counted targets, document masks): workers/batching.py.
        return step_data(self, self.source, ids, self.spec.mask_eos_id)[0]

    def eval_step(self, path: str, batch: int, actions: list[Action], mask_eos_id: int | None) -> dict:
        """Held-out loss of eval batch ``batch`` (forward only; see workers/batching.py)."""
        self._check_loaded()
        return eval_forward(self, path, batch, actions, mask_eos_id)

    def _check_loaded(self) -> None:
        if self._awaiting_load:
            raise RuntimeError("the parameters were left uninitialised for a checkpoint or snapshot load "
                               "that never came: this generation cannot train")

    def train_step(self, step: int, actions: list[Action], split: tuple[int, ...] | None = None) -> StepResult:
        """Forward/backward over the schedule, clip, optimizer step. Collective errors propagate.

        ``split``: the step's microbatches per dp replica as the driver decided them
        (``elastic.rebalance``: meshspeak/rebalance.py); ``actions`` is then the schedule for this
        replica's count. None: the even split.

        A step whose loss or global grad norm is not finite is skipped on every rank: parameters and
        optimizer state untouched, reported as ``StepResult.bad`` (docs/design.md, Bad steps).
        """
        self._check_loaded()
        t0 = time.perf_counter()
        compiled = self.spec.train.compile
        if compiled:
            compile_stats.PROCESS.start()
        own0 = time.thread_time()
        self.compute_clock.take()  # drop what an eval forward counted since the last step
        self.compute_clock.busy_s, self.compute_clock.sleep_s = self.inject_busy_s, self.inject_sleep_s
        self.compute_clock.sleep_each_s = self.inject_sleep_each_s
        data = self._step_data(step, split)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        scaler = self.loss_scale
        if scaler is not None:
            self.executor.loss_scale = scale_used = scaler.scale
        loss, timings, compute = self.executor.run(actions, data)
        self.tied.sync()
        holds_loss = self.num_stages - 1 in self.stages
        loss_bad = holds_loss and not math.isfinite(loss)
        if loss_bad or self.inject_nan_grad:
            self.inject_nan_grad = False
            poison_grads(self.params, self.tied.not_in_norm)
        verdict = self._fp16_verdict(loss_bad) if scaler is not None else ""
        bad = "" if verdict == "overflow" else verdict
        if not verdict:
            # The global grad norm (reduced over dp, tp and pp) is the one decision for every rank:
            # a NaN/inf gradient anywhere, or a rank's non-finite loss (poisoned into its gradient
            # above), makes it non-finite everywhere. So it is computed even when clipping is off.
            world = self.groups.world_axes if self.groups.shape.world > 1 else None
            norm = clip_grad_norm(self.params, self.spec.train.grad_clip, world, self.tied.not_in_norm,
                                  holders=self.groups.shape.dp * self.groups.shape.tp, device=self.groups.device,
                                  timeout_s=self.spec.collective_timeout_s)
            if math.isfinite(norm):
                self.before_update()  # a snapshot may still be copying the state set_lr and opt.step() update
                set_lr(self.optimizers, lr_at(step, self.spec.train))
                self._wait_checkpoint_staging()  # a save may still be copying the state opt.step() updates
                for opt in self.optimizers:
                    opt.step()
            else:
                bad = "loss" if loss_bad else "grad_norm"
                logger.warning("step %d: %s not finite; update skipped on every rank", step, bad)
        elif verdict == "overflow":
            logger.warning("step %d: fp16 gradients overflowed; update skipped on every rank, loss "
                           "scale now %g", step, scaler.scale)
        else:
            logger.warning("step %d: %s not finite at loss scale %g; update skipped on every rank", step, bad,
                           scaler.scale)
        coords = self.groups.coords
        reports_loss = self.num_stages - 1 in self.stages and coords.tp == 0
        return StepResult(
            step=step,
            world_rank=self.groups.world_rank,
            ok=True,
            loss=loss if reports_loss else None,
            step_time_s=time.perf_counter() - t0,
            compute_s=compute,
            timings=tuple(timings),
            loss_scale=scale_used if scaler is not None else None,
            skipped=bool(verdict) or bool(bad),
            bad=bad,
            own_s=time.thread_time() - own0,
            forward_s=self.compute_clock.take(),
            dp_bytes=self.dp_bytes.take() if self.dp_bytes is not None else None,
            recompiles=compile_stats.PROCESS.stop() if compiled else None,
        )

    def _fp16_verdict(self, loss_bad: bool) -> str:
        """float16: unscale the gradients and judge the step, one decision for every rank (an
        all-reduce over the world): "", "overflow", or a bad step's reason (workers/loss_scale.py)."""
        checked = self.loss_scale.unscale_and_check(self.params, self.groups.device, self.groups.world_axes,
                                                    self.spec.collective_timeout_s, loss_bad=loss_bad)
        return self.loss_scale.judge(*checked)

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

    def _bound_checkpoint_group(self) -> None:
        """Give the checkpoint group's collectives (DCP save and load, init_from) a bound derived from
        the work instead of ``elastic.collective_timeout_s``: in them every rank waits for the slowest
        one's storage, and a rank a minute behind used to fail a save with every rank alive, which read
        as storage failing and stopped the run. A rank that dies is found by liveness and its peers
        freed by the driver's kick, so this bound is only the backstop for a live rank that never
        returns (#36: time alone never fails a live run)."""
        from datetime import timedelta

        from checkpoints.writer import checkpoint_group_timeout_s

        planned = 3 * sum(p.numel() * p.element_size() for p in self.params)  # parameters + Adam's 2 moments
        bound_s = checkpoint_group_timeout_s(planned, self.spec.collective_timeout_s)
        if bound_s > self.spec.collective_timeout_s:
            self.groups.ckpt_group.set_timeout(timedelta(seconds=bound_s))
            logger.info("checkpoint group timeout %.0f s (elastic.collective_timeout_s %.0f s): %d bytes of state "
                        "at the slowest storage waited for", bound_s, self.spec.collective_timeout_s, planned)

    def _apply_family_specifics(self) -> None:
        """The model family's specifics (meshmodels/): tied copies across stages, initial HF weights."""
        modules = {i: st.module for i, st in self.stages.items()}
        self.tied = TiedGrads(self.family.tied_parameters(self.shape), modules, self.num_stages, self.groups,
                              self.spec.collective_timeout_s)
        if self.spec.init_from:
            # Straight into the local shards, collectively; the driver validated the directory.
            load_hf(self.model_parts(), self.family, self.spec.init_from, process_group=self.groups.ckpt_group)

    def model_parts(self) -> list[nn.Module]:
        return [stage.module for stage in self.stages.values()]

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, path: str, step: int) -> float:
        """Stage this rank's shard of step ``step`` and start writing it; returns the stall seconds."""
        from checkpoints.state import TrainingState
        from checkpoints.writer import AsyncCheckpointWriter

        t0 = time.perf_counter()
        if self._writer is None:
            # Dedicated group: async DCP on a training group aborts gloo (docs/design.md, F9).
            # Staging in the background overlaps the copy with the next forward/backward, which only
            # read the parameters; train_step waits for it before the optimizer writes them.
            self._writer = AsyncCheckpointWriter(self.groups.ckpt_group, use_async=self.spec.async_checkpoint,
                                                 stage_in_background=True)
        if self._ckpt_state is None:  # kept for the generation: later saves take the fast path
            self._ckpt_state = TrainingState(self.model_parts(), self.optimizers)
        state = self._ckpt_state.snapshot(step=step, data_cursor=step * self.spec.train.global_batch_size,
                                          rng=False, loss_scale=None if self.loss_scale is None else self.loss_scale.state_dict())
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

    def load_checkpoint(self, path: str) -> int:
        """Load (resharding into this generation's mesh) and return the checkpoint's step."""
        from checkpoints.reader import load_training_state

        self._finish_checkpoint_write()
        point = load_training_state(
            path, self.model_parts(), self.optimizers, restore_rng=False,
            process_group=self.groups.ckpt_group,
        )
        if self.loss_scale is not None and point.loss_scale:
            self.loss_scale.load_state_dict(point.loss_scale)
        self._awaiting_load = False
        return point.step

    # -- in-memory snapshots (checkpoints/snapshot_taker.py; docs/design.md, In-memory snapshots) ---
    def plan_snapshot(self, step: int, slot: int):
        """This rank's shard of step ``step``, planned into host buffer set ``slot``: the copies are the
        caller's to run off this thread (``PlannedSnapshot.copy``) before the next update; or, at the
        first take of the generation, a complete snapshot taken now."""
        from checkpoints.snapshot_taker import SnapshotTaker
        from checkpoints.state import TrainingState

        if self._ckpt_state is None:  # shared with checkpoints: the same verified fast state dicts
            self._ckpt_state = TrainingState(self.model_parts(), self.optimizers)
        if self._snapshots is None:  # plans once per generation
            self._snapshots = SnapshotTaker()
        state = self._ckpt_state.snapshot(step=step, data_cursor=step * self.spec.train.global_batch_size,
                                          rng=False, loss_scale=None if self.loss_scale is None else self.loss_scale.state_dict())
        return self._snapshots.plan(state, step=step, rank=self.groups.world_rank, slot=slot)

    def load_snapshot(self, source, store, actor_id: int):
        """Load snapshot set ``source.key`` (every old rank's shard of one step, held by the actors
        ``source.providers`` names) resharded into this generation's mesh, collectively as
        ``load_checkpoint``, fetching only the pieces this rank's load plan needs: the new rank 0 reads
        every old rank's metadata and broadcasts the list; each rank's DCP reads then ask the providers
        for their slices (workers/snapshot_push.py)."""
        import torch.distributed as dist

        from checkpoints.memory import RemoteReader
        from checkpoints.reader import load_training_state
        from checkpoints.state import local_state_bytes
        from meshspeak.messages import RestoreAck
        from workers.snapshot_push import fetch_metadata, fetch_pieces

        t0 = time.perf_counter()
        self._finish_checkpoint_write()
        key = tuple(source.key)
        providers = {rank: (actor, handle) for rank, actor, handle in source.providers}
        metas = [fetch_metadata(store, key, providers, actor_id) if self.groups.world_rank == 0 else None]
        if self.groups.shape.world > 1:
            dist.broadcast_object_list(metas, src=0, group=self.groups.ckpt_group)
        t_meta = time.perf_counter()
        reader = RemoteReader(metas[0], key[2], lambda wanted: fetch_pieces(store, key, providers, actor_id, wanted))
        point = load_training_state(
            f"in-memory snapshot of step {key[2]}", self.model_parts(), self.optimizers,
            restore_rng=False, process_group=self.groups.ckpt_group, reader=reader,
        )
        logger.info("loaded snapshot of step %d in %.3f s: metadata %.3f, load %.3f (%d bytes)", key[2],
                    time.perf_counter() - t0, t_meta - t0, time.perf_counter() - t_meta, reader.fetched_bytes)
        if self.loss_scale is not None and point.loss_scale:
            self.loss_scale.load_state_dict(point.loss_scale)
        self._awaiting_load = False
        return RestoreAck(step=point.step, fetched_bytes=reader.fetched_bytes,
                          shard_bytes=local_state_bytes(self.params, self.optimizers))

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
