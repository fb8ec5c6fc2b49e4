"""One embedded local Ray that consecutive test modules share (tests/ray's ``ray_local`` fixture).

Starting and stopping a local Ray costs ~5-7 s on 2 cores, and a fresh one per module was ~13 of
them in the default suite. A module that asks for ``ray_local`` gets the running one, and keeps it
for the next such module only if it left nothing behind: no rank actor or store host alive, no
placement group held, every CPU free (a module whose test failed mid-run, with actors left alive,
hands the next module a fresh Ray, as before), and only to a module that runs in the same
environment (``up``). Any module that does not ask for it (its own ``ray.init``, a multi-node
``Cluster``, ``run_job``'s embedded Ray, or no Ray at all) finds none running: tests/conftest.py
stops the shared one first (``release``), and the modules that ask are run one after another
(``ray_local_first``). A module that asks in any of its tests has the shared Ray through all of them.
Ray is imported only once a module asks.
"""

from __future__ import annotations

import os
import time

ARGS = {"address": "local", "num_cpus": 8, "include_dashboard": False, "log_to_driver": False}
FIXTURE = "ray_local"
PROJECT_ACTORS = ("RankActor", "StoreHost")
CLEAN_WAIT_S = 5.0  # ray.kill and a placement group's removal free their CPUs asynchronously
_started_from: dict[str, str] | None = None  # the shared Ray's starting environment; None: none runs


# Variables that change in this process without concerning Ray's workers: pytest's per-test one, and
# those libraries set for themselves when a test imports them here (torch's inductor, google-crc32c).
# Any other change gets a fresh Ray: the safe side (only slower).
NOT_FOR_WORKERS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "CRC32C_SW_MODE")


def _environment() -> dict[str, str]:
    """What Ray's processes inherit from this one (``NOT_FOR_WORKERS`` aside)."""
    return {k: v for k, v in os.environ.items() if k not in NOT_FOR_WORKERS}


def up() -> None:
    """Start the shared Ray unless it runs already, started from the environment this process has now:
    Ray's workers inherit the variables of the process that started it, so a module that set some for
    its actors (an S3 endpoint and its credentials: tests/ray/test_data_s3.py) gets a Ray of its own."""
    global _started_from
    import ray

    if _started_from is not None and ray.is_initialized() and _started_from == _environment():
        return
    release()
    ray.init(**ARGS)
    _started_from = _environment()


def release() -> None:
    """Stop the shared Ray, if it runs (never a Ray this module did not start)."""
    global _started_from
    if _started_from is None:
        return
    import ray

    _started_from = None
    ray.shutdown()


def keep_if_clean() -> None:
    """At a module's end: keep the shared Ray for the next module only when this one left nothing
    behind (``_left_clean``); otherwise stop it."""
    if _started_from is not None and not _left_clean():
        release()


def _left_clean() -> bool:
    """No rank actor or store host alive (a store host holds no CPU: only the actor table shows it, and
    tests/ray/test_sweep.py counts every live one of both), no placement group held, every CPU free.
    A test's own idle helper actors (tests/ray/test_given_outlives_giver.py's) are left to the final
    shutdown."""
    import ray
    from ray._private.state import state  # no public list of actors without the dashboard
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + CLEAN_WAIT_S
    while True:
        try:
            cpus_free = ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)
            groups_gone = all(g["state"] == "REMOVED" for g in placement_group_table().values())
            # Not DEAD yet, not only ALIVE (tests/ray/test_sweep.py's pids): one still starting counts too.
            actors_gone = not [a for a in state.actor_table(None).values()
                               if a["State"] != "DEAD" and a["ActorClassName"] in PROJECT_ACTORS]
        except Exception:  # a Ray the module broke (or an API that moved): the next one starts afresh
            return False
        if cpus_free and groups_gone and actors_gone:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def module_of(item) -> str:
    return item.nodeid.split("::")[0]


def ray_local_first(items: list) -> set[str]:
    """Reorder ``items`` in place so that the modules asking for ``ray_local`` run one after another
    (where the first of them was; everything else keeps its order); returns those modules."""
    users = {module_of(item) for item in items if FIXTURE in getattr(item, "fixturenames", ())}
    at = next((i for i, item in enumerate(items) if module_of(item) in users), None)
    if at is not None:
        rest = [item for item in items if module_of(item) not in users]
        block = [item for item in items if module_of(item) in users]
        items[:] = rest[:at] + block + rest[at:]
    return users
