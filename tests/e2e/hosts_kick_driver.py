"""The driver of ``test_hosts_kick.py``: the real ``Controller`` on ``RankActor``s, started by hand on the
head of a namespace-host cluster (RAY_ADDRESS), so that it can arm the one rank on the victim host
before training on.

    python -m tests.e2e.hosts_kick_driver '<json>'

The JSON holds ``overrides`` (config), ``victim_ip`` (the address of the host that holds exactly one
rank), ``sleep_at`` and ``sleep_s`` (that rank sleeps ``sleep_s`` once step ``sleep_at``'s backward is
done, before the pipeline's tied copies are summed: RankActor.arm_fault "sleep" at "tied"; its tied
partner, on another host, then waits inside ``TiedGrads.sync``), ``armed`` (where to write, once armed,
every member's world rank, actor, pid, node address and gloo listeners, and which are the victim and
its tied partner), ``result`` (where to write, at the end, the actors still alive and the last
generation's members) and ``params`` (where the final parameters go, an .npz). Exits 0 only if the run
reached its last step.
"""

from __future__ import annotations

import json
import sys


def tied_partner(shape, rank: int) -> int:
    """The rank holding the other copy of ``rank``'s tied embedding (first and last pipeline stage)."""
    coords = shape.coords(rank)
    other_pp = shape.pp - 1 if coords.pp == 0 else 0
    return shape.rank_of(coords.dp, other_pp, coords.tp)


def arm_victim(controller, group, spec: dict) -> dict:
    """Arm the sleep on the one rank on ``spec["victim_ip"]``; what ``armed`` gets (see the module
    docstring). Raises when the placement is not the one the test needs."""
    from meshspeak.rank_calls import RankCalls

    gen = controller.generation
    members = {rank: {"actor": actor, "pid": gen.infos[actor].pid, "ip": gen.infos[actor].node_ip,
                      "listeners": [list(ep) for ep in gen.infos[actor].gloo_listeners]}
               for rank, actor in gen.members.items()}
    on_victim = [rank for rank, m in members.items() if m["ip"] == spec["victim_ip"]]
    if len(on_victim) != 1:
        raise RuntimeError(f"{len(on_victim)} ranks were placed on {spec['victim_ip']}, not 1: {members}")
    victim = on_victim[0]
    partner = tied_partner(gen.shape, victim)
    if members[partner]["ip"] == spec["victim_ip"]:
        raise RuntimeError(f"the tied partner {partner} of rank {victim} is on the victim host too")
    outcome = group.call([members[victim]["actor"]], RankCalls.arm_fault,
                         (spec["sleep_at"], "sleep", spec["sleep_s"], "tied"), timeout_s=60)
    if not outcome.ok:
        raise RuntimeError(f"arming the sleep failed: {outcome}")
    return {"members": members, "victim": victim, "partner": partner, "generation": gen.number}


def main(spec: dict) -> int:
    import numpy as np
    import ray

    from orchestrator.cluster.store_provider import StoreProvider
    from orchestrator.config.load import load_config
    from testbed.driver_steps import form_first_generation, members
    from testbed.ray_cluster import make_group
    from testbed.ray_harness import make_controller, mesh_params

    ray.init(log_to_driver=False)
    cfg = load_config(None, spec["overrides"])
    provider = StoreProvider()
    group = make_group(cfg.mesh.world)
    try:
        controller = make_controller(cfg, group, provider)
        form_first_generation(controller)
        armed = arm_victim(controller, group, spec)
        with open(spec["armed"], "w") as out:
            json.dump(armed, out)
        summary = controller.run()
        np.savez(spec["params"], **mesh_params(controller))
        with open(spec["result"], "w") as out:
            json.dump({"live": sorted(group.live_ids), "members": members(controller),
                       "final_step": summary.final_step}, out)
        print(f"final step {summary.final_step}, restarts {summary.restarts}", flush=True)
        return 0 if summary.final_step == cfg.train.steps else 1
    finally:
        group.shutdown()
        provider.close()


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
