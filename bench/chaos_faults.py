"""The fault kinds of ``bench/chaos.py`` and the cluster they are injected into.

Each kind is a function ``(campaign, controller, step) -> str`` run from a controller step hook at the
boundary before ``step``; it arms or does the fault and returns a line saying what it did. The
campaign (``Campaign``) holds the multi-node Ray cluster (``ray.cluster_utils.Cluster``: a CPU-less head
for the driver and the store host, worker nodes of ``NODE_CPUS`` slots) and brings capacity back after
a node is lost, as an autoscaler would: a replacement node joins ``REPLACE_AFTER_S`` later.

The kinds (the issue's list): ``kill_step`` (SIGKILL after a rank's first forward), ``kill_ckpt_write``
(SIGKILL inside the rank's background checkpoint write), ``kill_rebuild`` (a rank dies, and another
rank dies while the next generation joins), ``hang`` (SIGSTOP: the step times out), ``node_removal``
(a node hosting ranks vanishes without notice), ``drain`` (a preemption notice with a deadline, the
node removed at the deadline), ``straggler`` (one rank sleeps inside its forward in each of its next
steps until it is evicted: workers/compute_clock.py), ``store_kill`` (the rendezvous store's actor is
killed), ``truncate_ckpt`` (a shard file of the newest committed checkpoint is cut in half: it must be
found invalid and never resumed from), ``slow_storage`` (issue 36: one rank's next checkpoint write
stalls ``slow_write_s`` — longer than the step timeout — before its first byte, as on a throttled disk or
bucket; the save's collectives and the driver wait for it, and a follow-up ``SLOW_STORAGE_STEPS`` later
makes that rank's storage fast again) and, on namespace hosts only (``bench/chaos_hosts.py``),
``partition`` (issue 35: the link of a host holding a rank goes down for ``PARTITION_S`` seconds, then
comes back; its processes live on, unreachable).

The cluster ("nodes") is either a local ``ray.cluster_utils.Cluster`` (``LocalNodes``) or hosts in network
namespaces (``chaos_hosts.HostNodes``); both give ``add_node``, ``remove(node, pids)``, ``address`` and
``shutdown``; a node has ``node_id``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import remove_node

from meshspeak.rank_calls import RankCalls

NODE_CPUS = 2
REPLACE_AFTER_S = 2.0
DRAIN_DEADLINE_S = 20.0
STRAGGLER_SLEEP_S = 0.5
PARTITION_S = 15.0
SLOW_STORAGE_STEPS = 6  # the slowed rank's storage is fast again this many steps after the fault (one save)


class LocalNodes:
    """A local multi-node Ray (``ray.cluster_utils.Cluster``): a CPU-less head for the driver and the
    store host, worker nodes of ``NODE_CPUS`` slots on this machine."""

    needs = None  # runs wherever Ray does
    kinds_left_out = ("partition",)  # every node shares this machine's network

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "_system_config": {"enable_metrics_collection": False}})
        self.address = self.cluster.address
        self._adding = threading.Lock()

    def add_node(self, off_main: bool = False):
        if not off_main:
            return self.cluster.add_node(num_cpus=NODE_CPUS)
        # Ray's ``Cluster.add_node`` installs exit signal handlers, which only the main thread may:
        # without them (``_shutdown_at_exit``) the node is still stopped by ``Cluster.shutdown``.
        with self._adding:
            saved, self.cluster._shutdown_at_exit = self.cluster._shutdown_at_exit, False
            try:
                return self.cluster.add_node(num_cpus=NODE_CPUS)
            finally:
                self.cluster._shutdown_at_exit = saved

    def remove(self, node, pids: list[int]) -> None:
        remove_node(self.cluster, node, pids)

    def shutdown(self) -> None:
        self.cluster.shutdown()


@dataclass
class Campaign:
    """The cluster, the store provider and what the faults did (for the report)."""

    nodes: object  # LocalNodes or chaos_hosts.HostNodes
    provider: object  # orchestrator.cluster.store_provider.StoreProvider
    ckpt_dir: Path
    worker_nodes: list = field(default_factory=list)
    injected: list[dict] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)  # checkpoint paths we damaged on purpose
    timers: list[threading.Timer] = field(default_factory=list)
    replacements: list[float] = field(default_factory=list)  # when a replacement node is due
    follow_ups: dict[int, object] = field(default_factory=dict)  # step -> fn(controller) run at its boundary

    def add_node(self, off_main: bool = False):
        node = self.nodes.add_node(off_main=off_main)
        self.worker_nodes.append(node)
        return node

    def node_of(self, controller, actor: int):
        node_id = controller.group.node_ids.get(actor)
        return next((n for n in self.worker_nodes if n.node_id == node_id), None)

    def remove_node(self, controller, node) -> None:
        """A node vanishes: its worker processes die with it, then a replacement joins later."""
        pids = [controller.group.pids[a] for a, n in controller.group.node_ids.items()
                if n == node.node_id and a in controller.group.pids]
        if node in self.worker_nodes:
            self.worker_nodes.remove(node)
            self.nodes.remove(node, pids)
        self.replacements.append(time.time() + REPLACE_AFTER_S)

    def tick(self) -> None:
        """After each recorded step: start the replacement nodes that are due, on a timer thread. A
        node's start-up takes ~2 s, which on a real cluster happens on the new machine; in the
        driver's loop it was charged to the run as driver overhead (7-8 s per campaign)."""
        now = time.time()
        for due in [t for t in self.replacements if t <= now]:
            self.replacements.remove(due)
            self.later(0.0, self.add_node, True)
        if getattr(self.nodes, "exited", lambda: False)():
            # A healed host whose `ray start` exited starts again (as systemd's Restart=always would).
            self.later(0.0, self.nodes.restart_exited)

    def later(self, delay_s: float, fn, *args) -> None:
        timer = threading.Timer(delay_s, fn, args)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def finish(self) -> None:
        for timer in self.timers:
            timer.join()


