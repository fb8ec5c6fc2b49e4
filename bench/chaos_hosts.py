"""The chaos campaign's cluster on hosts in network namespaces (``bench/chaos.py --hosts``; issue 35).

``HostNodes`` has the interface of ``chaos_faults.LocalNodes`` (``add_node``, ``remove``, ``address``,
``shutdown``) on a real `ray start` cluster (``bench/ray_nodes.py``): the head, with 0 CPUs, in the root
namespace on a bridge address, where this process is the driver and the store host lives; each worker
node on a host of its own (``testbed/netns_hosts.py``: a network namespace with its own address from
198.18.0.0/15 and its own hostname). Needs root, `ip` and `unshare`.

It adds what only hosts can do: ``cut_for(node, seconds)`` sets the host's link down and heals it
later (the "partition" kind). A host's `ray start` may exit after the heal (Ray ends a raylet the head
declared dead): ``restart_exited`` starts it again, as systemd's Restart=always would. ``remove`` kills
every process of the host (``HostNet.kill_host``); the host then takes the replacement node.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from chaos_faults import NODE_CPUS
from ray_nodes import RayStartCluster

from testbed.netns_hosts import HostNet, unavailable_reason


@dataclass(eq=False)
class HostNode:
    """A Ray worker node on a namespace host: the host, its `ray start` and the Ray node id."""

    host: object  # testbed.netns_hosts.Host
    proc: object  # subprocess.Popen of its `ray start --block`
    node_id: str
    cut_until: float = 0.0  # time.time() when its link comes back (0: never cut)

    @property
    def name(self) -> str:
        return self.host.hostname


class HostNodes:
    """``hosts`` namespace hosts and a 0-CPU head on their bridge; see the module docstring."""

    needs = "root, `ip netns` and `unshare`"
    kinds_left_out: tuple[str, ...] = ()

    def __init__(self, hosts: int) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise SystemExit(f"bench/chaos.py --hosts: namespace hosts: {reason}")
        self.root = Path(tempfile.mkdtemp(prefix="em-ch-", dir="/tmp"))  # short: Ray's unix socket paths
        self.net = HostNet(hosts, self.root)
        self.cluster = None
        try:
            self.cluster = self._start_head()
        except BaseException:
            self.shutdown()
            raise
        self.address = self.cluster.gcs_address
        # This process is a driver of the cluster: its token, as every client of it needs.
        os.environ.update({k: self.cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")})
        self.nodes: list[HostNode] = []  # live or cut off; a removed host's node leaves the list
        self._lock = threading.Lock()

    def _start_head(self, attempts: int = 3) -> RayStartCluster:
        """The head on the bridge address, tried again when `ray start --head` gives up (Ray 2.60 gives
        the head's node 30 s to register, which a loaded 2-core machine misses)."""
        for attempt in range(1, attempts + 1):
            try:
                return RayStartCluster(0, head_ip=self.net.bridge_ip)
            except RuntimeError:
                if attempt == attempts:
                    raise
                print(f"chaos: ray start --head failed (attempt {attempt}); again", flush=True)
        raise AssertionError("unreachable")

    def add_node(self, off_main: bool = False) -> HostNode:
        """A node on the first host without one (what was left there is killed first)."""
        with self._lock:
            used = {n.host.index for n in self.nodes}
            host = next(h for h in self.net.hosts if h.index not in used)
            node = self._start(host)
            self.nodes.append(node)
            return node

    def _start(self, host, attempts: int = 4) -> HostNode:
        """A `ray start` on ``host``, tried again after killing what a failed try left there (Ray 2.60
        gives a raylet 30 s to register: three tries in a row were missed here at a load of ~55)."""
        for attempt in range(1, attempts + 1):
            self.net.kill_host(host)
            try:
                proc = self.cluster.add_node(NODE_CPUS, on_host=(self.net, host), attempts=1,
                                             env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
                return HostNode(host, proc, self.cluster.node_id_of(proc))
            except RuntimeError:
                if attempt == attempts:
                    raise
                print(f"chaos: ray start on {host.hostname} failed (attempt {attempt}); again", flush=True)
        raise AssertionError("unreachable")

    def remove(self, node: HostNode, pids: list[int]) -> None:
        """The host loses every process (``pids``, its rank actors, are among them)."""
        with self._lock:
            if node in self.nodes:
                self.nodes.remove(node)
        self.net.kill_host(node.host)

    def cut_for(self, node: HostNode, seconds: float) -> None:
        node.cut_until = time.time() + seconds
        self.net.cut_for(node.host, seconds)

    def exited(self) -> bool:
        """Some healed host's `ray start` has exited."""
        return any(n.proc.poll() is not None and time.time() > n.cut_until for n in self.nodes)

    def restart_exited(self) -> None:
        """A healed host whose `ray start` has exited gets a fresh node (a new node id) on it. The
        ``HostNode`` is updated in place: the campaign holds the same object. Called after every step:
        a call that finds another one at work returns at once."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            for node in self.nodes:
                if node.proc.poll() is not None and time.time() > node.cut_until:
                    print(f"chaos: {node.name}'s ray start exited after the heal; started again", flush=True)
                    fresh = self._start(node.host)
                    node.proc, node.node_id = fresh.proc, fresh.node_id
        finally:
            self._lock.release()

    def shutdown(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.shutdown()
        finally:
            self.net.teardown()
            shutil.rmtree(self.root, ignore_errors=True)
