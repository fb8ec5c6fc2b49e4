"""#36 item 8 on a real Ray: launch compares the snapshot and staging copies with the nodes' memory
(Ray's ``memory`` + ``object_store_memory`` resources of each node, from ``ray.nodes()``) and refuses
a mesh that would not fit before any rank is placed.

The module's own local Ray is given 2 GiB of memory and a 100 MiB object store. A 4-rank mesh of a
model whose training state takes ~180 MiB a rank fits it (~0.7 GiB); its ten copies of each rank's
state (~1 GiB a rank) do not."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from orchestrator.config.load import load_config  # noqa: E402
from orchestrator.errors import UserInputError  # noqa: E402
from orchestrator.launch import check_host_memory, run_job  # noqa: E402

pytestmark = pytest.mark.ray

MODEL = ["model.d_model=512", "model.n_layers=8", "model.n_heads=8", "mesh.dp=2", "mesh.tp=2"]


@pytest.fixture(scope="module")
def small_ray():
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _memory=2 * 2**30, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


def test_a_mesh_whose_snapshots_exceed_the_node_is_refused_before_any_rank(small_ray, tmp_path):
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    metrics = tmp_path / "m.jsonl"
    cfg = load_config(None, [*MODEL, f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={metrics}"])
    with pytest.raises(UserInputError) as refused:
        run_job(cfg, progress=False)
    line = str(refused.value)
    assert "\n" not in line and refused.value.exit_code == 2
    assert f"4 ranks on Ray node {node['NodeID'][:12]}" in line and "checkpoint.memory_keep=3" in line, line
    assert "but the node has 2.10 GiB" in line, line  # 2 GiB + 100 MiB, as Ray was given
    assert not metrics.exists()  # refused before the run (its metrics, its ranks) began
    assert ray.is_initialized()  # run_job did not start this Ray, so it left it up


def test_fewer_copies_fit_and_are_let_through(small_ray, tmp_path):
    base = [*MODEL, f"checkpoint.dir={tmp_path / 'ckpt'}"]
    with pytest.raises(UserInputError, match="checkpoint.memory_keep=2"):
        check_host_memory(load_config(None, [*base, "checkpoint.memory_keep=2"]))  # 8 copies: still too many
    check_host_memory(load_config(None, [*base, "checkpoint.memory_every=0"]))  # the staging copy alone fits
    check_host_memory(load_config(None, MODEL))  # no checkpoint.dir: nothing to keep
