"""orchestrator.cluster.autoscale without Ray: which bundles the job asks the autoscaler for, how many fit the
nodes there are, and that the request is withdrawn exactly once. (tests/e2e/test_autoscale_grow.py
shows a real autoscaler acting on the request and the job growing.)"""

from __future__ import annotations

import logging

import pytest

from orchestrator.cluster.autoscale import CapacityRequest, bundles_that_fit, wanted_bundles
from orchestrator.config.load import load_config

CPU = {"CPU": 1.0}
GPU = {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize(
    ("overrides", "count"),
    [
        ([], 4),  # default dp=2 x tp=2, max_dp unset = mesh.dp: the mesh itself
        (["elastic.max_dp=4"], 8),  # grow room: every rank of the largest mesh
        (["mesh.dp=1", "mesh.tp=1", "elastic.max_dp=2"], 2),
        (["mesh.pp=2", "mesh.dp=1", "mesh.tp=2", "elastic.max_dp=2"], 8),  # a replica is pp*tp ranks
        # dp=3 cannot split the global batch of 8 into whole microbatches: never formed, never asked for.
        (["mesh.dp=2", "mesh.tp=1", "elastic.max_dp=3"], 2),
    ],
)
def test_wanted_bundles_cover_the_largest_mesh_the_job_may_form(overrides, count):
    cfg = load_config(None, overrides)
    assert wanted_bundles(cfg, GPU) == [GPU] * count


def test_wanted_bundles_are_independent_copies():
    bundles = wanted_bundles(load_config(None, []), CPU)
    bundles[0]["CPU"] = 99.0
    assert bundles[1] == CPU


def test_bundles_that_fit_count_whole_bundles_per_node():
    head = {"CPU": 8.0, "GPU": 0.0, "memory": 1e10}
    gpu_node = {"CPU": 4.0, "GPU": 1.0}
    assert bundles_that_fit(GPU, [head]) == 0  # a CPU-only cluster holds no GPU rank at all
    assert bundles_that_fit(GPU, [head, gpu_node, gpu_node]) == 2
    assert bundles_that_fit(CPU, [head, gpu_node]) == 12
    # 3 CPUs in total, but a 2-CPU bundle never spans two nodes.
    assert bundles_that_fit({"CPU": 2.0}, [{"CPU": 1.5}, {"CPU": 1.5}]) == 0
    assert bundles_that_fit(CPU, []) == 0


def test_request_is_made_then_withdrawn_once():
    calls = []
    request = CapacityRequest(calls.append)
    request.release()  # nothing asked yet: nothing to withdraw
    assert calls == []
    request.ask([GPU] * 4, fits_now=1)
    assert calls == [[GPU] * 4]
    request.release()
    request.release()
    assert calls == [[GPU] * 4, []]


def test_withdrawn_once_when_a_stop_thread_and_the_run_end_race():
    import threading

    calls = []
    request = CapacityRequest(calls.append)
    request.ask([CPU] * 2)
    threads = [threading.Thread(target=request.release) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [[CPU] * 2, []]


def test_withdrawing_on_a_gone_cluster_warns_instead_of_raising(caplog):
    def refuse(bundles):
        if not bundles:
            raise ConnectionError("GCS is gone")

    request = CapacityRequest(refuse)
    request.ask([CPU])
    with caplog.at_level(logging.WARNING, logger="orchestrator.cluster.autoscale"):
        request.release()
    assert "could not withdraw the autoscaler request" in caplog.text and "GCS is gone" in caplog.text
