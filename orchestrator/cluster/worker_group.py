"""WorkerGroup: the RankActors, their placement groups, and fan-out calls that always have a deadline.

Actors are numbered by ``actor_id`` for their whole life; their *world rank* changes per generation.
Each actor holds a placement group of its own, removed with it, so a lost node never leaves the job a
bundle Ray would re-place forever (``orchestrator/cluster/bundles.py``: why, and how new groups are packed
onto nodes). A group may instead be handed a placement group reserved for it (a Tune trial's:
`orchestrator/sweep/trial.py`): its bundles are filled first and it is never removed here.
A dead actor's call raises ``RayActorError``; that is caught only here and turned into a ``CallOutcome``.

Everything the driver's control loop needs from Ray goes through this class (calls, kills, the
capacity probe ``free_slots``, polling and draining call refs), so the controller, the checkpoint
coordinator and ``orchestrator.recovery`` never import Ray and can be driven by a fake group: both
implement ``orchestrator.cluster.group_protocol.WorkerGroupLike``. Calls are named through
``meshspeak.rank_calls.RankCalls``, never by a method-name string.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from meshspeak.messages import CallOutcome
from meshspeak.pids import pid_namespace
from meshspeak.rank_calls import SNAPSHOT_GROUP, TRAIN_GROUP, RankCall, RankCalls, call_name
from meshspeak.rank_errors import kind_of
from orchestrator.cluster.bundles import Placements, Slot, draining_nodes
from orchestrator.cluster.ray_calls import error_line, shared_arg
from orchestrator.errors import WorkerGroupStartupError

logger = logging.getLogger(__name__)

# While a call waits on actors of the driver's own Ray node, their processes are looked at this often:
# one that is gone is dead at once, not when Ray reports it (50-140 ms after the SIGKILL on
# bench/recovery.py's single node, the first part of every kill -> next step).
EXIT_POLL_S = 0.02
START_GRACE_S = 120.0  # a background start may take this long beyond placement (torch import under load)


@dataclass(frozen=True, slots=True)
class ActorResources:
    cpus: float
    gpus: int


class WorkerGroup:
    def __init__(self, resources: ActorResources, placement_timeout_s: float, *, reserved: Any = None,
                 actor_kwargs: dict[str, Any] | None = None, actor_class: type | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.resources = resources
        # workers.actor.RankActor, or another implementation of meshspeak.rank_calls.RankCalls (the
        # torch-free fake rank of bench/scale.py) with the same concurrency groups.
        self.actor_class = actor_class
        self.actor_kwargs = dict(actor_kwargs or {})  # passed to every RankActor (e.g. the profile spec)
        self.placement_timeout_s = placement_timeout_s
        self.clock = clock
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.pids: dict[int, int] = {}  # actor id -> pid, meaningful on its own node only (see ``_local_pid``)
        self.node_ips: dict[int, str] = {}  # actor id -> its node's address (placement, events); never identity
        self.node_ids: dict[int, str] = {}  # actor id -> Ray node id (what a process is told apart by)
        self.pid_namespaces: dict[int, int] = {}  # actor id -> its pid namespace (meshspeak/pids.py)
        self._own_pid_namespace = pid_namespace()  # the driver's, read once: it never changes
        self._driver_node: str | None = None  # ``driver_node``: read at first use (Ray is up by then)
        self.placements = Placements(self.bundle(), reserved=reserved, clock=clock)
        self._next_id = 0
        self._starting: dict[int, tuple[Any, Any, float]] = {}  # start_background: id -> (handle, ping, deadline)
        self._unread: list = []  # refs of calls to actors seen dead before Ray said so (``_drop_exited``)
        self._cwd = _cwd_path()  # re-entered after a node unpacked the job's working_dir over it (_started)

    # -- lifecycle --------------------------------------------------------------------------------
    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.resources.cpus}
        if self.resources.gpus:
            b["GPU"] = float(self.resources.gpus)
        return b

    def add(self, count: int, *, wait_s: float | None = None, strategy: str = "PACK") -> list[int]:
        """Start ``count`` new actors and wait for them (``strategy``: "PACK" keeps a mesh's ranks on
        as few nodes as possible; hot spares ask for "SPREAD", so that as far as the cluster allows
        they land on other nodes than the ranks they back); returns their actor ids.

        Raises WorkerGroupStartupError if the bundles cannot be placed within ``wait_s``.
        """
        wait_s = self.placement_timeout_s if wait_s is None else wait_s
        handles = self._create(self.placements.slots(count, strategy, self.draining_nodes(), wait_s))
        self.actors.update(handles)
        ids = list(handles)
        outcome = self.call(ids, RankCalls.ping, timeout_s=max(120.0, wait_s))
        if not outcome.ok:
            # Leave no half-started actors behind: callers count live_ids as ranks to form.
            self.kill(ids)
            raise WorkerGroupStartupError(
                f"workers failed to start: {outcome.dead or outcome.failed or outcome.pending}"
            )
        for actor_id, answer in outcome.results.items():
            self._started(actor_id, answer)
        return ids

    def start_background(self, count: int, *, strategy: str = "PACK") -> None:
        """Begin starting ``count`` actors and return at once; ``adopt_started`` hands each over once it
        answers. Spares and grows start this way so that the step loop never waits for a node to boot
        or an actor to import torch. Callers ask only for what ``free_slots`` offers. One that has not
        answered within resources.placement_timeout_s + ``START_GRACE_S`` is given up: its placement
        group is withdrawn and new capacity is offered again only after a backoff."""
        deadline = self.clock() + self.placement_timeout_s + START_GRACE_S
        slots = self.placements.slots(count, strategy, self.draining_nodes(), None)
        for actor_id, handle in self._create(slots).items():
            self._starting[actor_id] = (handle, getattr(handle, call_name(RankCalls.ping)).remote(), deadline)

    @property
    def starting(self) -> int:
        """Actors begun by ``start_background`` that have not answered yet."""
        return len(self._starting)

    def adopt_started(self) -> list[int]:
        """The background-started actors that answered since the last call, now live (never blocks)."""
        self.placements.watch()
        if not self._starting:
            return []
        pings = {ping: actor_id for actor_id, (_, ping, _) in self._starting.items()}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0, fetch_local=True)
        answered = {pings[ref] for ref in answered}
        ready = []
        for actor_id, (handle, ref, deadline) in list(self._starting.items()):
            done = actor_id in answered
            if not done and self.clock() < deadline:
                continue
            try:
                answer = ray.get(ref, timeout=0) if done else None
            except Exception as exc:  # it died while starting
                logger.info("actor %d failed to start: %s", actor_id, error_line(exc))
                answer = None
            if answer is None:
                self.kill([actor_id])  # given up: its placement group goes with it
                if not done:
                    self.placements.gave_up()
                continue
            del self._starting[actor_id]
            self.actors[actor_id] = handle
            self._started(actor_id, answer)
            self.placements.answered()
            ready.append(actor_id)
        return ready

    @property
    def lost_ids(self) -> list[int]:
        """Live actors found on a node the GCS declared dead (their placement groups are removed;
        a call to them fails)."""
        return sorted(a for a in self.actors if a in self.placements.lost)

    def _create(self, slots: list[Slot]) -> dict[int, Any]:
        """One RankActor in each bundle; actor id -> handle (not live until it answered a ping)."""
        actor_class = self.actor_class
        if actor_class is None:
            from workers.actor import RankActor as actor_class  # lazily: the class is shipped to the actors

        # One long-lived thread runs all of a rank's training work (the "train" group), one a peer's
        # snapshot push and a restore's reads (the "snapshots" group); the default group's threads
        # serve the driver's rescue and parked calls (status, kick, wait_checkpoint, wait_snapshots,
        # snapshot_inventory): 5, so that parked calls never leave a kick waiting for a thread.
        # See workers/actor.py TRAIN_GROUP for why.
        remote_cls = ray.remote(concurrency_groups={TRAIN_GROUP: 1, SNAPSHOT_GROUP: 1})(actor_class)
        handles = {}
        for pg, index in slots:
            actor_id = self._next_id
            self._next_id += 1
            self.placements.assign(actor_id, (pg, index))
            handles[actor_id] = remote_cls.options(
                num_cpus=self.resources.cpus,
                num_gpus=self.resources.gpus,
                max_concurrency=5,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            ).remote(actor_id, **self.actor_kwargs)
        return handles

    def _started(self, actor_id: int, answer: tuple[int, str, str, int]) -> None:
        self.pids[actor_id], self.node_ips[actor_id], self.node_ids[actor_id], self.pid_namespaces[actor_id] = answer
        self.placements.placed(actor_id, self.node_ids[actor_id])
        reenter_cwd(self._cwd)

    def kill(self, actor_ids: list[int]) -> None:
        for actor_id in actor_ids:
            handle = self.actors.pop(actor_id, None) or self._starting.pop(actor_id, (None,))[0]
            if handle is not None:
                ray.kill(handle, no_restart=True)
            self.pids.pop(actor_id, None)
            self.node_ids.pop(actor_id, None)
            self.pid_namespaces.pop(actor_id, None)
            self.placements.release(actor_id)

    def _local_pid(self, actor_id: int, here: str) -> int | None:
        """The actor's pid when it runs on the driver's own Ray node ``here``, else None.

        By Ray node id, never by address: several Ray nodes may share one address (pods on the host
        network, ``ray.cluster_utils.Cluster``, containers on one machine), each with its own pid
        namespace, where an actor's pid names some other process of this host, or none (issue 35);
        and only when the actor's pid namespace is the driver's own (meshspeak/pids.py): a driver in a
        container beside the node's raylet shares its node id, not its processes."""
        pid = self.pids.get(actor_id)
        if pid and pid > 0 and self.node_ids.get(actor_id) == here \
                and self.pid_namespaces.get(actor_id) == self._own_pid_namespace:  # never pid -1 or 0: every process
            return pid
        return None

    def kill_now(self, actor_ids: set[int] | list[int]) -> None:
        """SIGKILL processes on the driver's node directly (~0.1 s), then drop them from the group
        (``ray.kill`` alone takes ~5 s on a stopped process; it is what ends the others)."""
        for pid in self._local_pids(set(actor_ids)).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kill(sorted(actor_ids))

    def driver_node(self) -> str:
        """The Ray node id the driver runs on, read once (it never changes)."""
        if self._driver_node is None:
            self._driver_node = ray.get_runtime_context().get_node_id()
        return self._driver_node

    def exited(self, actor_ids: list[int]) -> set[int]:
        """The actors among ``actor_ids`` whose process, on this node, is gone (a SIGKILL, a crash)
        though Ray may not have reported the death yet: the failure path takes them as dead instead
        of waiting out a status poll on them (a killed rank's poll ran its full 3 s in the chaos
        campaign, and the rank was then blamed as hung). Actors on other Ray nodes are never in it,
        on this machine or not (``_local_pid``)."""
        return {a for a, pid in self._local_pids(set(actor_ids)).items() if not _process_alive(pid)}

    def draining_nodes(self) -> dict[str, float | None]:
        """Nodes Ray is draining now: node id -> seconds until the drain deadline (``bundles.draining_nodes``)."""
        return draining_nodes()

    def free_slots(self) -> int:
        """How many more actors could start right now without waiting for placement: bundles that fit
        the free resources of live, non-draining nodes (none during the backoff after a withdrawn
        request), plus reserved bundles not used yet."""
        return self.placements.free_slots(set(self.draining_nodes()))

    def shutdown(self) -> None:
        self.kill(list(self.actors) + list(self._starting))
        self.placements.shutdown()

    @property
    def live_ids(self) -> list[int]:
        return sorted(self.actors)

    # -- calls ------------------------------------------------------------------------------------
    def call(
        self,
        actor_ids: list[int],
        method: RankCall,
        args: dict[int, tuple] | tuple = (),
        *,
        timeout_s: float,
    ) -> CallOutcome:
        """Call ``method`` on each actor (per-actor args or shared args) and wait up to ``timeout_s``."""
        return self.collect(self.submit(actor_ids, method, args), timeout_s)

    def submit(self, actor_ids: list[int], method: RankCall, args: dict[int, tuple] | tuple = ()) -> dict:
        """Start calls without waiting; pass the returned refs to ``collect``. Shared ``args`` that are
        not tiny are put into the object store once, not serialized once per actor (what a restore's
        provider list would cost at hundreds of ranks)."""
        name = call_name(method)
        if not isinstance(args, dict) and len(actor_ids) > 1:
            args = tuple(shared_arg(a) for a in args)
        refs = {}
        for actor_id in actor_ids:
            a = args.get(actor_id, ()) if isinstance(args, dict) else args
            refs[getattr(self.actors[actor_id], name).remote(*a)] = actor_id
        return refs

    def handle(self, actor_id: int) -> Any:
        """The actor's handle, for a call the driver lets another rank make on it (a snapshot holder,
        a restore's providers): ``meshspeak.messages.GenerationOrders``, ``RestoreSource``."""
        return self.actors[actor_id]

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        """Wait for refs until all answered or the deadline; ``stop_early(outcome)`` may end the wait
        sooner (the controller stops waiting for a step as soon as one actor died). Answers are read in
        batches: every ref ready at once is taken in one ``ray.wait`` and one ``ray.get`` (reading
        them one ``ray.wait(num_returns=1)`` at a time cost the driver O(ranks^2) per step). An actor
        on the driver's node whose process exits is dead as soon as that is seen (``ExitWatch``, every
        ``EXIT_POLL_S``), before Ray reports it."""
        outcome = CallOutcome()
        remaining = list(refs)
        deadline = time.monotonic() + timeout_s
        self._unread = self.drain(self._unread)
        with ExitWatch(self._local_pids({refs[r] for r in remaining})) as exits:
            while remaining:
                ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=0)
                if not ready:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    ready, remaining = ray.wait(remaining, num_returns=1,
                                                timeout=min(left, EXIT_POLL_S if exits.watching else 1.0))
                    self.placements.watch()  # the driver waits here most of the time: a lost node is seen here
                    if not ready:
                        remaining = self._drop_exited(remaining, refs, exits, outcome)
                        if outcome.dead and stop_early is not None and stop_early(outcome):
                            break
                        continue
                self._read(ready, refs, outcome)
                if stop_early is not None and stop_early(outcome):
                    break
        outcome.pending = [refs[r] for r in remaining]
        outcome.pending_refs = {r: refs[r] for r in remaining}
        return outcome

    def _local_pids(self, actor_ids: set[int]) -> dict[int, int]:
        """Actor id -> pid of those among ``actor_ids`` on the driver's own Ray node (``_local_pid``)."""
        if not actor_ids:
            return {}
        here = self.driver_node()
        pids = {a: self._local_pid(a, here) for a in actor_ids}
        return {a: pid for a, pid in pids.items() if pid is not None}

    def _drop_exited(self, remaining: list, refs: dict, exits: ExitWatch, outcome: CallOutcome) -> list:
        """``remaining`` without the refs of the actors whose process ``exits`` saw exit, which
        ``outcome`` gets as dead: liveness, read from the process table, decides at once. Their refs
        are read later (``drain``), once Ray fails them, so it logs no "Unhandled error" for them."""
        if not exits.watching:
            return remaining
        gone = exits.gone({refs[r] for r in remaining})
        for actor_id in gone:
            outcome.dead[actor_id] = "ActorDiedError (its process is gone)"
        self._unread += [r for r in remaining if refs[r] in gone]
        return [r for r in remaining if refs[r] not in gone]

    def _read(self, ready: list, refs: dict, outcome: CallOutcome) -> None:
        try:
            values = ray.get(ready, timeout=10)
        except Exception:  # some of them failed: read one by one to tell which
            values = None
        if values is not None:
            for ref, value in zip(ready, values, strict=True):
                outcome.results[refs[ref]] = value
            return
        for ref in ready:
            actor_id = refs[ref]
            try:
                outcome.results[actor_id] = ray.get(ref, timeout=10)
            except RayActorError as exc:
                outcome.dead[actor_id] = type(exc).__name__
            except Exception as exc:  # the method raised: latched for the controller
                outcome.failed[actor_id] = error_line(exc)

    def all_done(self, refs, wait_s: float = 0.0) -> bool:
        """Whether every call in ``refs`` has answered (or failed), waiting up to ``wait_s`` for them,
        without moving their answers to the driver (a snapshot a rank gives another: the driver never
        unpickles torch objects). (``collect`` with a zero deadline returns before looking at any ref,
        so it cannot serve as this poll.)"""
        refs = list(refs)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s, fetch_local=False)
        return len(ready) == len(refs)

    def drain(self, refs: list) -> list:
        """Read the answers of calls nobody waits for any more, as far as they are in (never blocks),
        so Ray does not log each failed one as an "Unhandled error" with a traceback. Returns the
        refs still running: pass them again later."""
        if not refs:
            return []
        ready, rest = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for ref in ready:
            try:
                ray.get(ref, timeout=1)
            except Exception:
                pass
        return rest

    def first_cause(self, refs) -> str | None:
        """The rank-side error of the first failed call in ``refs``, not Ray's wrapper line
        (``ray::Actor.m() (pid=..)``); None when none of them failed."""
        for ref in refs:
            try:
                ray.get(ref, timeout=5)
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                text = getattr(cause, "message", None) or str(cause)
                return f"{kind_of(cause)}: {text}".splitlines()[0]
        return None


