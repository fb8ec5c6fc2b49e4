"""What the driver's control loop uses of a worker group, as a Protocol (no Ray here).

The controller, the checkpoint and snapshot coordinators and ``orchestrator.recovery.settle`` use a
worker group only through these members. ``orchestrator.cluster.worker_group.WorkerGroup`` (Ray
actors) and ``testbed.fake_group.FakeWorkerGroup`` (scripted ranks, no processes) both implement it;
``tests/unit/test_group_protocol.py`` checks that each has every member with the same parameters.

Calls are named through ``meshspeak.rank_calls.RankCalls`` (never a method-name string). A call on
several actors is ``submit`` (returns its refs: ref -> actor id) then ``collect`` (waits up to a
deadline and sorts the answers into a ``CallOutcome``: results, dead, failed, pending); ``call`` is
both. Nothing here raises for a dead actor: death is an outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from meshspeak.messages import CallOutcome
from meshspeak.rank_calls import RankCall


class WorkerGroupLike(Protocol):
    # -- who is there -----------------------------------------------------------------------------
    pids: dict[int, int]  # actor id -> pid
    node_ips: dict[int, str]  # actor id -> node IP
    node_ids: dict[int, str]  # actor id -> Ray node id (drain notices name nodes by id)

    @property
    def live_ids(self) -> list[int]:
        """The actors that answered and were not killed, sorted."""

    @property
    def starting(self) -> int:
        """Actors begun by ``start_background`` that have not answered yet."""

    @property
    def lost_ids(self) -> list[int]:
        """Live actors found on a node the GCS declared dead (a call to them fails)."""

    # -- starting and stopping actors -------------------------------------------------------------
    def add(self, count: int, *, wait_s: float | None = None, strategy: str = "PACK") -> list[int]:
        """Start ``count`` actors and wait for them (raises WorkerGroupStartupError)."""

    def start_background(self, count: int, *, strategy: str = "PACK") -> None:
        """Begin starting ``count`` actors; ``adopt_started`` takes them in once they answer."""

    def adopt_started(self) -> list[int]:
        """The background-started actors that answered since the last call (never blocks)."""

    def free_slots(self) -> int:
        """How many more actors could start now without waiting for placement."""

    def draining_nodes(self) -> dict[str, float | None]:
        """Node id -> seconds until its drain deadline (None: no deadline)."""

    def kill(self, actor_ids: list[int]) -> None:
        """Kill and forget these actors."""

    def kill_now(self, actor_ids: set[int] | list[int]) -> None:
        """SIGKILL local processes directly, then ``kill``."""

    def driver_node(self) -> str:
        """The Ray node id the driver runs on (up as long as the driver is)."""

    def exited(self, actor_ids: list[int]) -> set[int]:
        """Those of ``actor_ids`` whose process is seen gone before Ray reported their death."""

    # -- calls ------------------------------------------------------------------------------------
    def call(self, actor_ids: list[int], method: RankCall, args: dict[int, tuple] | tuple = (), *,
             timeout_s: float) -> CallOutcome:
        """``submit`` then ``collect``."""

    def submit(self, actor_ids: list[int], method: RankCall, args: dict[int, tuple] | tuple = ()) -> dict:
        """Start calls without waiting: ref -> actor id (per-actor args or shared args)."""

    def handle(self, actor_id: int) -> Any:
        """What a rank needs to call this actor (the driver hands it out: a snapshot holder, a
        restore's providers)."""

    def collect(self, refs: dict, timeout_s: float, *,
                stop_early: Callable[[CallOutcome], bool] | None = None) -> CallOutcome:
        """Wait for refs until all answered, the deadline, or ``stop_early(outcome)``."""

    def all_done(self, refs: Any, wait_s: float = 0.0) -> bool:
        """Whether every call in ``refs`` has answered (or failed), waiting up to ``wait_s``, without
        moving the answers to the driver."""

    def drain(self, refs: list) -> list:
        """Read the answers of calls nobody waits for any more; the refs still running."""

    def first_cause(self, refs: Any) -> str | None:
        """The rank-side error of the first failed call in ``refs``."""
