"""Where the rendezvous store lives: the driver side of ``workers.store.StoreHost``.

Every generation rendezvouses through one TCPStore hosted by a StoreHost actor. The controller asks
``StoreProvider.address()`` at each rebuild, so the store is checked then, and re-hosted (a new actor,
a new address for the next generation) when it died or its bind address no longer suits the cluster.

Placement: the store must live as long as the driver, so it is pinned to the driver's node with a
*hard* node affinity. A soft one is not enough: Ray places an actor that needs no resources
(``num_cpus=0``) on a random node unless its node affinity is hard (the special case at the top of
``ClusterResourceScheduler::GetBestSchedulableNode``). With soft affinity the store landed on a worker
node about half the time, and losing that node ended the run (issue 17; docs/design.md, "A resource-less
actor ignores a soft node affinity").
If the driver's node cannot host it (it is draining), the head node and then any other live,
non-draining node are tried.

A second StoreHost waits on the same node as a hot standby: when the store dies, the next generation
takes the standby's address at once instead of waiting for a new actor to start (it imports torch:
~1.1 s per re-host in the chaos bench's store kills), and a new standby starts in the background
once that generation trained a step. One idle process (no CPU reserved) buys that, as a hot spare
rank buys a fast rebuild. The first store starts beside the ranks (``begin``): ``launch.py`` takes it
once it answered, instead of waiting for its start before theirs. A standby is started only once a
step was trained after the store was (re)hosted (``step_read``), as the spares are
(``SparePool.ask_after_first_step``): started with the first store it competed for the cores with
the ranks' own start (0.6 s of the chaos campaign's 6.5 s start-up on 2 cores), and started at a
re-host with the rebuild's join and first step. The trade: from a (re)hosting to the first step
after it there is no standby, so a store that dies in that window (the first generation's join, a
second store loss inside one rebuild) is replaced by a new host's start (~1.1 s), as before standbys.

Bind address: loopback when every Ray node has the store node's IP (the whole job is on one
machine), else the node's own address; never the wildcard nor a public address (the store has no
authentication: ``workers.store.bind_host``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol, runtime_checkable

from orchestrator.errors import TrainingFailed

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a new StoreHost imports torch: seconds on a loaded machine
PING_TIMEOUT_S = 10.0
HEAD_RESOURCE = "node:__internal_head__"


def one_machine(store_ip: str, node_ips: Iterable[str]) -> bool:
    """True when every live Ray node has the store node's IP: a loopback store reaches them all."""
    ips = set(node_ips)
    return bool(ips) and ips == {store_ip}


def host_candidates(driver_node: str, nodes: Iterable[Mapping], draining: Collection[str] = ()) -> list[str]:
    """Node ids to try for the store, best first: the driver's, the head, then the rest; only live,
    non-draining nodes (``nodes`` as ``ray.nodes()`` returns them)."""
    alive = [n for n in nodes if n.get("Alive") and n["NodeID"] not in draining]
    ids = [n["NodeID"] for n in alive]
    heads = [n["NodeID"] for n in alive if HEAD_RESOURCE in n.get("Resources", {})]
    order = ([driver_node] if driver_node in ids else []) + heads + ids
    return list(dict.fromkeys(order))


@runtime_checkable
class StoreSource(Protocol):
    """What the controller needs: the address for the next generation, and whether the store lives."""

    def address(self) -> tuple[str, int]: ...

    def healthy(self) -> bool: ...

    def step_read(self) -> None: ...


