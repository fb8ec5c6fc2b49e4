"""Issue 35: a mesh across hosts with addresses of their own, submitted with `ray job submit`.

Three hosts on this machine (testbed.netns_hosts): the head in the root namespace on the bridge address
with 0 CPUs (the driver and the rendezvous store run there, no rank), two worker hosts of 2 CPUs each,
each in a network namespace with its own address and hostname. A mesh of 4 ranks can only be placed
over both worker hosts. (2,2,1) and (2,1,2) keep their mesh from the first step to the last with no
`failure` event and equal one process within 1e-5:
  * with every hostname resolving to its host's own address;
  * with every host's own name on 127.0.1.1, as Debian and Ubuntu install /etc/hosts: a rank whose
    gloo took its address from the hostname would advertise loopback to its peers on the other host
    (`Gloo connectFullMesh failed ... remote=[127.0.1.1]`), so this passes only when gloo binds the
    interface that carries Ray's node address.
"""

from __future__ import annotations

import pytest

from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference
from tests.e2e.hosts import hosts_cluster
from tests.e2e.raycluster import records

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

STEPS = 8
SHAPES = [(2, 2, 1), (2, 1, 2)]
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "elastic.grow_check_s=1e6"]


@pytest.fixture(scope="module", params=["own-address", "loopback-127.0.1.1"])
def cluster(request):
    with hosts_cluster("em-hm-", workers=2, cpus=2,
                       loopback_hostnames=request.param.startswith("loopback")) as (c, net):
        yield c


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "dp{}pp{}tp{}".format(*s))
def test_mesh_across_hosts_keeps_its_shape_and_equals_one_process(cluster, tmp_path, shape):
    dp, pp, tp = shape
    metrics = tmp_path / "metrics.jsonl"
    overrides = OVERRIDES + [f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", f"metrics.path={metrics}",
                             f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=4"]
    job = f"mesh-{dp}{pp}{tp}-{tmp_path.name[-6:]}"
    out = cluster.submit(job, [a for o in overrides for a in ("--set", o)], wait=True)
    status = cluster.job_status(job)
    assert status == "SUCCEEDED", out.stdout[-4000:] + out.stderr[-2000:] + cluster.job_logs(job)[-3000:]
    recs = records(metrics)
    assert not [r for r in recs if r.get("event") == "failure"], [r for r in recs if "event" in r]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert {(r["dp"], r["pp"], r["tp"]) for r in steps} == {shape}
    assert_matches_reference({r["step"]: r["loss"] for r in steps}, None, reference(overrides, STEPS),
                             CONTROLLER_FP32)
