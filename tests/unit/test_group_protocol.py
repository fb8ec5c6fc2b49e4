"""Both worker groups — the Ray-backed ``WorkerGroup`` and the tests' ``FakeWorkerGroup`` — implement
``orchestrator.cluster.group_protocol.WorkerGroupLike``, what the controller and the coordinators use of
a group: every member, with the same parameters (no Ray started: only the classes are read)."""

from __future__ import annotations

import inspect
import typing
from types import SimpleNamespace

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
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
    group.pids.update({1: done.pid, 2: os.getpid(), 3: done.pid, 4: done.pid})
    group.node_ips.update({1: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.2", 4: "10.0.0.1"})
    # 3: another node; 4: another Ray node at this node's address (its pid is its own namespace's)
    group.node_ids.update({1: "node-a", 2: "node-a", 3: "node-b", 4: "node-c"})
    assert group.exited([1, 2, 3, 4]) == {1}


def test_kill_now_signals_only_processes_of_the_drivers_ray_node(monkeypatch):
    """Two Ray nodes sharing one address: the other node's actor is ended by Ray, never by its pid,
    which on this host may name an unrelated process (here: one we started)."""
    import subprocess

    import ray

    from orchestrator.cluster import worker_group as wg

    bystander = subprocess.Popen(["sleep", "60"])
    try:
        group = wg.WorkerGroup(wg.ActorResources(cpus=1, gpus=0), placement_timeout_s=1)
        monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
        signalled, ended = [], []
        monkeypatch.setattr(wg.os, "kill", lambda pid, sig: signalled.append(pid))
        monkeypatch.setattr(group, "kill", lambda ids: ended.extend(ids))
        group.pids.update({1: 4242, 2: bystander.pid})
        group.node_ips.update({1: "10.0.0.1", 2: "10.0.0.1"})
        group.node_ids.update({1: "node-a", 2: "node-c"})
        group.kill_now([1, 2])
        assert signalled == [4242] and ended == [1, 2]
    finally:
        monkeypatch.undo()  # os.kill itself was replaced above: Popen.kill needs the real one back
        bystander.kill()
        bystander.wait()


def test_a_working_directory_unpacked_again_under_the_driver_is_reentered(tmp_path, monkeypatch):
    """A node on the same machine unpacks the job's package again over the driver's working directory
    (issue 35): relative paths then fail until the driver enters the new copy at the same path."""
    import os
    import shutil

    from orchestrator.cluster.worker_group import reenter_cwd

    job_dir = tmp_path / "_ray_pkg_x"
    job_dir.mkdir()
    monkeypatch.chdir(job_dir)
    shutil.rmtree(job_dir)
    job_dir.mkdir()  # the new copy
    (job_dir / "metrics.jsonl").write_text("")
    try:
        os.getcwd()
        deleted = False
    except FileNotFoundError:
        deleted = True
    assert deleted
    reenter_cwd(str(job_dir))
    assert os.getcwd() == str(job_dir) and os.path.exists("metrics.jsonl")
    reenter_cwd(str(tmp_path))  # a working directory that is there is left alone
    assert os.getcwd() == str(job_dir)


def test_exit_watch_sees_a_watched_process_exit_and_one_gone_before():
    import subprocess
    import time

    from orchestrator.cluster.worker_group import ExitWatch

    gone_before = subprocess.Popen(["true"])
    gone_before.wait()  # reaped: its pid names no process
    running = subprocess.Popen(["sleep", "60"])
    try:
        with ExitWatch({1: running.pid, 2: gone_before.pid}) as watch:
            assert watch.watching and watch.gone({1, 2}) == {2} and watch.gone({1}) == set()
            running.kill()  # not reaped yet: a zombie, which has exited all the same
            for _ in range(500):  # the signal's delivery is asynchronous; bounded, not timed
                if watch.gone({1}):
                    break
                time.sleep(0.01)
            assert watch.gone({1, 2}) == {1, 2}
        assert watch.fds == {}  # closed
    finally:
        running.kill()
        running.wait()


def test_collect_takes_a_local_actor_whose_process_exited_as_dead_before_ray_says_so(monkeypatch):
    """The step's call to actor 1 is still pending in Ray (``ray.wait`` finds nothing ready) but its
    process on the driver's node is gone: ``collect`` reports it dead and stops early; actor 2, on
    another Ray node, stays pending."""
    import subprocess

    import ray

    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

    done = subprocess.Popen(["true"])
    done.wait()
    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=1)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: ([], list(refs)))
    group.pids.update({1: done.pid, 2: done.pid})
    group.node_ids.update({1: "node-a", 2: "node-b"})
    outcome = group.collect({"ref1": 1, "ref2": 2}, 2.0, stop_early=lambda o: bool(o.dead))
    assert outcome.dead == {1: "ActorDiedError (its process is gone)"}
    assert outcome.pending == [2]
