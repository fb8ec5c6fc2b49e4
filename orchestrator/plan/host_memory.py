"""Host memory a rank's copies of its state take, and the launch check against the nodes' memory
(pure: no Ray, no torch; ``elastimesh plan`` prints it, ``orchestrator/launch.py`` checks it). The
per-rank estimates come in as data (``mesh_plan.rank_memory``'s, per pipeline position).

A rank's *state* here is what a snapshot or a checkpoint holds of it: its fp32 parameter shard and
the two Adam moments (``rank_memory``'s grads + optimizer). In-memory snapshots (on by default with
``checkpoint.dir``) and the background checkpoint write keep several copies of it in host RAM,
whatever the device; each is counted in ``host_copies``, with where it comes from. On a CPU device
the rank's training state itself (parameters, gradients, moments, activations) is host memory too.

Ray places ranks by CPU and GPU slots, not by memory, so launch assumes a node may be given as many
ranks as its slots hold (up to the mesh's world) and refuses a mesh whose ranks there would need
more than the node's memory (Ray's ``memory`` plus ``object_store_memory`` resources: the RAM Ray
was given on it), before any rank is placed: exit 2, one line naming ``checkpoint.memory_keep`` and
the other fixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshspeak.sections import JobConfig
from orchestrator.errors import UserInputError

# pp position -> ``orchestrator.plan.mesh_plan.rank_memory``'s estimate there (what describe() lists)
MemoryPerRank = Mapping[int, Mapping[str, int]]


def host_copies(cfg: JobConfig) -> dict[str, int]:
    """Copies of a rank's state in host memory at the worst moment of steady training, by source.

    * ``own`` (``checkpoint.memory_keep``): the snapshot taker's reused buffer sets, one per own
      snapshot kept (``checkpoints/snapshot_taker.py``, ``workers/snapshots.py`` ``slot_for``); each
      set is allocated at its first use and kept for the generation.
    * ``first_take`` (1): a generation's first take goes through ``dcp.save`` into fresh memory
      (``checkpoints/memory.py`` ``MemoryWriter``), not a buffer set; it stays an own snapshot until
      newer ones push it out of retention, while the buffer sets fill.
    * ``held`` (``memory_keep``): the copies of the peer's snapshots this rank holds
      (``SnapshotStore.keep``; the backup ring gives each rank one peer), its buffers reused.
    * ``in_flight`` (2): a push's bytes in Ray's object store while the holder copies them
      (``workers/snapshot_push.py``): the pusher's node, and the holder's when it pulled them from
      another node.
    * ``staging`` (1, ``checkpoint.async``): the background checkpoint write's staging buffers
      (``checkpoints/staging.py``: DCP's ``DefaultStager`` keeps one CPU copy and reuses it).

    Not counted: after a re-form the old generation's kept set stays until the new one completed a
    set of its own (a restore loads from it), so for those few steps up to ``memory_keep`` more held
    copies of the old ring's peer may live beside the new ones.
    """
    ck = cfg.checkpoint
    copies: dict[str, int] = {}
    if ck.dir and ck.memory_every > 0:
        copies.update(own=ck.memory_keep, first_take=1, held=ck.memory_keep, in_flight=2)
    if ck.dir and ck.async_write:
        copies["staging"] = 1
    return copies


def state_bytes(mem: Mapping[str, int]) -> int:
    """A rank's state from its ``rank_memory`` estimate: fp32 parameter shard + two Adam moments
    (the grads are the fp32 shard's size)."""
    return mem["grads"] + mem["optimizer"]


def host_bytes_per_rank(cfg: JobConfig, memory: MemoryPerRank, *, on_cpu: bool = False) -> dict[int, int]:
    """Host bytes per rank at each pipeline position: its own copies of its state, the held and
    in-flight copies of its peer's (sized as the mesh's largest state: the ring's peer may sit at any
    pipeline position) and, ``on_cpu``, the rank's training state itself."""
    copies = host_copies(cfg)
    largest = max(state_bytes(mem) for mem in memory.values())
    peer = copies.get("held", 0) + copies.get("in_flight", 0)
    out = {}
    for p, mem in memory.items():
        total = (sum(copies.values()) - peer) * state_bytes(mem) + peer * largest
        if on_cpu:
            total += mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
        out[p] = total
    return out


@dataclass(frozen=True)
class NodeRoom:
    """One Ray node as launch sees it: id, the memory Ray was given there, ranks it can hold."""

    node_id: str
    memory_bytes: int
    rank_slots: int


def node_rooms(nodes: Iterable[tuple[str, Mapping[str, float]]], bundle: Mapping[str, float]) -> list[NodeRoom]:
    """``nodes``: (Ray node id, its total resources) of the alive nodes; ``bundle``: one rank's."""
    rooms = []
    for node_id, res in nodes:
        amounts = [int(res.get(k, 0.0) // v) for k, v in bundle.items() if v > 0]
        slots = min(amounts) if amounts else 1 << 30  # a rank asking for nothing fits anywhere
        memory = int(res.get("memory", 0.0) + res.get("object_store_memory", 0.0))
        rooms.append(NodeRoom(node_id, memory, slots))
    return rooms


def check_node_memory(cfg: JobConfig, world: int, memory: MemoryPerRank, rooms: Iterable[NodeRoom], *,
                      on_cpu: bool) -> None:
    """Refuse (``UserInputError``: exit 2, one line) a mesh whose snapshot and staging copies would
    take a node past its memory with as many ranks there as its slots hold. No copies: no check
    (the training state alone is the device's and the user's estimate to make)."""
    copies = host_copies(cfg)
    if not copies:
        return
    per_rank = max(host_bytes_per_rank(cfg, memory, on_cpu=on_cpu).values())
    largest = max(state_bytes(mem) for mem in memory.values())
    for room in rooms:
        ranks = min(world, room.rank_slots)
        need = ranks * per_rank
        if ranks and room.memory_bytes and need > room.memory_bytes:
            raise UserInputError(
                f"checkpoint.memory_keep={cfg.checkpoint.memory_keep}: {ranks} ranks on Ray node "
                f"{room.node_id[:12]} would need {_gib(need)} of host memory ({sum(copies.values())} copies of "
                f"a rank's {_gib(largest)} state each: {_listed(copies)}"
                + ("; plus the training state on CPU" if on_cpu else "")
                + f") but the node has {_gib(room.memory_bytes)} (Ray memory + object store); lower "
                "checkpoint.memory_keep (>= 2), set checkpoint.memory_every=0 (no in-memory snapshots), "
                "or raise resources.cpus_per_worker to place fewer ranks per node (`elastimesh plan` "
                "shows the copies)")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _listed(copies: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in copies.items())
