"""Both worker groups — the Ray-backed ``WorkerGroup`` and the tests' ``FakeWorkerGroup`` — implement
``orchestrator.cluster.group_protocol.WorkerGroupLike``, what the controller and the coordinators use of
a group: every member, with the same parameters (no Ray started: only the classes are read)."""

from __future__ import annotations

import inspect
import typing
from types import SimpleNamespace

import pytest

from meshspeak.pids import pid_namespace
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


def test_the_simulated_group_of_bench_scale_conforms():
    """testbed/sim_group.py drives the real Controller in bench/scale.py's simulated part (the suite runs
    it: tests/process/test_bench_scripts.py); a member it lacked failed only there."""
    from testbed.sim_group import SimGroup

    assert mismatches(SimGroup, SimGroup(4, latency_s={})) == []


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
    group.pids.update({1: done.pid, 2: os.getpid(), 3: done.pid, 4: done.pid, 5: done.pid})
    group.node_ips.update({1: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.2", 4: "10.0.0.1", 5: "10.0.0.1"})
    # 3: another node; 4: another Ray node at this node's address (its pid is its own namespace's);
    # 5: this Ray node, but a pid namespace other than the driver's (a driver in a sidecar container)
    group.node_ids.update({1: "node-a", 2: "node-a", 3: "node-b", 4: "node-c", 5: "node-a"})
    group.pid_namespaces.update({a: pid_namespace() for a in (1, 2, 3, 4)} | {5: pid_namespace() + 1})
    assert group.exited([1, 2, 3, 4, 5]) == {1}


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
        group.pids.update({1: 4242, 2: bystander.pid, 3: bystander.pid})
        group.node_ips.update({1: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.1"})
        group.node_ids.update({1: "node-a", 2: "node-c", 3: "node-a"})
        # 3: the driver's Ray node, another pid namespace: its pid may name any process here
        group.pid_namespaces.update({1: pid_namespace(), 2: pid_namespace(), 3: pid_namespace() + 1})
        group.kill_now([1, 2, 3])
        assert signalled == [4242] and ended == [1, 2, 3]
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


def _pidfds() -> bool:
    """Whether this system gives pidfds (Linux >= 5.3, not blocked by a seccomp profile)."""
    import os

    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


@pytest.mark.skipif(not _pidfds(), reason="no pidfds here: nothing is watched (Ray's report decides)")
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


@pytest.mark.skipif(not _pidfds(), reason="no pidfds here: nothing is watched (Ray's report decides)")
def test_collect_takes_a_local_actor_whose_process_exits_as_dead_at_once(monkeypatch):
    """Ray still has the step's calls pending (``ray.wait`` finds nothing ready); during its second
    wait actor 1's process, on the driver's node, exits: ``collect`` reports it dead after that very
    wait and stops early (without the watch it would wait out its 30 s with Ray's every answer
    missing); actor 2, on another Ray node, stays pending. Its ref is read later (``drain``)."""
    import os
    import subprocess

    import ray

    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

    victim = subprocess.Popen(["sleep", "60"])
    waits = []

    def wait(refs, num_returns, timeout, **_):
        waits.append(timeout)
        if len(waits) == 2:
            victim.kill()
            os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        return [], list(refs)

    try:
        group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=1)
        monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
        monkeypatch.setattr(ray, "wait", wait)
        group.pids.update({1: victim.pid, 2: victim.pid})
        group.node_ids.update({1: "node-a", 2: "node-b"})
        group.pid_namespaces.update({1: pid_namespace(), 2: pid_namespace()})
        outcome = group.collect({"ref1": 1, "ref2": 2}, 30.0, stop_early=lambda o: bool(o.dead))
        assert outcome.dead == {1: "ActorDiedError (its process is gone)"} and outcome.pending == [2]
        assert len(waits) == 2 and waits[1] <= 0.1  # polled soon, stopped at once
        assert group._unread == ["ref1"]
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.skipif(not _pidfds(), reason="no pidfds here: nothing is watched (Ray's report decides)")
def test_exit_watch_closes_what_it_opened_when_its_start_fails(monkeypatch):
    import os

    from orchestrator.cluster import worker_group as wg

    opened, closed = [], []
    real_open, real_close = os.pidfd_open, os.close

    class FailingPoll:
        def __init__(self):
            self.calls = 0

        def register(self, fd, events):
            self.calls += 1
            if self.calls == 2:
                raise OSError("no room")

    monkeypatch.setattr(wg.os, "pidfd_open", lambda pid: opened.append(real_open(pid)) or opened[-1])
    monkeypatch.setattr(wg.os, "close", lambda fd: closed.append(fd) or real_close(fd))
    monkeypatch.setattr(wg.select, "poll", FailingPoll)
    with pytest.raises(OSError, match="no room"):
        wg.ExitWatch({1: os.getpid(), 2: os.getpid()})
    assert len(opened) == 2 and sorted(closed) == sorted(opened)
