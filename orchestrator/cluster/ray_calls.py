"""Reading what a Ray actor call brought back (driver side): whether a death was its worker process's,
the rank-side error's first line, and big shared call arguments put into the object store once.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorDiedError

from meshspeak.rank_errors import kind_of

WORKER_DIED = "its worker process has died"  # Ray's cause when the node's raylet saw the worker die


def worker_process_died(exc: BaseException) -> bool:
    """Whether Ray reported an actor's death as its worker process dying (the raylet on its node
    reported it, so that node was up then), not its node dying, a preemption, or an unknown cause."""
    return (isinstance(exc, ActorDiedError) and not exc.preempted and WORKER_DIED in str(exc)
            and "node has died" not in str(exc))


def error_line(exc: BaseException) -> str:
    """The first line of the actor-side error: a RayTaskError's own first line is Ray's wrapper
    (``ray::RankActor.join_generation() (pid=.., ip=..)``), its ``cause`` is the rank's exception (a
    ``RankError``, named by the class it had in the rank)."""
    cause = getattr(exc, "cause", None) or exc
    return f"{kind_of(cause)}: {cause}".splitlines()[0]


SHARED_PUT_BYTES = 4096  # a shared argument at least this big is put into the object store once


def shared_arg(arg: Any) -> Any:
    """``arg`` itself, or a ref to one object-store copy of it when it is big (``WorkerGroup.submit``); Ray
    hands a method the value of a ref passed as a top-level argument."""
    if arg is None or isinstance(arg, (bool, int, float, str, bytes)):
        return arg
    try:
        size = len(ray.cloudpickle.dumps(arg))
    except Exception:
        return arg
    return ray.put(arg) if size >= SHARED_PUT_BYTES else arg
