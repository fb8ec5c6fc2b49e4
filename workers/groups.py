"""One generation's process groups and DeviceMesh for one rank, built from a store prefix and destroyed whole.

Worker side: ``RankGroups`` is one rank's share of a generation (the driver's record of the whole
generation is ``orchestrator.control.generation.GenerationRecord``; the instruction to join it is a
``messages.JoinSpec``). As these change size at runtime, nothing may cache a rank, a world size or a
group outside the ``RankGroups`` object of the current generation: the runtime gets a new one on
every rebuild.

Every group is created here with an explicit timeout (``elastic.collective_timeout_s``):
``init_device_mesh`` would create its sub-groups with the backend default (30 min on gloo), so we make
the (dp, pp, tp) groups ourselves with ``new_group`` and wrap them with ``DeviceMesh.from_group``.
The mesh's axis names are unique per generation (``_axis_names``): DTensor's caches must never see
an earlier generation's mesh as equal to the current one.

Formation that scales with the world (docs/design.md, Generations): a rank makes only the groups it is
a member of (``new_group(..., use_local_synchronization=True)``: members meet under a key derived from
their ranks, non-members never call), not every group of the world. (``split_group``, the other way to
cut sub-groups, is unusable on CPU: F6.) gloo still connects every pair of a group's members when the
group is made. Lazily made pairs (``TORCH_GLOO_LAZY_INIT``) would cut a
rank's connections to the few its algorithms use, but the kick frees a generation by shutting down the
connections that exist: a pair made after it (a DCP collective on the checkpoint group's writer
thread, after a peer died mid-write) worked on, and a survivor then blocked in its next collective
until the timeout, once per collective (bench/chaos.py: a 140 s recovery), so pairs connect eagerly —
except the default group's: the whole-generation reductions (the grad norm, fp16's overflow decision)
go over the tp, pp and dp groups in turn (``RankGroups.world_axes``), nothing else uses the default
group, so it is made lazily and never connects. The one whole-world gloo group left is DCP's, which
needs it.

The backend follows the device (``workers.device``): NCCL on CUDA (the rank's GPU is the current
device), gloo on the CPU. Checkpoint collectives always run on a gloo group of their own. Freeing
a rank blocked on a dead peer differs per backend: gloo's blocked ops ignore ``abort()``, so the
driver's kick shuts down this generation's gloo sockets (``workers.sockets``); NCCL's communicators
are aborted (``abort_nccl``), and NCCL's own sockets (bootstrap, proxy) are never touched: only the
checkpoint group's gloo listeners are reported as ``gloo_ports`` on an NCCL job.

NCCL communicators are made lazily (no ``device_id`` in ``init_process_group``), so that every one of
them can be aborted while it is being made. With ``device_id`` torch creates the default group's
communicator eagerly, inside ``init_process_group`` (``_new_process_group_helper`` calls
``eager_connect_single_device`` before ``_update_default_pg`` registers the group), and the
subgroups by ``ncclCommSplit`` inside ``new_group``: a rank whose peer dies then blocks in a group
that is not registered yet, which ``_abort_process_group`` cannot reach (``dist.is_initialized()``
is still False). Lazily, the groups are all registered before any communicator exists; each is
made at its first collective, in NCCL's nonblocking mode (``workers.device.NCCL_ENV``): the
communicator enters ``ProcessGroupNCCL``'s ``inInitializationCommMap_`` as soon as its creation
starts, and ``ProcessGroupNCCL::abort`` aborts that map's communicators too (in blocking mode the
creation call does not return until every rank joined, and the communicator is in no map yet).
The NCCL id a new communicator needs comes through the store: the kick shuts that connection
down on NCCL (``RankActor.kick``). torchft does the same (lazy, no eager connect).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# Private, documented in its docstring for this use ("when users want to use a different timeout"),
# since torch 2.3; gloo and NCCL both honour it for the collectives issued after it.
from torch.distributed.distributed_c10d import _set_pg_timeout

from meshspeak.mesh import MeshAxis, MeshShape, RankCoords, hsdp_group_ranks
from workers import sockets
from workers.bind import bound_groups, nccl_interface
from workers.device import apply_nccl_env, backend_for
from workers.reach import check_store, peer_unreachable

logger = logging.getLogger(__name__)

AXES = (MeshAxis.DP, MeshAxis.PP, MeshAxis.TP)
# HSDP (RankGroups.replicate > 1) splits dp into (replicate, shard) mesh axes; the shard axis keeps
# the name "dp", and the flattened dp group is made separately (``RankGroups.dp_group``).
DP_REPLICATE = "dp_replicate"
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def clear_dtensor_caches() -> None:
    """Drop DTensor's cached sharding decisions made for earlier generations' meshes (hygiene).

    Not what keeps rebuilds correct — that is ``_axis_names`` — because it cannot reach every cache:
    the sharding-propagation caches are per thread (the Python one is a ``threading.local`` LRU; the
    C++ fast-path one behaves so too: clearing both on every thread fixed the shrink-grow-shrink test,
    clearing them here did not), and Ray runs an actor's calls on a pool of threads, so this clears
    only the joining thread's. It does clear the process-wide redistribute caches, which otherwise keep
    every old mesh (and through it its process groups) alive. Private functions: if a torch upgrade
    removes them we want a loud failure here, so no try/except.
    """
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()


_meshes_built = itertools.count()


def _axis_names(tag: str) -> dict[str, str]:
    """Mesh axis names no earlier mesh of this process had, e.g. ``dp@3fa2c1e0-gen3#2``.

    Why: ``DeviceMesh`` equality (and hash) compares the rank layout and the axis names but not the
    process group or this rank's coordinate, and DTensor's caches key on it. After a re-form with
    the same world size and permuted ranks (shrink, then grow with a replacement), a cache entry made
    for the old mesh matches the new one and hands back a spec bound to the *old* mesh object, so
    this rank computes shard offsets from its old coordinate: DCP saves then fail ("invalid fill" in
    the global plan) or, worse, loads and optimizer states land at wrong offsets with no error
    (docs/design.md, Generations and F5; tests/ray/test_elastic_resize.py). Clearing the caches is not enough
    (see ``clear_dtensor_caches``); names unique per process make every old entry unreachable.
    """
    count = next(_meshes_built)
    return {a: f"{a}@{tag}#{count}" for a in (DP_REPLICATE, *AXES)}


def _restart_group_names() -> None:
    """Make this rank's first group of the generation get the name "0" again, like every peer's.

    Group names are a process-wide counter and they are part of the store keys of each group's
    rendezvous. ``destroy_process_group`` resets the counter, but an ``init_process_group`` that
    failed half-way (a peer died or the driver kicked us mid-rendezvous) leaves it advanced with no
    default group to destroy; the next generation would then wait for peers under other keys until
    the store timeout. The counter is private (``_world.group_count``); an upgrade that moves it
    must fail here loudly.
    """
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        c10d._world.group_count = 0


@dataclass
class RankGroups:
    """Worker side: one rank's process groups and DeviceMesh for one generation (built from a
    ``JoinSpec`` by ``build_process_groups``). ``destroy()`` ends the generation; nothing outlives it."""

    generation: int
    shape: MeshShape
    world_rank: int
    coords: RankCoords
    device: torch.device
    mesh: DeviceMesh
    ckpt_group: dist.ProcessGroup
    axis_names: dict[str, str]  # generation-unique mesh axis names (see _axis_names)
    gloo_ports: list[int] = field(default_factory=list)
    backend: str = "gloo"  # of the training groups; checkpoints always use gloo
    destroyed: bool = False
    replicate: int = 1  # HSDP replica groups (RuntimeSpec.dp.replicate); 1 = a 1-D dp axis
    flat_dp_group: dist.ProcessGroup | None = None  # all dp ranks, made only when replicate > 1
    bind_ip: str | None = None  # the address gloo binds to (Ray's node address: workers/bind.py); None: gloo's choice
    timeout_s: float = 0.0  # the training groups' own timeout (elastic.collective_timeout_s)
    further: list[tuple[dist.ProcessGroup, float]] = field(default_factory=list)  # new_group's, with their timeouts

    @property
    def dp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards over: the 1-D dp axis, or under HSDP the 2-D (replicate, shard) axes."""
        if self.replicate > 1:
            return self.mesh[(self.axis_names[DP_REPLICATE], self.axis_names[MeshAxis.DP])]
        return self.mesh[self.axis_names[MeshAxis.DP]]

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The dp shard axis alone (one rank under ZeRO-0): what FSDP2 shards over when the dp
        all-reduce is ours (``workers.compression``, PowerSGD)."""
        return self.mesh[self.axis_names[MeshAxis.DP]]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Every dp rank with my pp/tp coordinates (for reductions over the whole data-parallel axis)."""
        if self.flat_dp_group is not None:
            return self.flat_dp_group
        return self.mesh.get_group(self.axis_names[MeshAxis.DP])

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[self.axis_names[MeshAxis.TP]]

    @property
    def world_group(self) -> dist.ProcessGroup:
        """Every rank of this generation (the default group, which ``destroy`` ends). On gloo it
        connects lazily and nothing in training uses it: reductions over the whole generation go
        over ``world_axes`` (module docstring)."""
        return dist.group.WORLD

    @property
    def world_axes(self) -> tuple[dist.ProcessGroup, ...]:
        """The tp, pp and dp groups of this rank: an all-reduce over each in turn covers every rank of
        the generation once (the mesh is their grid), on connections training already made
        (``workers.optim.reduce_over_world``: the grad norm, fp16's overflow decision)."""
        return (self.mesh.get_group(self.axis_names[MeshAxis.TP]), self.pp_group, self.dp_group)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.axis_names[MeshAxis.PP])

    def new_group(self, ranks: list[int], backend: str, timeout_s: float) -> dist.ProcessGroup:
        """A further group of this generation (``new_group`` over the whole world: every rank calls it),
        bound as the others are, with its gloo listeners added to ``gloo_ports`` so that a kick frees a
        rank blocked in it (the pipeline-tied embedding's pairs: workers/tied.py). Made while the
        generation forms, before the actor reports its listeners to the driver."""
        before = sockets.listening_ports() if backend == "gloo" else set()
        with bound_groups(self.bind_ip):
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), backend=backend)
        if backend == "gloo":
            self.gloo_ports = sorted(set(self.gloo_ports) | (sockets.listening_ports() - before))
        self.further.append((group, timeout_s))
        return group

    @contextmanager
    def collective_timeout(self, seconds: float) -> Iterator[None]:
        """The training groups (the mesh's axes, HSDP's flat dp group, ``new_group``'s) wait up to
        ``seconds`` in a collective while inside, then their own timeouts again. For a step in which a
        peer may spend minutes compiling (``train.compile``: workers/compile_stats.py): its peers wait for
        it in their first collective, and that wait is work, not a failure. A peer that dies meanwhile
        is still found by the driver's liveness probes, which free the survivors (a kick) long before."""
        mesh_groups = [self.mesh.get_group(name) for name in self.mesh.mesh_dim_names]
        own = [(group, self.timeout_s) for group in mesh_groups]
        if self.flat_dp_group is not None:
            own.append((self.flat_dp_group, self.timeout_s))
        own += self.further
        for group, _ in own:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        try:
            yield
        finally:
            if not self.destroyed and dist.is_initialized():
                for group, timeout_s in own:
                    _set_pg_timeout(timedelta(seconds=timeout_s), group)

    def pp_peer(self, pp_index: int) -> int:
        """World rank of the rank with my dp/tp coordinates at pipeline position ``pp_index``."""
        return self.shape.rank_of(self.coords.dp, pp_index, self.coords.tp)

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        if not dist.is_initialized():  # aborted by a kick (abort_nccl): nothing left to tear down
            return
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
    replicate: int = 1,
    store_secret: str = "",
    bind_ip: str | None = None,
    sockets_before: sockets.Table | None = None,
) -> RankGroups:
    """Join generation ``generation``: default group, dp/pp/tp groups, a checkpoint group, the mesh.

    ``replicate`` > 1 (HSDP, and ZeRO-0 with replicate = dp) splits the dp axis into (replicate,
    shard) axes of one 4-D mesh: FSDP2 needs its 2-D dp mesh and the TP mesh sliced from the same
    root mesh; the flattened dp group is made beside it. ``bind_ip``: the address this rank's groups
    listen on and advertise (Ray's node address: workers/bind.py); None leaves it to gloo (the host
    name's address). A store or a peer this rank cannot connect to ends the join with one line
    (``workers.reach``). ``sockets_before``: this process's sockets read just before (the caller's
    scan, so as not to take another).
    """
    prefix = store_prefix or f"gen{generation}"
    backend = _prepare_process(device, bind_ip)
    where = f"a rank on {bind_ip}" if bind_ip else f"rank {world_rank}"
    check_store(store_addr, store_port, where)
    before = sockets.listening_ports() if sockets_before is None else sockets_before.ports
    made = _rendezvous(store_addr, store_port, prefix, store_secret, shape, world_rank,
                       timedelta(seconds=timeout_s), backend, replicate, bind_ip, where, generation, before)
    after = sockets.table()
    ports = sorted(after.ports - made.listeners_before)
    _check_bound(after.listeners(ports), bind_ip, backend)
    names = _axis_names(prefix)
    return RankGroups(
        generation=generation,
        shape=shape,
        world_rank=world_rank,
        coords=shape.coords(world_rank),
        device=device,
        mesh=_device_mesh(made.mesh_groups, shape, replicate, names, device),
        ckpt_group=made.ckpt_group,
        axis_names=names,
        gloo_ports=ports,
        backend=backend,
        replicate=replicate,
        flat_dp_group=made.flat_dp,
        bind_ip=bind_ip,
        timeout_s=timeout_s,
    )


