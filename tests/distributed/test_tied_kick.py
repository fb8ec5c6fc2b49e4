"""A kick frees a rank blocked in ``TiedGrads.sync()`` whose peer is gone without a FIN (issue 35).

The pipeline-tied embedding's pair groups are made after the mesh's (workers/tied.py); their
listeners used to open after the rank recorded its gloo ports, so a kick never reached their
connections and a rank inside ``tied.sync()`` stayed blocked until the group timeout, then was killed
as "did not return after the kick". Two ranks (pp=2, bound to 127.0.0.1): rank 1 stays alive but never
enters the sync, as a rank on a host cut off from the network would (its sockets stay open: no FIN);
rank 0 blocks in it and is kicked as ``RankActor.kick`` kicks after a join: its own listeners, no live
peer, and rank 1's listeners as gone, matched against the connections its join recorded
(workers/sockets.py). It must fail with a connection error at once, not the group's timeout."""

from __future__ import annotations

import json
import threading

import pytest

from testbed.gloo_world import run_ranks

TIMEOUT_S = 60.0  # the groups' timeout: what the blocked sync would wait without the kick


def tied_rank(rank: int, store_port: int) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    from meshspeak.mesh import MeshShape
    from workers import sockets
    from workers.bind import listeners
    from workers.groups import build_process_groups
    from workers.tied import TiedGrads

    coord = dist.PrefixStore("tied-kick", dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                                          timeout=timedelta(seconds=TIMEOUT_S)))
    before = sockets.established()
    groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=1,
                                  shape=MeshShape(1, 2, 1), world_rank=rank, timeout_s=TIMEOUT_S,
                                  device=torch.device("cpu"), bind_ip="127.0.0.1")
    mesh_ports = set(groups.gloo_ports)
    stage = nn.Module()
    stage.w = nn.Parameter(torch.ones(4))
    tied = TiedGrads(("w",), {rank: stage}, 2, groups, TIMEOUT_S)
    recorded = sockets.established() - before
    own = listeners(groups.gloo_ports)
    coord.set(f"listeners{rank}", json.dumps(own))
    out = {"tied_ports": sorted(set(groups.gloo_ports) - mesh_ports)}
    if rank == 1:  # alive, silent: never enters the sync until rank 0 is done
        coord.wait(["done"])
    else:
        gone = {tuple(ep) for ep in json.loads(coord.get("listeners1"))}
        local = {port for _, port in own}
        kick = threading.Timer(1.0, lambda: out.setdefault("closed", sockets.shutdown_gloo_sockets(
            local, set(), recorded=recorded, gone_endpoints=gone)))
        kick.start()
        stage.w.grad = torch.ones(4)
        try:
            tied.sync()
            out["error"] = None
        except Exception as exc:  # freed by the kick (or, without it, the timeout)
            out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        kick.join()
        coord.set("done", "1")
    groups.destroy()
    return out


@pytest.mark.timeout(180)
def test_a_kick_frees_a_rank_blocked_in_the_tied_sync():
    rank0, rank1 = run_ranks(2, tied_rank, timeout=150)
    assert rank0["tied_ports"] and rank1["tied_ports"]  # the tied pair's listeners are the generation's
    assert rank0["closed"] >= 1
    assert rank0["error"] is not None, "the sync returned although its peer never entered it"
    assert "Timed out" not in rank0["error"] and "timeout" not in rank0["error"].lower(), rank0["error"]
