"""Generation formation against ranks: the groups a rank makes, the time it takes, the connections it holds.

    python bench/formation.py [--sizes 4,8,16] [--repeats 3] [--quick] [--out bench/results/formation.json]

For each world size N (mesh dp = N/4, pp = 2, tp = 2), N local gloo ranks (``testbed.gloo_world.run_ranks``)
form a generation ``--repeats`` times in the same processes, two ways:

* ``own_groups`` — the groups ``workers.groups.build_process_groups`` makes: each rank only the groups
  it belongs to (``new_group(use_local_synchronization=True)``), gloo connecting each group's pairs
  when it is made (workers/groups.py says why not lazily);
* ``world_wide`` — the formation before it (the code of commit 913fafc, kept here as the baseline):
  every rank calls ``new_group`` for every group of every axis, in the same order, and gloo connects
  every pair of a group's members when the group is made;
* ``build_process_groups`` — the whole join's group part as a rank runs it (own groups, plus the
  DeviceMesh and the DTensor cache clearing), for the absolute figure.

After forming, every rank runs what one training step of this mesh runs on each group: the grad norm's
all-reduce over the world (the two baselines: on the default group; ``build_process_groups``: over the
tp, pp and dp groups in turn, its lazily made default group never connecting), one on the dp, pp and tp
groups, and one on the checkpoint group (DCP's plan gather); then it counts its established TCP
connections (the store's included) and the gloo listening sockets it opened. Formation time is the wall time of the build on each rank (max over
ranks, median over repeats). The rendezvous store is the bench's own (one TCPStore, as the driver's).
"""

from __future__ import annotations

import os
import statistics
import time

from common import load_average, machine, parser, write_result

from testbed.gloo_world import run_ranks


def _connections() -> int:
    import psutil

    return sum(1 for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED)


def _world_wide(store_port: int, prefix: str, shape, world_rank: int, timeout):
    """The formation before #25 (commit 913fafc's build_process_groups, gloo only): every rank makes
    every group; gloo connects each group's members pairwise when it is made."""
    import torch.distributed as dist

    from workers.groups import AXES

    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    base = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, base), rank=world_rank,
                            world_size=shape.world, timeout=timeout)
    mine = []
    for members_of_axis in [shape.group_ranks(axis) for axis in AXES]:
        for members in members_of_axis:
            group = dist.new_group(members, timeout=timeout, backend="gloo")
            if world_rank in members:
                mine.append(group)
    ckpt = dist.new_group(list(range(shape.world)), timeout=timeout, backend="gloo")
    return mine, ckpt


def _own_groups(store_port: int, prefix: str, shape, world_rank: int, timeout):
    """The groups ``workers.groups.build_process_groups`` makes, and only those (no DeviceMesh, no
    cache clearing: what ``_world_wide`` does not do either): each rank its own groups, members
    meeting by their ranks."""
    import torch.distributed as dist

    from workers.groups import AXES, GLOO_LAZY_INIT

    os.environ.pop(GLOO_LAZY_INIT, None)
    base = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, base), rank=world_rank,
                            world_size=shape.world, timeout=timeout)
    mine = [dist.new_group(next(m for m in shape.group_ranks(axis) if world_rank in m), timeout=timeout,
                           backend="gloo", use_local_synchronization=True) for axis in AXES]
    ckpt = dist.new_group(list(range(shape.world)), timeout=timeout, backend="gloo", use_local_synchronization=True)
    return mine, ckpt


MODES = ("world_wide", "own_groups", "build_process_groups")


def _rank(rank: int, store_port: int, world: int, repeats: int) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from meshspeak.mesh import MeshShape
    from workers import sockets
    from workers.groups import build_process_groups

    shape = MeshShape(dp=world // 4, pp=2, tp=2)
    timeout = timedelta(seconds=120)
    out: dict[str, list] = {}
    for repeat in range(repeats):
        for mode in MODES:
            listeners = sockets.listening_ports()
            t0 = time.perf_counter()
            if mode == "build_process_groups":
                groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=repeat + 1,
                                              shape=shape, world_rank=rank, timeout_s=120,
                                              device=torch.device("cpu"), store_prefix=f"{mode}-{repeat}")
                axis_groups = [groups.mesh.get_group(groups.axis_names[a]) for a in ("dp", "pp", "tp")]
                ckpt = groups.ckpt_group
            else:
                make = _world_wide if mode == "world_wide" else _own_groups
                axis_groups, ckpt = make(store_port, f"{mode}-{repeat}", shape, rank, timeout)
            formed_s = time.perf_counter() - t0
            opened = len(sockets.listening_ports() - listeners)
            t = torch.ones(4)
            # One step's collectives on each group: the grad norm over the world (build_process_groups:
            # over the tp, pp and dp groups in turn, its default group never connecting), the axis
            # groups' own, DCP's plan gather on the checkpoint group.
            world = list(groups.world_axes) if mode == "build_process_groups" else [None]
            for group in [*world, *axis_groups, ckpt]:
                dist.all_reduce(t, group=group)
            first_ops_s = time.perf_counter() - t0 - formed_s
            connections = _connections()
            dist.barrier()  # every rank counted before any leaves
            out.setdefault(mode, []).append({"formed_s": formed_s, "connections": connections,
                                             "listeners": opened, "first_ops_s": first_ops_s})
            dist.destroy_process_group()
    return out


def measure(world: int, repeats: int) -> dict:
    ranks = run_ranks(world, _rank, world, repeats, timeout=600)
    result = {"ranks": world, "mesh": {"dp": world // 4, "pp": 2, "tp": 2}}
    for mode in MODES:
        per_repeat = [max(r[mode][i]["formed_s"] for r in ranks) for i in range(repeats)]
        result[mode] = {
            "formation_s": round(statistics.median(per_repeat), 4),
            "formation_s_each": [round(s, 4) for s in per_repeat],
            "connections_per_rank_max": max(r[mode][-1]["connections"] for r in ranks),
            "connections_per_rank_mean": round(statistics.mean(r[mode][-1]["connections"] for r in ranks), 1),
            "listeners_per_rank": max(r[mode][-1]["listeners"] for r in ranks),
            "first_collectives_s": round(statistics.median(max(r[mode][i]["first_ops_s"] for r in ranks)
                                                           for i in range(repeats)), 4),
        }
    return result


def main() -> None:
    p = parser(__doc__, "formation", "4 and 8 ranks, 2 repeats")
    p.add_argument("--sizes", default="4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.sizes, args.repeats = "4,8", 2
    result = {"benchmark": "formation", "machine_before": machine(load_average=load_average()), "sizes": []}
    for world in map(int, args.sizes.split(",")):
        if world % 4:
            raise SystemExit(f"--sizes: {world} is not a multiple of 4 (the mesh is dp x 2 x 2)")
        result["sizes"].append({**measure(world, args.repeats), "load_average": load_average()})
        print(result["sizes"][-1], flush=True)
        write_result(args.out, result)
    result["machine_after"] = machine(load_average=load_average())
    write_result(args.out, result)


if __name__ == "__main__":
    main()