def _prepare_process(device: torch.device, bind_ip: str | None) -> str:
    """What this process needs before a generation's rendezvous: no earlier generation's DTensor
    caches or group names, NCCL's interface and environment on a GPU, gloo's pairs eager (see the
    module docstring). The training groups' backend."""
    clear_dtensor_caches()
    _restart_group_names()
    backend = backend_for(device)
    if backend == "nccl":
        nccl_interface(bind_ip)
        apply_nccl_env()
    os.environ.pop(GLOO_LAZY_INIT, None)  # eager pairs (see the module docstring); read per group
    return backend


def _rendezvous(store_addr: str, store_port: int, prefix: str, store_secret: str, shape: MeshShape,
                world_rank: int, timeout: timedelta, backend: str, replicate: int, bind_ip: str | None,
                where: str, generation: int, listeners_before: set[int]) -> _MadeGroups:
    """Meet the generation's peers and make this rank's groups (``_make_groups``), bound to
    ``bind_ip``; the ports listening beyond ``made.listeners_before`` after it are the ones they
    opened, which the kick shuts down. On failure nothing is left behind, and a peer this rank cannot
    reach is said in one line (``workers.reach``)."""
    try:
        with bound_groups(bind_ip):
            return _make_groups(store_addr, store_port, prefix, store_secret, shape, world_rank, timeout,
                                backend, replicate, listeners_before)
    except BaseException as exc:
        # A peer died (or the driver kicked us) mid-rendezvous: leave no default group behind, or
        # the next generation's init_process_group would fail with "initialize twice".
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as cleanup:
                logger.warning("gen=%d cleanup after a failed rendezvous: %s", generation, cleanup)
        unreachable = peer_unreachable(exc, where, bind_ip) if isinstance(exc, Exception) else None
        if unreachable is not None:
            raise unreachable from exc
        raise


