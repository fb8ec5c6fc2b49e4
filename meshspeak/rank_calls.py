"""The calls the driver (and the tests) make on a rank actor: one typed table, never a method name.

``RankCalls`` lists every method of ``workers.actor.RankActor`` that anything outside the actor calls,
with its parameters and what it answers. Callers name a call through the table
(``group.submit(ids, RankCalls.train_step, args)``), so a reader and a type checker can follow it to
its signature here and to the actor's method of the same name; a misspelt call fails at import time,
not on the rank. ``tests/unit/test_rank_calls.py`` checks that the real actor and the fake one
(``testbed/fake_group.py``) implement every entry with the same parameters, and the worker groups
refuse a call that is not in the table (``call_name``).

Pure: no torch, no Ray (a snapshot travels as ``Any``: its class lives in ``checkpoints.memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from meshspeak.messages import (
    GenerationOrders,
    JoinSpec,
    RankInfo,
    RestoreAck,
    RestoreSource,
    RuntimeSpec,
    SaveAck,
    SnapKey,
    SnapshotInventory,
    SplitOrders,
    StepResult,
    WorkerStatus,
    WriteAck,
)

# The actor's concurrency groups (workers/actor.py says why): one thread runs all training work; one
# takes a peer's snapshot push and serves a restore's reads; the default pool serves the rest.
TRAIN_GROUP = "train"
SNAPSHOT_GROUP = "snapshots"


class RankCalls(Protocol):
    """What a rank actor answers (``workers/actor.py`` says how; the threads are its business)."""

    # -- life and health (any thread) -------------------------------------------------------------
    def ping(self) -> tuple[int, str, str, int]:
        """(pid, node IP, Ray node id, pid namespace: ``meshspeak.pids.pid_namespace``)."""

    def warm(self, family: str = "") -> None:
        """Import what joining a generation needs (a hot spare), the job's ``model.family`` included."""

    def status(self) -> WorkerStatus:
        """Answered on a second thread while the training thread may be blocked."""

    def kick(self, peers: list[tuple[str, int]], gone: list[tuple[str, int]] = (), generation: int | None = None) -> int:
        """Free a collective blocked on a dead peer (docs/design.md, Failure path): ``peers`` are the
        live members' gloo listeners, ``gone`` the dead or cut-off members'. ``generation``: the one
        the kick is for; a rank already joining or in a later one ignores it (a kick that arrives late)."""

    def node_id(self) -> str:
        """The Ray node the actor runs on."""

    def train_threads(self) -> int:
        """How many threads ran training work (1 by design)."""

    def arm_fault(self, at: int, kind: str, delay_s: float = 0.3, where: str = "step", steps: int = 1) -> None:
        """Test hook: a fault at a step, a forward, a join, a load or a checkpoint write."""

    def disarm_faults(self) -> None:
        """Test hook, between runs: every armed fault is dropped, a step fault that fired included (it
        stays armed for its step numbers, which the next run on the same actor counts again from 1)."""

    # -- generations (training thread) ------------------------------------------------------------
    def join_generation(self, gen: JoinSpec, spec: RuntimeSpec, orders: GenerationOrders) -> RankInfo:
        """Leave the current generation and join ``gen``; ``orders`` hold what every step runs."""

    def leave_generation(self, generation: int | None = None) -> None:
        """Leave the current generation (a spare), or only generation ``generation`` (the survivors of
        a broken one, told as soon as they were freed: a later generation it may already have joined,
        the call arriving out of order, is left alone)."""

    # -- steps (training thread) ------------------------------------------------------------------
    def train_step(self, step: int, keep: tuple = (), after: int | None = None,
                   split: SplitOrders | None = None) -> StepResult:
        """Train one step (queued behind the calls before it); errors are latched into the result and
        every later call of the generation refuses. ``keep``: the newest complete snapshot set's key,
        which the rank keeps however many it takes after it; ``after``: the step it follows;
        ``split``: a new microbatch split from this step on (elastic.rebalance), kept."""

    def eval_step(self, path: str, batch: int, mask_eos_id: int | None) -> dict:
        """This rank's share of one held-out batch's loss (training thread, between steps)."""

    def full_state(self) -> dict:
        """Unsharded parameters (a collective; answered by dp=0, tp=0 ranks)."""

    # -- storage checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, path: str, step: int) -> SaveAck:
        """Stage this rank's shard and start writing it (training thread)."""

    def wait_checkpoint(self) -> WriteAck:
        """Answer once the shard is durable (a second thread)."""

    def load_checkpoint(self, path: str) -> int:
        """Load a committed checkpoint resharded into this generation; its step."""

    # -- in-memory snapshots (taken and pushed by the rank after its steps: GenerationOrders) ------------
    def keep_snapshot(self, key: SnapKey, owner: int, snap: Any) -> int:
        """A holder keeps a copy of rank ``owner``'s snapshot ``key`` (called by that rank, or by the driver
        with another actor's ``give_snapshot`` answer: a second copy); its bytes."""

    def give_snapshot(self, key: SnapKey, owner: int) -> Any:
        """The whole of rank ``owner``'s snapshot ``key``, which this actor holds (own or a copy): asked
        for by a rank that joins a mesh of the same size as rank ``owner`` (its load's shard), and by
        the driver for a second copy (handed on to ``keep_snapshot``; the driver never reads it)."""

    def wait_snapshots(self, timeout_s: float) -> tuple:
        """Wait until every snapshot this rank took was pushed and acknowledged; the keys held."""

    def snapshot_inventory(self, run_id: str = "") -> SnapshotInventory:
        """The snapshots this actor can give: its own, and the copies it holds; of run ``run_id`` only,
        when given (an actor whose snapshots are another run's answers none, and drops them)."""

    def snapshot_meta(self, key: SnapKey, owner: int) -> Any:
        """The DCP metadata of rank ``owner``'s snapshot ``key`` (own or held)."""

    def snapshot_pieces(self, key: SnapKey, owner: int, requests: list) -> list:
        """Slices of rank ``owner``'s snapshot ``key``: (storage index, offsets, lengths) each."""

    def load_snapshot(self, source: RestoreSource) -> RestoreAck:
        """Load snapshot set ``source.key`` resharded into this generation (a collective), fetching
        from the providers only the pieces this rank needs."""


RankCall = Callable[..., Any]  # an entry of RankCalls, e.g. ``RankCalls.train_step``

CALLS: frozenset[str] = frozenset(name for name, value in vars(RankCalls).items()
                                  if callable(value) and not name.startswith("_"))


def call_name(call: RankCall) -> str:
    """The actor method an entry of ``RankCalls`` names. Anything else (a bare string, another
    function) is refused: every call on a rank goes through the table."""
    name = getattr(call, "__name__", None)
    if name not in CALLS or getattr(RankCalls, name) is not call:
        raise TypeError(f"{call!r} is not an entry of meshspeak.rank_calls.RankCalls: name rank calls "
                        "through the table (e.g. RankCalls.train_step)")
    return name