class FixedStore:
    """A store address that never changes (tests that host their own StoreHost)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = tuple(address)

    def address(self) -> tuple[str, int]:
        return self._address

    def healthy(self) -> bool:
        return True

    def step_read(self) -> None:
        """Nothing to start: the tests that use it host their own store."""


class StoreProvider:
    """Owns the StoreHost actor; ``address()`` is the one question the controller asks."""

    def __init__(self, *, start_timeout_s: float = START_TIMEOUT_S, ping_timeout_s: float = PING_TIMEOUT_S):
        self.start_timeout_s = start_timeout_s
        self.ping_timeout_s = ping_timeout_s
        self.handle = None
        self.node_id = ""
        self.loopback = False
        self._address: tuple[str, int] | None = None
        self.hosted = 0  # how many StoreHosts were started (1 + re-hosts)
        self._standby = None  # (handle, node id, loopback, ref of its ``where``): see the module docstring
        self._begun = None  # the first store, started by ``begin`` and not yet taken (same tuple)
        self.standbys_taken = 0  # re-hosts the standby served

    def address(self) -> tuple[str, int]:
        """The store's address for the next generation; (re)hosts it when it is gone, its node is
        draining, or its bind address no longer reaches every node."""
        import ray

        nodes = ray.nodes()
        ips = _alive_ips(nodes)
        if self._address is not None:
            if not self.healthy():
                logger.warning("the rendezvous store (%s:%d) is gone: hosting a new one", *self._address)
            elif self.node_id in _draining():
                logger.info("the rendezvous store's node is draining: hosting a new one elsewhere")
            elif one_machine(_ip_of(nodes, self.node_id), ips) == self.loopback:
                return self._address
            else:
                logger.info("a node on another machine joined: re-hosting the rendezvous store on "
                            "this node's address instead of loopback")
        self._host(nodes)
        return self._address

    def begin(self) -> None:
        """Start hosting the store without waiting for it: the next ``address()`` takes it once it
        answers (``_take_begun``). ``launch.py`` calls it before the ranks start, so the store's start
        (a process importing torch: 2.6 s of a job's start-up on the 2-core machine, before the ranks'
        12.5 s) runs beside theirs; its standby waits for the first step (``step_read``). A no-op once
        a store is hosted or starting; a cluster that cannot host one is told by ``address()``, with its error."""
        import ray

        if self.handle is not None or self._begun is not None or self._standby is not None:
            return
        nodes = ray.nodes()
        candidates = host_candidates(ray.get_runtime_context().get_node_id(), nodes, _draining())
        if candidates:
            node = candidates[0]
            loopback = one_machine(_ip_of(nodes, node), _alive_ips(nodes))
            self._begun = _started_host(node, loopback)

    def healthy(self) -> bool:
        """Does the current StoreHost answer? (False before the first ``address()``.)"""
        import ray

        if self.handle is None:
            return False
        try:
            ray.get(self.handle.where.remote(), timeout=self.ping_timeout_s)
            return True
        except Exception:  # died (RayActorError), or hung past the timeout
            return False

    def step_read(self) -> None:
        """A step was trained: a hosted store without a standby (just (re)hosted, or its standby taken
        over) gets one now, started in the background (see the module docstring)."""
        if self.handle is not None and self._standby is None:
            self._start_standby()

    def close(self) -> None:
        self._drop()
        self._drop_standby()
        if self._begun is not None:
            _kill_host(self._begun[0])
            self._begun = None

    def _drop_standby(self) -> None:
        if self._standby is not None:
            _kill_host(self._standby[0])
        self._standby = None

    def _start_standby(self) -> None:
        """A second StoreHost on the current store's node, started now and not waited for."""
        self._standby = _started_host(self.node_id, self.loopback)

    def _take(self, started: tuple, nodes: list[dict], timeout_s: float, what: str) -> bool:
        """Make ``started`` (a StoreHost tuple, see ``__init__``) the store if its node is live, not
        draining, and its bind address still suits the cluster, once it answers within ``timeout_s``;
        else kill it. True if taken."""
        import ray

        handle, node, loopback, ready = started
        fits = node in host_candidates(node, nodes, _draining()) and one_machine(
            _ip_of(nodes, node), _alive_ips(nodes)) == loopback
        try:
            if fits:
                placed, address = ray.get(ready, timeout=timeout_s)
                self.handle, self.node_id, self.loopback, self._address = handle, placed, loopback, tuple(address)
                self.hosted += 1
                return True
        except Exception as exc:  # it died (its node went), or never started
            logger.info("the %s rendezvous store is not usable: %s", what, _last_line(exc))
        _kill_host(handle)
        return False

    def _take_begun(self, nodes: list[dict]) -> bool:
        """Take the store ``begin`` started; True if it was taken. It may still be importing torch: it
        gets the start timeout, as a new host would."""
        begun, self._begun = self._begun, None
        if begun is None or not self._take(begun, nodes, self.start_timeout_s, "begun"):
            return False
        logger.info("rendezvous store at %s:%d on node %s (started beside the ranks)", *self._address,
                    self.node_id[:8])
        return True

    def _promote_standby(self, nodes: list[dict]) -> bool:
        """Take the standby as the store (``_take``); True if it was taken (``step_read`` starts the next one)."""
        standby, self._standby = self._standby, None
        if standby is None or not self._take(standby, nodes, self.ping_timeout_s, "standby"):
            return False
        self.standbys_taken += 1
        logger.info("rendezvous store: the standby at %s:%d took over", *self._address)
        return True

    def _drop(self) -> None:
        if self.handle is not None:
            _kill_host(self.handle)
        self.handle, self._address = None, None

    def _host(self, nodes: list[dict]) -> None:
        import ray

        self._drop()
        if self._take_begun(nodes) or self._promote_standby(nodes):
            return
        driver = ray.get_runtime_context().get_node_id()
        ips = _alive_ips(nodes)
        errors = []
        for node in host_candidates(driver, nodes, _draining()):
            loopback = one_machine(_ip_of(nodes, node), ips)
            handle = _start_host(node, loopback)
            try:
                placed, address = ray.get(handle.where.remote(), timeout=self.start_timeout_s)
            except Exception as exc:
                errors.append(f"node {node[:8]}: {type(exc).__name__}: {_last_line(exc)}")
                ray.kill(handle, no_restart=True)
                continue
            self.handle, self.node_id, self.loopback, self._address = handle, placed, loopback, tuple(address)
            self.hosted += 1
            logger.info("rendezvous store at %s:%d on node %s%s", *self._address, placed[:8],
                        " (driver's node)" if placed == driver else "")
            return
        raise TrainingFailed("could not host the rendezvous store on any live node ("
                             + ("; ".join(errors) or "no live node") + "): check the cluster's health")


def _start_host(node: str, loopback: bool):
    """A StoreHost actor pinned to ``node`` (hard affinity: see the module docstring)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.store import StoreHost

    return StoreHost.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(loopback)


def _started_host(node: str, loopback: bool) -> tuple:
    """A StoreHost started on ``node`` and not waited for: (handle, node, loopback, ref of ``where``)."""
    handle = _start_host(node, loopback)
    return handle, node, loopback, handle.where.remote()


def _kill_host(handle) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already gone
        logger.debug("kill a StoreHost: %s", exc)


def _last_line(exc: BaseException) -> str:
    """The last line of an error's text (a Ray error ends with the actor's own exception line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _alive_ips(nodes: Iterable[Mapping]) -> set[str]:
    return {n["NodeManagerAddress"] for n in nodes if n.get("Alive")}


def _ip_of(nodes: Iterable[Mapping], node_id: str) -> str:
    return next((n["NodeManagerAddress"] for n in nodes if n["NodeID"] == node_id), "")


def _draining() -> set[str]:
    """Node ids Ray is draining now (a new actor is not placed there)."""
    from orchestrator.cluster.bundles import draining_nodes  # lazily, as Ray: this module imports without it

    return set(draining_nodes())