def _cwd_path() -> str | None:
    try:
        return os.getcwd()
    except FileNotFoundError:
        return os.environ.get("PWD")


def reenter_cwd(path: str | None) -> None:
    """Enter ``path`` again when this process's working directory was deleted under it.

    A job driver (``ray job submit --working-dir``) runs in the job's unpacked package inside the
    session directory. Nodes on one machine share that directory, and a node setting the package up
    for its first actor deletes and unpacks it again (Ray's ``packaging.py``: "Removing ..."): the
    driver is then in a deleted directory, and every relative path (the default ``metrics.path``)
    fails with FileNotFoundError. The new copy is at the same path, with the same files. Called as
    each actor answers: its node's unpack is done by then (it precedes the worker's start)."""
    if not path:
        return
    try:
        os.getcwd()
        return
    except FileNotFoundError:
        pass
    try:
        os.chdir(path)
        logger.info("the working directory %s was replaced (a node unpacked the job's package again): re-entered", path)
    except OSError as exc:
        logger.warning("the working directory %s is gone and cannot be re-entered: %s", path, exc)


class ExitWatch:
    """While a call waits on actors of the driver's own Ray node (actor id -> pid): which of their
    processes exited, through pidfds (Linux >= 5.3; readable once the process has exited, so a poll
    of them costs microseconds where psutil's status read costs ~85 us a process). Where there are no
    pidfds (macOS) nothing is watched: Ray's report of the death decides, as for remote actors."""

    def __init__(self, local: dict[int, int]) -> None:
        self.fds: dict[int, int] = {}
        self.exited: set[int] = set()  # gone before the watch began (the pid names no process)
        # poll, not select: a driver with many sockets open (Ray's) hands out fds past select's 1024.
        self._poll = select.poll()
        try:
            for actor_id, pid in local.items():
                self._watch(actor_id, pid)
        except BaseException:  # the with-block was not entered: nothing else would close them
            self.__exit__()
            raise

    def _watch(self, actor_id: int, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.exited.add(actor_id)
        except (AttributeError, OSError):  # no pidfds on this system (or not for this pid)
            return
        else:
            self.fds[actor_id] = fd
            self._poll.register(fd, select.POLLIN)

    @property
    def watching(self) -> bool:
        return bool(self.fds or self.exited)

    def gone(self, actor_ids: set[int]) -> set[int]:
        """Those of ``actor_ids`` whose process exited."""
        fds = {self.fds[a]: a for a in actor_ids if a in self.fds}
        readable = [fd for fd, _ in self._poll.poll(0) if fd in fds] if fds else []
        return {fds[fd] for fd in readable} | (self.exited & actor_ids)

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an exited child Ray has not reaped yet)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # a pid we may not read: taken as alive (the status poll decides)
        return True
