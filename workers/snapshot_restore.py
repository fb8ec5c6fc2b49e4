"""How a new generation's rank restores an in-memory snapshot set: by copies when the old chunks
cover its pieces, else resharded through DCP (worker side; Ray for the reads; docs/design.md,
In-memory snapshots).

Every member of the generation calls ``restore_snapshot`` collectively (``RankActor.load_snapshot``).
First each rank looks for an old rank whose snapshot holds each of its tensors as exactly one chunk
(``checkpoints.direct_load.plan_direct``): among the snapshots of the set in its own store first — with
the backup ring and the placement, a survivor usually holds the shard of its new slot, its own or
the one it backed up — then among the others, whose metadata it reads from their providers. With
none (a changed dp size), it assembles each piece from the overlapping old chunks of every old rank
(``plan_assembled``). One all-reduce on the checkpoint group then tells every rank whether all of
them found a plan: if so each copies its pieces into place (read from its own store, or in one
request per old rank from its provider) and no DCP planning, collective or optimizer initialisation
runs; if any did not, every rank loads through
DCP (``RankRuntime._load`` with a ``checkpoints.memory.RemoteReader``: the new rank 0 reads every
old rank's metadata and broadcasts it, each rank's DCP reads fetch just its slices), since DCP's load
is a collective all ranks enter together. The ``RestoreAck`` says which (``direct``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshspeak.messages import RestoreAck, RestoreSource, SnapKey
from workers.snapshot_push import Providers, fetch_metadata, fetch_pieces, providers_of
from workers.snapshots import SnapshotStore

if TYPE_CHECKING:
    from checkpoints.direct_load import DirectPlan

# ``runtime`` below is the generation's ``workers.runtime.RankRuntime`` (which calls in here: not
# imported, not even for typing, so that the two stay out of an import cycle).

logger = logging.getLogger(__name__)


def restore_snapshot(runtime, source: RestoreSource, store: SnapshotStore, actor_id: int,
                     asked: dict[int, object] | None = None) -> RestoreAck:
    """Load snapshot set ``source.key`` into ``runtime``'s generation, collectively (see the module
    docstring); the ack with the step loaded, the bytes fetched from other actors and the path taken.
    ``asked``: old ranks' metadata asked for as this rank joined (``snapshot_push.ask_metadata``)."""
    t0 = time.perf_counter()
    runtime._finish_checkpoint_write()  # before the checkpoint group's collectives (the vote, DCP's)
    key = tuple(source.key)
    providers = providers_of(source)
    plan = direct_plan(runtime, key, providers, store, actor_id, asked)
    t_plan = time.perf_counter()
    direct = everyone(plan is not None, runtime.groups.ckpt_group, runtime.groups.shape.world)
    if direct:
        step, fetched = _load_direct(runtime, plan, key, providers, store, actor_id)
    else:
        step, fetched = _load_resharded(runtime, key, providers, store, actor_id)
    how = ("resharded through DCP" if not direct else f"in place from old rank {plan.owner}"
           if plan.owner is not None else f"assembled from old ranks {sorted(plan.by_owner())}")
    logger.info("loaded snapshot of step %d %s in %.3f s: plan %.3f, load %.3f (%d bytes fetched)", key[2],
                how, time.perf_counter() - t0, t_plan - t0, time.perf_counter() - t_plan, fetched)
    return RestoreAck(step=step, fetched_bytes=fetched, shard_bytes=runtime.local_state_bytes(), direct=direct)


def direct_plan(runtime, key: SnapKey, providers: Providers, store: SnapshotStore,
                actor_id: int, asked: dict[int, object] | None = None) -> DirectPlan | None:
    """The load of this rank's state by copies, or None (DCP then): in place from one old rank's
    snapshot when its layout is this rank's — the old rank of this rank's number first, those this
    actor holds before those it would read from another — else assembled from every old rank's
    chunks (a changed dp size), the chunks this actor holds read before others' copies of them."""
    from checkpoints.direct_load import local_state, plan_assembled, plan_direct

    local, me = local_state(runtime.model_parts(), runtime.optimizers), runtime.groups.world_rank
    here = sorted((owner for owner in providers if store.holds(key, owner)), key=lambda owner: (owner != me, owner))
    metadatas = {}
    for owner in here:
        metadatas[owner] = store.find(key, owner).metadata
        plan = plan_direct(local, metadatas[owner], owner)
        if plan is not None:
            return plan
    remote = sorted((owner for owner in providers if owner not in here), key=lambda owner: (owner != me, owner))
    for owner, metadata in zip(remote, fetch_metadata(store, key, providers, actor_id, remote, asked) if remote else [],
                               strict=True):
        metadatas[owner] = metadata
        plan = plan_direct(local, metadata, owner)
        if plan is not None:
            return plan
    return plan_assembled(local, metadatas)


def everyone(yes: bool, group: dist.ProcessGroup, world: int) -> bool:
    """Whether ``yes`` holds on every rank of ``group`` (one all-reduce; no collective alone)."""
    if world == 1:
        return yes
    flag = torch.tensor([1 if yes else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _load_direct(runtime, plan: DirectPlan, key: SnapKey, providers: Providers,
                 store: SnapshotStore, actor_id: int) -> tuple[int, int]:
    """Copy ``plan``'s pieces into place: read in this actor's store, or in one request per old rank
    from its provider. (step loaded, bytes fetched from another actor)."""
    pieces, remote, fetched = {}, {}, 0
    for owner, requests in plan.by_owner().items():
        if store.holds(key, owner):
            held = store.find(key, owner)
            pieces.update({r: held.view(*r[1:]) for r in requests})
        else:
            remote[owner] = requests
    got = fetch_pieces(store, key, providers, actor_id,
                       {owner: [r[1:] for r in requests] for owner, requests in remote.items()}) if remote else {}
    for owner, requests in remote.items():
        pieces.update(zip(requests, got[owner], strict=True))
        fetched += sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else len(p)
                       for p in {id(p): p for p in got[owner]}.values())
    step = runtime._loaded(plan.install(pieces))
    if plan.metadata is not None:  # this rank's takes lay out as the plan placed its pieces
        runtime.plan_snapshots_from(plan.metadata)
    return step, fetched



def _load_resharded(runtime, key: SnapKey, providers: Providers, store: SnapshotStore,
                    actor_id: int) -> tuple[int, int]:
    """The DCP load: the new rank 0 reads every old rank's metadata and broadcasts the list; each
    rank's DCP reads then ask the providers for their slices. (step loaded, bytes fetched)."""
    from checkpoints.memory import RemoteReader

    groups = runtime.groups
    metas = [fetch_metadata(store, key, providers, actor_id) if groups.world_rank == 0 else None]
    if groups.shape.world > 1:
        dist.broadcast_object_list(metas, src=0, group=groups.ckpt_group)
    # The reader numbers the snapshots by their place in ``metas`` (old-rank order); the providers may
    # give fewer old ranks than the old world had (replicas standing in for each other).
    owners = sorted(providers)

    def fetch(wanted: dict[int, list]) -> dict[int, list]:
        got = fetch_pieces(store, key, providers, actor_id, {owners[place]: reqs for place, reqs in wanted.items()})
        return {place: got[owners[place]] for place in wanted}

    reader = RemoteReader(metas[0], key[2], fetch)
    step = runtime._load(f"in-memory snapshot of step {key[2]}", reader)
    return step, reader.fetched_bytes
