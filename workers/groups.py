"""One generation's process groups and DeviceMesh for one rank, built from a store prefix and destroyed whole.

As these change size at runtime, nothing may cache a rank, a world size or a group outside the
``ProcessGroups`` object of the current generation: the runtime gets a new one on every rebuild.

Every group is created here with an explicit timeout (``elastic.collective_timeout_s``):
``init_device_mesh`` would create its sub-groups with the backend default (30 min on gloo), so we make
the (dp, pp, tp) groups ourselves with ``new_group`` and wrap them with ``DeviceMesh.from_group``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from orchestrator.mesh import MeshAxis, MeshShape, RankCoords
from workers import sockets

logger = logging.getLogger(__name__)

AXES = (MeshAxis.DP, MeshAxis.PP, MeshAxis.TP)


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding caches before a rebuild.

    DeviceMesh equality ignores the process group and the rank, so after a re-form with the same
    world size and permuted ranks the cached specs still point at the old coordinates and DCP loads
    shards at wrong offsets with no error (cpu-gloo-facts gotcha 6). These are private functions; if a
    torch upgrade removes them we want a loud failure here, not silent corruption, so no try/except.
    """
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


@dataclass
class ProcessGroups:
    """A rank's groups for one generation. ``destroy()`` ends the generation; nothing outlives it."""

    generation: int
    shape: MeshShape
    world_rank: int
    coords: RankCoords
    device: torch.device
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup
    gloo_ports: list[int] = field(default_factory=list)
    destroyed: bool = False

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh[MeshAxis.DP.value]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[MeshAxis.TP.value]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(MeshAxis.PP.value)

    def pp_peer(self, pp_index: int) -> int:
        """World rank of the rank with my dp/tp coordinates at pipeline position ``pp_index``."""
        return self.shape.rank_of(self.coords.dp, pp_index, self.coords.tp)

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken generation may fail to tear down; the next one is fresh
            logger.warning("gen=%d destroy_process_group failed: %s", self.generation, exc)


def build_process_groups(
    *,
    store_addr: str,
    store_port: int,
    generation: int,
    shape: MeshShape,
    world_rank: int,
    timeout_s: float,
    device: torch.device,
    store_prefix: str | None = None,
) -> ProcessGroups:
    """Join generation ``generation``: default group, dp/pp/tp groups, a checkpoint group, the mesh."""
    clear_dtensor_caches()
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    listeners_before = sockets.listening_ports()
    base = dist.TCPStore(store_addr, store_port, is_master=False, timeout=timeout)
    # A fresh prefix per generation: group names restart at 0 after destroy_process_group, so a
    # reused prefix would meet the previous generation's keys (gotcha 5).
    store = dist.PrefixStore(store_prefix or f"gen{generation}", base)
    dist.init_process_group(
        backend, store=store, rank=world_rank, world_size=shape.world, timeout=timeout
    )
    groups: list[dist.ProcessGroup] = []
    for axis in AXES:
        mine = None
        # Every rank must call new_group for every group, in the same order.
        for members in shape.group_ranks(axis):
            group = dist.new_group(members, timeout=timeout, backend=backend)
            if world_rank in members:
                mine = group
        groups.append(mine)
    # Async DCP saves must not share the training groups (gotcha 9): gloo, the whole world.
    ckpt_group = dist.new_group(list(range(shape.world)), timeout=timeout, backend="gloo")
    layout = torch.arange(shape.world).view(shape.dp, shape.pp, shape.tp)
    mesh = DeviceMesh.from_group(
        groups, device.type, mesh=layout, mesh_dim_names=tuple(a.value for a in AXES)
    )
    ports = sorted(sockets.listening_ports() - listeners_before)
    return ProcessGroups(
        generation=generation,
        shape=shape,
        world_rank=world_rank,
        coords=shape.coords(world_rank),
        device=device,
        mesh=mesh,
        ckpt_group=ckpt_group,
        gloo_ports=ports,
    )
