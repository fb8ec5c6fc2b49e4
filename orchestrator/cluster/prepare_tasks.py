"""``data prepare`` over Ray tasks: the fan-out ``meshdata.prepare`` runs its units through.

``meshdata`` never imports Ray (both sides import it, and a small prepare runs in-process); the CLI
hands this fan-out to ``prepare`` so that a large input is tokenized by one Ray task per unit, on the
local Ray by default or the cluster at ``RAY_ADDRESS`` when set, at most two tasks per CPU in flight.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from meshdata.errors import DataError
from meshdata.prepare import Job, UnitResult, tokenize_unit


class RayFanOut:
    def workers(self) -> int:
        """CPUs the tasks will get: the connected Ray cluster's, else this machine's."""
        ray = sys.modules.get("ray")  # never import Ray just to ask: small prepares run without it
        if ray is not None and ray.is_initialized():
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return os.cpu_count() or 1

    def __call__(self, units: list, job: Job) -> Iterator[tuple[int, UnitResult]]:
        """Run the units as Ray tasks; yields (unit index, result) as they finish."""
        import ray

        started = not ray.is_initialized()
        if started:
            address = os.environ.get("RAY_ADDRESS")
            env = {"env_vars": {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
            if address:
                ray.init(address=address, runtime_env=env, log_to_driver=True)
            else:
                ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=env,
                         log_to_driver=True)
        try:
            task = ray.remote(num_cpus=1, max_retries=2)(tokenize_unit)
            job_ref = ray.put(job)
            limit = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
            todo = list(enumerate(units))[::-1]
            running: dict = {}
            while todo or running:
                while todo and len(running) < limit:
                    i, u = todo.pop()
                    running[task.remote(u, job_ref)] = i
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    i = running.pop(ref)
                    try:
                        yield i, ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, DataError):
                            raise DataError(str(cause), key=cause.key) from None
                        raise
        finally:
            if started:
                ray.shutdown()
