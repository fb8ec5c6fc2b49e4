"""Both worker groups — the Ray-backed ``WorkerGroup`` and the tests' ``FakeWorkerGroup`` — implement
``orchestrator.cluster.group_protocol.WorkerGroupLike``, what the controller and the coordinators use of
a group: every member, with the same parameters (no Ray started: only the classes are read)."""

from __future__ import annotations

import inspect
import typing

from orchestrator.cluster.group_protocol import WorkerGroupLike
from testbed.fake_group import FakeWorkerGroup


def members() -> tuple[list[str], list[str]]:
    """(the protocol's methods and properties, its plain attributes)."""
    own = {k: v for k, v in vars(WorkerGroupLike).items() if not k.startswith("_")}
    return sorted(own), sorted(typing.get_type_hints(WorkerGroupLike))


def parameters(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def mismatches(cls, instance) -> list[str]:
    methods, attributes = members()
    out = [f"{cls.__name__} lacks attribute {a}" for a in attributes if not hasattr(instance, a)]
    for name in methods:
        want, have = inspect.getattr_static(WorkerGroupLike, name), inspect.getattr_static(cls, name, None)
        if have is None:
            out.append(f"{cls.__name__} lacks {name}")
        elif isinstance(want, property) != isinstance(have, property):
            out.append(f"{cls.__name__}.{name}: property on one side only")
        elif not isinstance(want, property) and parameters(have) != parameters(want):
            out.append(f"{cls.__name__}.{name}{inspect.signature(have)} != {inspect.signature(want)}")
    return out


def test_the_protocol_covers_what_the_driver_uses():
    methods, attributes = members()
    assert {"submit", "collect", "call", "kill_now", "live_ids", "start_background", "draining_nodes"} <= set(methods)
    assert attributes == ["node_ids", "node_ips", "pids"]


def test_the_ray_worker_group_conforms():
    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

    assert mismatches(WorkerGroup, WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=1)) == []


def test_the_fake_worker_group_conforms():
    assert mismatches(FakeWorkerGroup, FakeWorkerGroup(2)) == []


def test_the_check_fires_on_a_group_that_drifted():
    class Drifted(FakeWorkerGroup):
        def collect(self, refs, timeout_s):  # lost stop_early
            return None

    assert mismatches(Drifted, Drifted(1)) == ["Drifted.collect(self, refs, timeout_s) != (self, refs: 'dict', "
                                               "timeout_s: 'float', *, stop_early: 'Callable[[CallOutcome], bool] "
                                               "| None' = None) -> 'CallOutcome'"]


def test_exited_sees_a_gone_process_on_this_node_only(monkeypatch):
    import os
    import subprocess

    import ray

    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

    done = subprocess.Popen(["true"])
    done.wait()  # exited and reaped: its pid names no process now
    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=1)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    group.pids.update({1: done.pid, 2: os.getpid(), 3: done.pid})
    group.node_ips.update({1: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.2"})  # 3: another node, unknown
    assert group.exited([1, 2, 3]) == {1}
