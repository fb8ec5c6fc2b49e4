"""s3:// for data and checkpoints against a real S3 API (``moto_server`` on localhost).

* Training reads prepared shards from s3://, commits checkpoints to an s3:// ``checkpoint.dir`` while
  the proxy in front of S3 answers 503 SlowDown to the first manifest writes (a transient error: the
  run goes on), then a second run resumes from s3 resharded into another mesh; every loss equals the
  single-process reference on the local copy of the shards.
* A wrong or refused bucket (data or checkpoints) is exit 2 with one line naming it (a store that does
  not answer at all is cut off at 25 s: tests/unit/test_data_lazy.py, no wall clock here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpoints.catalog import list_checkpoints
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller
from testbed.reference import TEST_LR, reference
from testbed.s3 import FaultProxy, MotoS3

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]
# A constant lr (no warmup, no decay): the two runs train to different train.steps.
BASE = [TEST_LR, "train.warmup_steps=0", "train.min_lr_ratio=1.0", "model.seq_len=32", "model.vocab_size=512", "train.global_batch_size=8", "train.micro_batch_size=2",
        "mesh.pp=1", "mesh.tp=1", "checkpoint.every=2", "elastic.grow_check_s=1e6"]


@pytest.fixture(scope="module")
def s3():
    moto = MotoS3()
    proxy = FaultProxy(moto.port, "PUT", r"manifest\.json", fail=3)  # the first three commits' writes
    moto.use(proxy.url)  # before Ray starts: the actors inherit the endpoint
    moto.filesystem().mkdir("elastimesh")
    yield moto, proxy
    proxy.close()
    moto.close()


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory) -> Path:
    import json

    from meshdata import prepare
    from testbed.tiny_tokenizer import make_tokenizer

    root = tmp_path_factory.mktemp("s3corpus")
    make_tokenizer(root / "tok")
    words = "the baker sold bread to sailors at dawn while crows watched a fox".split()
    rng = np.random.default_rng(1)
    docs = [" ".join(rng.choice(words, rng.integers(3, 30))) for _ in range(400)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(root / "docs.jsonl")], str(root / "shards"), tokenizer=str(root / "tok"), shard_tokens=2000)
    s3[0].filesystem().put(str(root / "shards") + "/", "elastimesh/corpus/", recursive=True)
    return root / "shards"


def _train(cfg, store_address, actors: int) -> dict:
    group = make_group(actors)
    try:
        controller = make_controller(cfg, group, store_address, data_path=cfg.data.path)
        controller.run()
        controller.metrics.close()
    finally:
        group.shutdown()


@pytest.mark.timeout(600)
def test_train_checkpoint_resume_reshard_on_s3(s3, corpus, ray_local, store_address, tmp_path):
    from meshdata import open_source
    from meshdata.masks import mask_eos_for

    moto, proxy = s3
    common = BASE + ["data.path=s3://elastimesh/corpus", "checkpoint.dir=s3://elastimesh/run",
                     f"metrics.path={tmp_path / 'm.jsonl'}"]
    assert open_source("s3://elastimesh/corpus").identity == open_source(str(corpus)).identity
    _train(load_config(None, common + ["mesh.dp=2", "train.steps=4"]), store_address, 2)
    assert len(proxy.failed) == 3  # three 503s on manifest writes, absorbed: the run went on
    assert [e["step"] for e in events(tmp_path / "m.jsonl", "checkpoint")] == [2, 4]
    assert not events(tmp_path / "m.jsonl", "checkpoint_failed")
    assert [c.step for c in list_checkpoints("s3://elastimesh/run") if c.valid] == [2, 4]

    _train(load_config(None, common + ["mesh.dp=1", "train.steps=6"]), store_address, 1)  # dp 2 -> 1
    starts = events(tmp_path / "m.jsonl", "start")
    assert [(e["dp"], e["resumed_from_step"]) for e in starts] == [(2, 0), (1, 4)]
    losses = last_losses(tmp_path / "m.jsonl")

    cfg = load_config(None, [*BASE, f"data.path={corpus}", "mesh.dp=1"])
    assert mask_eos_for(cfg.data) is not None  # masking on: EOS recorded by prepare
    np.testing.assert_allclose([losses[s] for s in range(1, 7)], reference([*BASE, f"data.path={corpus}"], 6).losses,
                               rtol=1e-5)


def _cli_train(*overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "orchestrator", "train", "--no-progress"]
    for o in overrides:
        args += ["--set", o]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", ["data", "checkpoint"])
def test_wrong_or_refused_bucket_is_one_line(s3, corpus, which):
    moto, _ = s3
    deny = FaultProxy(moto.port, None, r"/locked", fail=10**9, status=403, code="AccessDenied")
    try:
        cases = {
            "wrong": "s3://no-such-bucket/x",
            "refused": "s3://locked/x",
        }
        for name, uri in cases.items():
            if which == "data":
                overrides = [f"data.path={uri}"]
            else:
                overrides = ["data.path=builtin", f"checkpoint.dir={uri}", "checkpoint.every=1"]
            import os

            env_endpoint = os.environ["AWS_ENDPOINT_URL"]
            os.environ["AWS_ENDPOINT_URL"] = deny.url if name == "refused" else env_endpoint
            try:
                proc = _cli_train(*overrides)
            finally:
                os.environ["AWS_ENDPOINT_URL"] = env_endpoint
            lines = [ln for ln in proc.stderr.splitlines() if "elastimesh: error:" in ln]
            assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
            key = "data.path" if which == "data" else "checkpoint.dir"
            assert key in lines[0] and uri.split("/")[2] in lines[0], lines[0]
            if name == "wrong" and which == "checkpoint":
                assert not moto.filesystem().exists("no-such-bucket")  # no bucket created by a typo
    finally:
        deny.close()
