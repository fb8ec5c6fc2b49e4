"""The driver of ``test_hosts_partition_write.py``: the real ``Controller`` on ``RankActor``s, started on
the head of a namespace-host cluster with RAY_ADDRESS (a driver started by hand), so that it can arm a
fault on the ranks of one host before training on.

    python -m tests.e2e.partition_write_driver '<json>'

The JSON holds ``overrides`` (config), ``victim_ip`` (the address of the host whose ranks' saves
stall), ``save_at`` and ``stall_s`` (from the save of step ``save_at`` on, each of those ranks' checkpoint
writes stalls ``stall_s`` before its first byte: RankActor.arm_fault "sleep" at "ckpt_write"),
``armed`` (where to write the victim ranks and actors once armed, for the test to watch their shard
files and logs),
``params`` (where the final parameters go, an .npz) and ``release`` (a file the test creates once it saw
the victims' writes end: the driver keeps its actors until then). Exits 0 only if the run reached its
last step.
"""

from __future__ import annotations

import json
import sys


def victim_ranks(controller, group, victim_ip: str) -> dict[int, int]:
    """world rank -> actor, for the generation's members whose node has the address ``victim_ip``."""
    import ray

    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {rank: actor for rank, actor in controller.generation.members.items()
            if ip_of.get(group.node_ids.get(actor)) == victim_ip}


def main(spec: dict) -> int:
    import numpy as np
    import ray

    from meshspeak.rank_calls import RankCalls
    from orchestrator.cluster.store_provider import StoreProvider
    from orchestrator.config.load import load_config
    from testbed.driver_steps import form_first_generation
    from testbed.ray_cluster import make_group
    from testbed.ray_harness import make_controller, mesh_params

    ray.init(log_to_driver=False)
    cfg = load_config(None, spec["overrides"])
    provider = StoreProvider()
    group = make_group(cfg.mesh.world)
    try:
        controller = make_controller(cfg, group, provider)
        form_first_generation(controller)
        victims = victim_ranks(controller, group, spec["victim_ip"])
        if not victims:
            print(f"no rank was placed on {spec['victim_ip']}", flush=True)
            return 3
        outcome = group.call(list(victims.values()), RankCalls.arm_fault,
                             (spec["save_at"], "sleep", spec["stall_s"], "ckpt_write"), timeout_s=60)
        if not outcome.ok:
            print(f"arming the stall failed: {outcome}", flush=True)
            return 3
        with open(spec["armed"], "w") as out:
            json.dump({"ranks": sorted(victims), "actors": sorted(victims.values()),
                       "generation": controller.generation.number}, out)
        summary = controller.run()
        np.savez(spec["params"], **mesh_params(controller))
        print(f"final step {summary.final_step}, restarts {summary.restarts}", flush=True)
        _hold(spec.get("release"))
        return 0 if summary.final_step == cfg.train.steps else 1
    finally:
        group.shutdown()
        provider.close()


def _hold(release: str | None, most_s: float = 300.0) -> None:
    """Keep the actors (the group is shut down after this) until the test creates ``release``: a run that
    ends inside the partition must not take the cut-off ranks' writes down with it before the test saw
    how they ended. At most ``most_s``."""
    import os
    import time

    deadline = time.monotonic() + most_s
    while release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
