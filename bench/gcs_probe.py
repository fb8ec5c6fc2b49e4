"""A client of a benchmark's `ray start` cluster, run as a subprocess (``bench/node_loss.py``) with the
cluster's RAY_ADDRESS and token: it connects once (seconds on a loaded box, so not per question), then
answers one line ``PROBE <json>`` on stdout per command line on stdin (Ray prints its own cluster
messages, e.g. a node marked dead, on the same stdout):

* ``dead NODE_ID``: polls the GCS's node list every 0.2 s until NODE_ID is no longer alive, then
  answers ``{"dead_at": time.time()}`` (``null`` after 300 s). The benchmark's "node gone" is this
  moment: Ray re-places (or not) a lost node's bundles only once the GCS declared it dead, which comes
  some seconds after a SIGTERM'd ``ray start`` stops its processes or after its raylet was killed.
* ``groups``: every placement group the cluster holds (not removed): ``state`` and bundle ``nodes``.

Between questions it makes no calls, so it adds nothing to the GCS CPU being measured.
"""

from __future__ import annotations

import json
import sys
import time

import ray
from ray.util.placement_group import placement_group_table

DEAD_POLL_S = 0.2
DEAD_TIMEOUT_S = 300.0


def dead_at(node_id: str) -> float | None:
    deadline = time.monotonic() + DEAD_TIMEOUT_S
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        if time.monotonic() > deadline:
            return None
        time.sleep(DEAD_POLL_S)
    return time.time()


def groups() -> list[dict]:
    return [{"state": t["state"], "nodes": sorted(set(t["bundles_to_node_id"].values()))}
            for t in placement_group_table().values() if t["state"] != "REMOVED"]


def main() -> None:
    ray.init(log_to_driver=False)
    print("PROBE", json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "dead":
            answer = {"dead_at": dead_at(args[0])}
        elif command == "groups":
            answer = {"groups": groups()}
        else:
            answer = {"error": f"unknown command {command!r}"}
        print("PROBE", json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
