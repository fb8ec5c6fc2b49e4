"""The fake rank family: what a rank answers, without torch, for the driver's tests and benchmarks.

Three members drive the same rank behaviour at three speeds:

* ``FakeRank`` (here), for ``testbed/fake_group.py``'s scripted worker group: time never passes and
  faults are armed per call (no Ray, no processes). It implements ``meshspeak.rank_calls.RankCalls``
  (tests/unit/test_rank_calls.py checks it) and answers with the real messages; its in-memory
  snapshots follow workers/snapshots.py and snapshot_push.py (taken after a step, pushed to the holder
  one at a time, acknowledged with the next step's result, the driver's ``keep`` and the newest after
  it kept).
* ``testbed/fake_rank_actor.py``'s ``FakeRankActor`` (bench/scale.py's real part): a Ray actor whose
  step sleeps, with real snapshot bytes.
* ``testbed/sim_group.py``'s ``SimGroup`` (bench/scale.py's simulated part): thousands of in-process
  ranks answering after simulated latencies.

What the three share is here, once: the order a step must come in (``refused``), the snapshots a rank
keeps (``retained``), what a save leaves on disk (``write_fake_shards``) and the step a checkpoint
directory holds (``checkpoint_step``).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Protocol

from checkpoints.layout import DCP_METADATA, parse_step
from meshspeak.messages import (
    GenerationOrders,
    JoinSpec,
    RankInfo,
    RestoreAck,
    RestoreSource,
    RuntimeSpec,
    SaveAck,
    SnapshotAck,
    SnapshotInventory,
    SplitOrders,
    StepResult,
    WorkerStatus,
    WriteAck,
    early_answer,
)
from testbed.fake_call import FakeCall


NEWEST_KEPT = 2  # kept after the driver's ``keep``, own and per owner held (workers/snapshots.py's default)
# What a rank built for a load that never came answers a step (workers/runtime.py, ``_check_loaded``).
UNINITIALISED = ("RuntimeError: the parameters were left uninitialised for a checkpoint or snapshot load "
                 "that never came: this generation cannot train")


def refused(step: int, after: int | None, done: int, world_rank: int) -> StepResult | None:
    """As ``RankActor.train_step``: the answer to a step call that does not follow the last step run
    (``done``) — the early answer when it came before the step it follows (nothing trained), a failed
    result when it came after a later one; None when it follows."""
    follows = step - 1 if after is None else after
    if done < follows:
        return early_answer(step, world_rank, follows, done)
    if done != follows:
        return StepResult(step=step, world_rank=world_rank, ok=False,
                          error=f"RuntimeError: step {step} arrived after step {done}: calls out of order")
    return None


def retained(own: dict[tuple, Any], held: dict[tuple, Any], keep: tuple | None) -> tuple[dict, dict]:
    """workers/snapshots.py's rule: of a rank's own snapshots (key -> record) and those it holds for
    others ((key, owner) -> record), the driver's ``keep`` and the newest after it, per owner."""
    newest_own = sorted(k for k in own if keep is None or k > keep)[-NEWEST_KEPT:]
    own = {k: v for k, v in own.items() if k == keep or k in newest_own}
    after: dict[int, list] = {}
    for key, owner in held:
        if keep is None or key > keep:
            after.setdefault(owner, []).append(key)
    newest = {(k, o) for o, keys in after.items() for k in sorted(keys)[-NEWEST_KEPT:]}
    held = {(k, o): v for (k, o), v in held.items() if k == keep or (k, o) in newest}
    return own, held


def write_fake_shards(path: str, world_rank: int) -> dict[str, int]:
    """What a rank's save leaves for the driver's two-phase commit to check: one small shard file and,
    on rank 0, a ``.metadata`` that is a pickle importing nothing (the driver checks a checkpoint's
    ``.metadata`` before a restore, checkpoints/safe_pickle.py, as it would a real DCP one). Returns
    name -> size (``WriteAck.files``)."""
    os.makedirs(path, exist_ok=True)
    contents = {f"__{world_rank}_0.distcp": b"x" * 16}
    if world_rank == 0:
        contents[DCP_METADATA] = pickle.dumps({"fake": "metadata"})
    for name, data in contents.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return {name: len(data) for name, data in contents.items()}


def checkpoint_step(path: str) -> int:
    """The step of the DCP directory ``path``: a step directory, or an attempt subdirectory of one
    (manifest ``dcp_dir``)."""
    step = parse_step(os.path.basename(path))
    return step if step is not None else parse_step(os.path.basename(os.path.dirname(path)))


