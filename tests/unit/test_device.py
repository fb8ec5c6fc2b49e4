"""Device selection: a GPU job on a rank without CUDA fails in one line; backend follows the device."""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from workers.device import DeviceError, backend_for, cuda_index, select_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less path")
def test_a_gpu_job_without_cuda_fails_in_one_line_and_the_driver_reports_that_line():
    from ray.exceptions import RayTaskError

    from orchestrator.cluster.worker_group import error_line

    with pytest.raises(DeviceError) as info:
        select_device(True, gpu_ids=[0], where="rank 3 on 10.0.0.2")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("resources.use_gpu: rank 3 on 10.0.0.2 was given a GPU but ")
    assert message.endswith("or set resources.use_gpu=false")
    # What the driver records for the failed join (Ray wraps the actor's exception).
    wrapped = RayTaskError("RankActor.join_generation", "".join(traceback.format_exception(info.value)),
                           info.value, proctitle="ray::RankActor.join_generation()").as_instanceof_cause()
    assert error_line(wrapped) == f"DeviceError: {message}"


def test_a_cpu_job_computes_on_the_cpu_with_gloo():
    device = select_device(False)
    assert device == torch.device("cpu") and backend_for(device) == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"


@pytest.mark.parametrize(("gpu_ids", "visible", "index"), [
    ([3], "3", 0),  # Ray's default: the actor sees only its GPU
    ([3], None, 3),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: every GPU visible
    ([5], "4,5,6", 1),
    (["GPU-uuid"], "GPU-uuid", 0),
])
def test_cuda_index_is_the_assigned_gpu_among_the_visible_ones(gpu_ids, visible, index):
    assert cuda_index(gpu_ids, visible) == index


@pytest.mark.parametrize(("gpu_ids", "visible"), [([3], "0,1"), ([1], "GPU-a,GPU-b"), (["GPU-c"], "0")])
def test_an_assigned_gpu_that_is_not_visible_is_an_error_not_gpu_0(gpu_ids, visible):
    with pytest.raises(DeviceError, match=f"Ray assigned GPU {gpu_ids[0]} but CUDA_VISIBLE_DEVICES"):
        cuda_index(gpu_ids, visible)


def test_cuda_index_outside_ray_is_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert cuda_index([], "0,1,2,3") == 2
    monkeypatch.delenv("LOCAL_RANK")
    assert cuda_index([], None) == 0


def test_nccl_groups_are_made_without_device_id_and_in_nonblocking_mode(monkeypatch):
    """No eager NCCL init: every communicator is made after its group is registered, so the kick's
    abort reaches it while it is being made (workers/groups.py docstring, from torch's source)."""
    from meshspeak.mesh import MeshShape
    from workers import device as device_mod
    from workers import groups

    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Stop

    monkeypatch.setattr(groups, "check_store", lambda *a, **k: None)  # no store listens on port 1
    monkeypatch.setattr(groups.dist, "TCPStore", lambda *a, **k: object())
    monkeypatch.setattr(groups.dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(groups.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(groups, "backend_for", lambda device: "nccl")
    for name in device_mod.NCCL_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(Stop):
        groups.build_process_groups(store_addr="127.0.0.1", store_port=1, generation=1, shape=MeshShape(2, 1, 1),
                                    world_rank=0, timeout_s=5, device=torch.device("cuda", 0))
    assert seen["backend"] == "nccl" and seen.get("device_id") is None
    assert os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_after_the_join_the_nccl_kick_also_cuts_the_store(monkeypatch):
    """A lazily made NCCL communicator reads its id from the store at the first collective."""
    from workers import actor as actor_mod
    from workers import groups, sockets

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    for backend in ("gloo", "nccl"):
        rank = actor_mod.RankActor(0)
        calls: dict[str, object] = {}
        monkeypatch.setattr(groups, "abort_nccl", lambda: True)
        monkeypatch.setattr(sockets, "shutdown_gloo_sockets",
                            lambda local, remote, **_: calls.setdefault("remote", set(remote)) and 0)
        rank.links.backend, rank.links.store = backend, ("127.0.0.1", 29500)
        rank.kick([("10.0.0.2", 6000)])
        want = {("10.0.0.2", 6000)} | ({("127.0.0.1", 29500)} if backend == "nccl" else set())
        assert calls["remote"] == want, backend


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_kick_aborts_nccl_and_never_touches_sockets_opened_by_an_nccl_join(monkeypatch, backend):
    """Mid-join, listeners opened since the join began are gloo's on a gloo job but may be NCCL's
    bootstrap on an NCCL job: only the gloo job shuts them down; NCCL gets its communicators aborted."""
    from meshspeak.mesh import MeshShape
    from meshspeak.messages import JoinSpec
    from workers import actor as actor_mod
    from workers import groups, sockets

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    rank = actor_mod.RankActor(0)
    calls: dict[str, object] = {}
    monkeypatch.setattr(groups, "abort_nccl", lambda: calls.setdefault("abort", True))
    monkeypatch.setattr(sockets, "listening_ports", lambda: {1000, 2000, 7777})
    monkeypatch.setattr(sockets, "shutdown_gloo_sockets",
                        lambda local, remote, **_: calls.setdefault("shutdown", (set(local), set(remote))) and 0)
    rank.links.backend = backend
    rank.links.listeners = (("10.0.0.1", 5000),)  # the checkpoint group's gloo listener on NCCL
    gen = JoinSpec(2, MeshShape(1, 1, 1), 0, "127.0.0.1", 29500, "run-gen2")
    rank.links.joining = (gen, frozenset({1000, 2000}))
    rank.kick([("10.0.0.2", 6000)])
    local, remote = calls["shutdown"]
    assert remote == {("10.0.0.2", 6000), ("127.0.0.1", 29500)}
    if backend == "nccl":
        assert calls.get("abort") is True
        assert local == {5000}  # 7777 opened during the join: maybe NCCL's bootstrap, left alone
    else:
        assert "abort" not in calls
        assert local == {5000, 7777}


def test_a_kick_for_an_earlier_generation_than_the_rank_joins_is_ignored(monkeypatch):
    """A kick's call can outlive the driver's wait for it (``KICK_S``) on a loaded host and reach the rank
    while the next generation joins: it would shut that join's fresh listeners, and the peers dialling
    them would read "connection refused" as a network fault with every member alive (exit 2, seen in
    bench/torchft_compare.py at load ~45). Such a kick is ignored; one for the joining generation is not."""
    from meshspeak.mesh import MeshShape
    from meshspeak.messages import JoinSpec
    from workers import actor as actor_mod
    from workers import sockets

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    rank = actor_mod.RankActor(0)
    shut: list[set] = []
    monkeypatch.setattr(sockets, "listening_ports", lambda: {1000, 7777})
    monkeypatch.setattr(sockets, "shutdown_gloo_sockets", lambda local, remote, **_: shut.append(set(local)) or 1)
    rank.generation = 2
    rank.links.joining = (JoinSpec(3, MeshShape(1, 1, 1), 0, "127.0.0.1", 29500, "run-gen3"), frozenset({1000}))
    assert rank.kick([("10.0.0.2", 6000)], [], 2) == 0 and shut == []  # late: for the generation it left
    assert rank.kick([("10.0.0.2", 6000)], [], 3) == 1 and shut == [{7777}]  # the join it is in
    assert rank.kick([("10.0.0.2", 6000)]) == 1  # no generation named: as before