def _member(controller, rng, *, not_node=None) -> int:
    members = sorted(controller.generation.members.values())
    return rng.choice(members)


def kill_step(c: Campaign, controller, step: int, rng) -> str:
    victim = _member(controller, rng)
    controller.group.call([victim], RankCalls.arm_fault, (step, "kill", 0.0, "forward"), timeout_s=10)
    return f"actor {victim}: SIGKILL after its first forward of step {step}"


def kill_ckpt_write(c: Campaign, controller, step: int, rng) -> str:
    every = controller.cfg.checkpoint.every
    at = ((step + every - 1) // every) * every  # the next step whose checkpoint is written
    victim = _member(controller, rng)
    controller.group.call([victim], RankCalls.arm_fault, (at, "kill", 0.0, "ckpt_write"), timeout_s=10)
    return f"actor {victim}: SIGKILL inside the write of step {at}'s checkpoint shard (or the first save after it)"


def kill_rebuild(c: Campaign, controller, step: int, rng) -> str:
    first, second = rng.sample(sorted(controller.generation.members.values()), 2)
    nxt = controller.generation.number + 1
    controller.group.call([first], RankCalls.arm_fault, (step, "kill", 0.0, "forward"), timeout_s=10)
    controller.group.call([second], RankCalls.arm_fault, (nxt, "kill", 0.0, "join"), timeout_s=10)
    return f"actor {first}: SIGKILL in step {step}; actor {second}: SIGKILL joining generation {nxt}"


def hang(c: Campaign, controller, step: int, rng) -> str:
    victim = _member(controller, rng)
    controller.group.call([victim], RankCalls.arm_fault, (step, "hang", 0.0, "forward"), timeout_s=10)
    return f"actor {victim}: SIGSTOP after its first forward of step {step}"


def node_removal(c: Campaign, controller, step: int, rng) -> str:
    node = c.node_of(controller, _member(controller, rng))
    if node is None:
        return "no worker node hosts a rank: skipped"
    c.remove_node(controller, node)
    return f"node {node.node_id[:8]} removed without notice"


def drain(c: Campaign, controller, step: int, rng) -> str:
    import ray
    from ray.core.generated import autoscaler_pb2

    node = c.node_of(controller, _member(controller, rng))
    if node is None:
        return "no worker node hosts a rank: skipped"
    gcs = ray._raylet.GcsClient(address=c.nodes.address)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = gcs.drain_node(node.node_id, reason, "chaos: preempted",
                                   int((time.time() + DRAIN_DEADLINE_S) * 1000))
    if not accepted:
        return f"drain of node {node.node_id[:8]} refused: {why}"
    c.later(DRAIN_DEADLINE_S, c.remove_node, controller, node)
    return f"node {node.node_id[:8]} drained with {DRAIN_DEADLINE_S:.0f} s notice, removed at the deadline"


def straggler(c: Campaign, controller, step: int, rng) -> str:
    victim = _member(controller, rng)
    steps = controller.cfg.elastic.straggler_steps + 3
    controller.group.call([victim], RankCalls.arm_fault, (step, "sleep", STRAGGLER_SLEEP_S, "step", steps),
                          timeout_s=10)
    return f"actor {victim}: sleeps {STRAGGLER_SLEEP_S} s in each of steps {step}..{step + steps - 1}"


def slow_storage(c: Campaign, controller, step: int, rng) -> str:
    every = controller.cfg.checkpoint.every
    at = ((step + every - 1) // every) * every  # the next step whose checkpoint is written
    victim = _member(controller, rng)
    stall = controller.cfg.elastic.step_timeout_s + 2.0  # longer than the driver waits for a step
    controller.group.call([victim], RankCalls.arm_fault, (at, "sleep", stall, "ckpt_write"), timeout_s=10)

    def fast_again(ctrl, now: int) -> str:
        # A stall of 0 s from this step on: the rank's later saves are not slowed.
        outcome = ctrl.group.call([victim], RankCalls.arm_fault, (now, "sleep", 0.0, "ckpt_write"), timeout_s=10)
        return f"actor {victim}: storage fast again" if outcome.ok else f"actor {victim} gone: {outcome}"

    c.follow_ups[step + SLOW_STORAGE_STEPS] = fast_again
    return (f"actor {victim}: its checkpoint writes from step {at} stall {stall:.0f} s (slow storage), "
            f"until step {step + SLOW_STORAGE_STEPS}")


def partition(c: Campaign, controller, step: int, rng) -> str:
    cut_for = getattr(c.nodes, "cut_for", None)
    node = c.node_of(controller, _member(controller, rng))
    if cut_for is None or node is None:
        return "no namespace host holds a rank: skipped"
    cut_for(node, PARTITION_S)
    return f"host {node.name} (node {node.node_id[:8]}) cut off for {PARTITION_S:.0f} s, then healed"


def store_kill(c: Campaign, controller, step: int, rng) -> str:
    import ray

    if c.provider.handle is None:
        return "no store host: skipped"
    ray.kill(c.provider.handle, no_restart=True)
    # The store is asked for only when a generation forms: make the next one form now.
    victim = _member(controller, rng)
    controller.group.call([victim], RankCalls.arm_fault, (step, "kill", 0.0, "forward"), timeout_s=10)
    return f"store host killed; actor {victim}: SIGKILL in step {step} so a generation forms without it"


def truncate_ckpt(c: Campaign, controller, step: int, rng) -> str:
    from checkpoints.catalog import latest_valid

    info = latest_valid(str(c.ckpt_dir))  # the campaign's own fresh directory: every checkpoint in it is this run's
    if info is None:
        return "no committed checkpoint yet: skipped"
    shards = sorted(p for p in Path(info.dcp_path).iterdir() if p.suffix == ".distcp" and p.stat().st_size > 0)
    victim = rng.choice(shards)
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    c.truncated.append(info.path)
    return f"{victim.name} of step {info.step} cut from {size} to {size // 2} bytes"


KINDS = {f.__name__: f for f in (kill_step, kill_ckpt_write, kill_rebuild, hang, node_removal, drain,
                                  straggler, store_kill, truncate_ckpt, slow_storage, partition)}
FOLLOW_UP_AFTER = {"slow_storage": SLOW_STORAGE_STEPS}  # kind -> steps to its follow-up (a hook step too)