def _device_mesh(mesh_groups: list[dist.ProcessGroup], shape: MeshShape, replicate: int, names: dict[str, str],
                 device: torch.device) -> DeviceMesh:
    """The generation's DeviceMesh over the groups already made (``DeviceMesh.from_group``: no group of
    its own, so every group keeps the explicit timeout): (dp, pp, tp), or under HSDP (replicate,
    dp shard, pp, tp), its axes named uniquely for this generation (``_axis_names``)."""
    if replicate > 1:
        layout = torch.arange(shape.world).view(replicate, shape.dp // replicate, shape.pp, shape.tp)
        dims = (DP_REPLICATE, *AXES)
    else:
        layout = torch.arange(shape.world).view(shape.dp, shape.pp, shape.tp)
        dims = AXES
    return DeviceMesh.from_group(mesh_groups, device.type, mesh=layout, mesh_dim_names=tuple(names[a] for a in dims))


@dataclass
class _MadeGroups:
    """What ``_make_groups`` made for one rank of a generation."""

    mesh_groups: list[dist.ProcessGroup]  # one per mesh axis, in the mesh's order
    flat_dp: dist.ProcessGroup | None  # all dp ranks, made only when replicate > 1
    ckpt_group: dist.ProcessGroup
    listeners_before: set[int]  # the listening ports before the ones to record for the kick


def _make_groups(store_addr: str, store_port: int, prefix: str, store_secret: str, shape: MeshShape,
                 world_rank: int, timeout: timedelta, backend: str, replicate: int,
                 listeners_before: set[int]) -> _MadeGroups:
    """This rank's groups of the generation (``build_process_groups``): the default group, its own
    axis groups (and under HSDP the flat dp group), the checkpoint group."""
    nccl = backend == "nccl"
    base = dist.TCPStore(store_addr, store_port, is_master=False, timeout=timeout)
    # A fresh prefix per generation: group names restart at 0 after destroy_process_group, so a
    # reused prefix would meet the previous generation's keys (docs/design.md, F4).
    # The run's secret goes in front of every key (messages.JoinSpec; README, Trust boundary).
    store = dist.PrefixStore(f"{store_secret}-{prefix}" if store_secret else prefix, base)
    # No device_id, on NCCL too: lazy communicators, each abortable (module docstring). On gloo
    # the default group connects lazily: nothing uses it (``world_axes``), so it never connects,
    # and no pair of it can outlive a kick. The groups below connect eagerly.
    if not nccl:
        os.environ[GLOO_LAZY_INIT] = "1"
    try:
        dist.init_process_group(backend, store=store, rank=world_rank, world_size=shape.world, timeout=timeout)
    finally:
        os.environ.pop(GLOO_LAZY_INIT, None)
    axis_members = [shape.group_ranks(axis) for axis in AXES]
    if replicate > 1:
        rep, shard = hsdp_group_ranks(shape, replicate)
        axis_members = [rep, shard, *axis_members[1:], axis_members[0]]  # the last: flat dp
    # Only this rank's own groups: their members meet by their ranks (see the module docstring).
    groups = [dist.new_group(next(m for m in members_of_axis if world_rank in m), timeout=timeout,
                             backend=backend, use_local_synchronization=True)
              for members_of_axis in axis_members]
    flat_dp = groups.pop() if replicate > 1 else None
    # Async DCP saves must not share the training groups (docs/design.md, F9): gloo, the whole world.
    # On NCCL only this group's listeners are gloo's, so only they are recorded for the kick.
    if nccl:
        listeners_before = sockets.listening_ports()
    ckpt_group = dist.new_group(list(range(shape.world)), timeout=timeout, backend="gloo",
                                use_local_synchronization=True)
    return _MadeGroups(groups, flat_dp, ckpt_group, listeners_before)


def _check_bound(listeners: tuple[tuple[str, int], ...], bind_ip: str | None, backend: str) -> None:
    """Warn when gloo's ``listeners`` (address, port) are not on ``bind_ip`` (the interface holds other
    addresses first: gloo takes the interface's first one); peers may then fail to connect, with the
    line ``workers.reach`` gives."""
    if not bind_ip or not listeners:
        return
    bound = {ip for ip, _ in listeners}
    if bound and bound != {bind_ip.split("%")[0]}:
        logger.warning("gloo (%s groups) listens on %s, not on Ray's node address %s: set GLOO_SOCKET_IFNAME "
                       "if peers cannot connect", backend, sorted(bound), bind_ip)


def abort_nccl() -> bool:
    """Abort every NCCL communicator of this process's generation (from any thread); True if any.

    The kick for NCCL: ops blocked on a dead peer (kernels spinning on the GPU, a host waiting on
    them) end with an error at once instead of at the timeout. ``_abort_process_group`` (private,
    documented as experimental; an upgrade that drops it must fail here loudly) aborts all groups
    inside one ncclGroupStart/End, so one communicator's abort cannot wait on another's
    (pytorch#119797), and it deinitialises torch.distributed, so ``RankGroups.destroy`` then has
    nothing left to do. Runs while the training thread may be inside the generation's ops: they raise.
    """
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return False
    c10d._abort_process_group()
    return True