class RankHost(Protocol):
    """What a rank uses of its scripted group (``testbed.fake_group.FakeWorkerGroup``): the snapshot
    key each actor was told to keep, its own push to a holder, and the state of that push's call."""

    keep_of: dict[int, tuple | None]

    def push(self, holder: int, key: tuple, owner: int, snap: dict) -> FakeCall: ...

    def call_state(self, call: FakeCall) -> str: ...


class FakeRank:
    """One rank actor's behaviour, answering with the real messages."""

    def __init__(self, actor_id: int, node_ip: str, group: RankHost) -> None:
        self.actor_id, self.node_ip, self.pid = actor_id, node_ip, 10_000 + actor_id
        self.group = group
        self.generation = self.world_rank = -1
        self.world = self.dp_rank = 0
        self.step = 0
        self.life = 0  # loads in this generation (snapshot keys: workers/snapshots.py)
        self.orders: GenerationOrders | None = None
        self.split: SplitOrders | None = None  # the generation's microbatch split, once one came
        self.dead = self.hung = False
        self.files: dict[str, int] = {}
        self.saving_step: int | None = None
        self.loaded: list[str] = []
        self.bad_at: dict[int, str] = {}  # step -> StepResult.bad (scripted on the group: every rank)
        self.forward_s = 0.4  # StepResult.forward_s, what stragglers are scored on (set it higher for one)
        # In-memory snapshots (workers/snapshots.py): own key -> record; held (key, owner) -> record.
        self.own: dict[tuple, dict] = {}
        self.held: dict[tuple, dict] = {}
        self.pushing: tuple[tuple, FakeCall] | None = None  # the push under way: (key, keep_snapshot call)
        self.to_take: int | None = None  # a step to snapshot once its fan-out proved whole
        self.to_push: tuple | None = None  # taken, pushed once every rank of the fan-out ran its step
        self.acks: list[SnapshotAck] = []  # acknowledged pushes, reported with the next step
        self.snapshots_loaded: list[RestoreSource] = []
        self.awaiting_load = False  # joined with RuntimeSpec.load_follows and no load came yet

    def ping(self) -> tuple[int, str, str, int]:
        return self.pid, self.node_ip, f"node-{self.node_ip}", 0

    def join_generation(self, gen: JoinSpec, spec: RuntimeSpec, orders: GenerationOrders) -> RankInfo:
        self.generation, self.world_rank, self.world = gen.generation, gen.world_rank, gen.shape.world
        self.orders, self.split, self.step, self.life = orders, None, 0, 0
        self.awaiting_load = spec.load_follows  # built uninitialised, as RankRuntime: a load must come
        self.dp_rank = gen.shape.coords(gen.world_rank).dp
        return RankInfo(world_rank=gen.world_rank, pid=self.pid, node_ip=self.node_ip,
                        gloo_listeners=((self.node_ip, 40_000 + self.actor_id),), setup_s=0.01,
                        num_params_local=100)

    def leave_generation(self, generation: int | None = None) -> None:
        if generation is None or generation == self.generation:
            self.generation = self.world_rank = -1

    def warm(self, family: str = "") -> None:
        pass

    def status(self) -> WorkerStatus:
        return WorkerStatus(world_rank=self.world_rank, pid=self.pid, generation=self.generation,
                            busy=False, step=self.step, error=None)

    def kick(self, peers: list[tuple[str, int]], gone: list[tuple[str, int]] = (), generation: int | None = None) -> int:
        return 1  # FakeWorkerGroup frees this actor's blocked calls itself (``_run``)

    def node_id(self) -> str:
        return f"node-{self.node_ip}"

    def train_threads(self) -> int:
        return 1

    def arm_fault(self, at: int, kind: str, delay_s: float = 0.3, where: str = "step", steps: int = 1) -> None:
        pass  # the real actor's test hook; faults here are armed on the group (FakeWorkerGroup.fail)

    def disarm_faults(self) -> None:
        pass  # faults here are armed on the group (FakeWorkerGroup.fail)

    def train_step(self, step: int, keep: tuple = (), after: int | None = None,
                   split: SplitOrders | None = None) -> StepResult:
        refusal = refused(step, after, self.step, self.world_rank)
        if refusal is not None:
            return refusal
        self._retain(tuple(keep) or None)
        self._push_answered()
        if self.awaiting_load:  # RankRuntime._check_loaded's refusal, latched as the actor does
            return StepResult(step=step, world_rank=self.world_rank, ok=False, error=UNINITIALISED)
        self.step = step
        self.split = split if split is not None else self.split
        # Each rank reports 1/world of the loss, so the step's loss is the step number.
        bad = self.bad_at.get(step, "")
        # elastic.rebalance: ``forward_s`` is the time at the even share; a rank's speed is fixed, so its
        # time follows its replica's count.
        counts = self.split.split if self.split is not None else None
        forward = self.forward_s if counts is None else self.forward_s * counts[self.dp_rank] * len(counts) / sum(counts)
        result = StepResult(step=step, world_rank=self.world_rank, ok=True, loss=step / self.world,
                            step_time_s=0.5, compute_s=0.4, bad=bad, skipped=bool(bad), own_s=self.forward_s,
                            forward_s=forward, snapshots=tuple(self.acks))
        self.acks = []
        every = self.orders.snapshot_every if self.orders else 0
        if every and step % every == 0 and not bad:
            self.to_take = step  # once the step's fan-out proved whole (``take_now``)
        return result

    def _snapshot(self, step: int) -> None:
        """As workers/snapshot_push.py: taken after the step, pushed to the holder in the background
        (here: once every rank of the step's fan-out ran it, ``push_taken``), one push at a time (a
        step whose last push still runs takes none); acknowledged with the next step's result."""
        if self.pushing is not None:
            return
        key = (self.generation, self.life, step)
        self.own[key] = {"generation": self.generation, "step": step, "rank": self.world_rank}
        self._retain(self.group.keep_of.get(self.actor_id))
        if self.orders.holder is not None:
            self.to_push = key

    def take_now(self, whole: bool) -> None:
        """After a step's fan-out: a real rank takes its snapshot only when the step ended well (in
        a broken one it is kicked out of its collective first)."""
        step, self.to_take = self.to_take, None
        if step is not None and whole:
            self._snapshot(step)

    def push_taken(self) -> None:
        key, self.to_push = self.to_push, None
        if key is not None and not (self.dead or self.hung):
            self.pushing = (key, self.group.push(self.orders.holder, key, self.world_rank, self.own[key]))

    def _push_answered(self) -> None:
        if self.pushing is None:
            return
        key, call = self.pushing
        state = self.group.call_state(call)
        if state in ("done", "dead", "failed"):
            self.pushing = None
            if state == "done":
                self.acks.append(SnapshotAck(key=key, stall_s=0.001, nbytes=64))

    def _retain(self, keep: tuple | None) -> None:
        """Keep what the driver's ``keep`` and workers/snapshots.py's rule keep (``retained``)."""
        self.group.keep_of[self.actor_id] = keep
        self.own, self.held = retained(self.own, self.held, keep)

    def eval_step(self, path: str, batch: int, mask_eos_id: int | None) -> dict:
        return {"loss": 1.0 / max(1, self.world), "count": 100}

    def full_state(self) -> dict:
        return {}

    def save_checkpoint(self, path: str, step: int) -> SaveAck:
        self.files = write_fake_shards(path, self.world_rank)
        self.saving_step = step
        return SaveAck(stall_s=0.01)

    def wait_checkpoint(self) -> WriteAck:
        return WriteAck(write_s=0.1, files=dict(self.files), stall_s=0.02, staging_s=0.005)

    def load_checkpoint(self, path: str) -> int:
        self.loaded.append(path)
        self.awaiting_load = False
        self.step, self.life = checkpoint_step(path), self.life + 1
        return self.step

    def keep_snapshot(self, key: tuple, owner: int, snap: Any) -> int:
        self.held[(tuple(key), owner)] = dict(snap)
        self._retain(self.group.keep_of.get(self.actor_id))
        return 64

    def give_snapshot(self, key: tuple, owner: int) -> Any:
        key = tuple(key)
        return self.own[key] if key in self.own and self.own[key]["rank"] == owner else self.held[(key, owner)]

    def wait_snapshots(self, timeout_s: float) -> tuple:
        self._push_answered()
        return tuple(self.own)

    def snapshot_inventory(self, run_id: str = "") -> SnapshotInventory:
        return SnapshotInventory(own=tuple((k, v["rank"]) for k, v in self.own.items()), held=tuple(self.held))

    def snapshot_meta(self, key: tuple, owner: int) -> Any:
        return {"key": key, "owner": owner}

    def snapshot_pieces(self, key: tuple, owner: int, requests: list) -> list:
        return [b"" for _ in requests]

    def load_snapshot(self, source: RestoreSource) -> RestoreAck:
        self.snapshots_loaded.append(source)
        self.awaiting_load = False
        self.step, self.life = source.key[2], self.life + 1
        return RestoreAck(step=source.key[2], fetched_bytes=64, shard_bytes=64)
