"""Run a function on ``n`` local gloo ranks, in ``testbed.rank_pool``'s processes (the one rank spawner).

* :func:`run_world`: ``fn(rank, world_size, *args)`` with the default process group already formed
  (gloo, the whole world) and destroyed afterwards: for tests of torch.distributed pieces (DCP
  resharding, FSDP2/TP layouts) that need no ``RankRuntime``.
* :func:`run_ranks`: ``fn(rank, store_port, *args)``, each rank forming its own groups through a
  ``TCPStore`` made for this call (``build_process_groups`` + ``RankRuntime``, as a rank actor does):
  for the benchmarks that measure one rank's runtime (bench/zero3_memory.py, checkpoint_stall.py).

Both run on the shared pool, as ``testbed.world.run_mesh`` does: results come back by rank; a rank
that raises, dies or overruns ``timeout`` ends the run with :class:`MeshRunError` carrying every
failed rank's traceback, and the pool is killed (a peer may be blocked in a collective), so a failure
never hangs and the next run starts fresh processes. ``fn`` and ``args`` must be picklable (``fn`` a
module-level function).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from testbed.rank_pool import MeshRunError, is_shared, shared_pool, shutdown_pool

__all__ = ["MeshRunError", "run_ranks", "run_world"]

STORE_TIMEOUT = timedelta(seconds=60)


@dataclass(frozen=True)
class _WorldJob:
    """A pool job: join the default group under a prefix of its own, run ``fn``, leave the group."""

    fn: Callable[..., Any]
    args: tuple
    world: int

    def __call__(self, rank: int, store_port: int, generation: int) -> Any:
        import torch.distributed as dist

        from workers.groups import clear_dtensor_caches

        # The pool's processes outlive a world. DTensor caches sharding decisions per mesh, and a mesh
        # equals an earlier world's one with the same shape and axis names ("dp", "tp"), so a cached
        # decision would hand back the old mesh and its destroyed groups ("Could not resolve the process
        # group registered under the name 6"). The runtime avoids it with fresh axis names per mesh
        # (workers/groups.py, _axis_names); a test's own meshes don't, so the caches go here (fn runs on
        # this thread, the one whose per-thread caches count).
        clear_dtensor_caches()
        base = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=STORE_TIMEOUT)
        # A fresh prefix per run: the pool's store outlives every run, and group names restart at 0
        # after destroy_process_group, so a reused prefix would meet the last run's keys
        # (docs/design.md, "Store keys collide across generations").
        store = dist.PrefixStore(f"run_world-gen{generation}", base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=self.world, timeout=STORE_TIMEOUT)
        try:
            return self.fn(rank, self.world, *self.args)
        finally:
            dist.destroy_process_group()
            clear_dtensor_caches()  # nor keep this world's meshes (and their groups) alive


@dataclass(frozen=True)
class _PortJob:
    """A pool job: ``fn(rank, port, *args)`` with the port of the store made for this run."""

    fn: Callable[..., Any]
    args: tuple
    port: int

    def __call__(self, rank: int, store_port: int, generation: int) -> Any:
        return self.fn(rank, self.port, *self.args)


def run_world(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(rank, n, *args)`` on ``n`` ranks of a gloo world (the default group); results by rank.

    Raises:
        MeshRunError: a rank raised (every failed rank's traceback is in the message), died, or the
            run passed ``timeout`` seconds (counted once the pool's processes are up).
    """
    return _run_on_pool(_WorldJob(fn, tuple(args), n), n, timeout)


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, timeout: float) -> list[Any]:
    """``fn(rank, store_port, *args)`` on ``n`` ranks that form their own groups through a ``TCPStore``
    at 127.0.0.1:``store_port`` made for this call (so any store prefix is fresh); results by rank.

    Raises:
        MeshRunError: as :func:`run_world`.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    try:
        return _run_on_pool(_PortJob(fn, tuple(args), store.port), n, timeout)
    finally:
        del store  # the ranks are done with it (or killed)


def _run_on_pool(job: Callable[[int, int, int], Any], n: int, timeout: float) -> list[Any]:
    pool = shared_pool()
    try:
        out = pool.run(job, n, timeout)
    except BaseException:
        # A failed, timed-out or interrupted run leaves ranks blocked in collectives: kill them all.
        if is_shared(pool):
            shutdown_pool()
        else:
            pool.close()
        raise
    return [out[rank] for rank in range(n)]

