"""cluster.yaml passes the checks `ray up` itself makes, offline, and a broken copy fails them.

`ray up` (ray.autoscaler._private.commands._bootstrap_config) does, in order:
  1. prepare_config: merge the provider's defaults.yaml, merge setup commands, check the docker
     section, fill per-node-type min/max workers -- pure Python, local files only;
  2. provider_cls.fillout_available_node_types_resources: on AWS, EC2 DescribeInstanceTypes (network);
  3. validate_config: jsonschema against ray/autoscaler/ray-schema.json, plus head_node_type and
     min_workers/max_workers consistency -- pure Python;
  4. provider_cls.bootstrap_config: IAM role, key pair, subnets, security groups (network).
These tests run 1 and 3 only. 2 and 4 need AWS credentials and reach the cloud, so they are never
called; a guard makes any socket use during validation fail the test, and another checks that no
cloud SDK got imported.
"""

from __future__ import annotations

import copy
import re
import socket
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")  # validate_config needs it (ray[default] brings it)
autoscaler_util = pytest.importorskip("ray.autoscaler._private.util")

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"
CLOUD_SDKS = ("boto3", "botocore", "googleapiclient", "google.cloud", "azure")


def load() -> dict:
    # `ray up` reads the file with yaml.safe_load too.
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture
def offline(monkeypatch):
    """Any network use while validating fails the test instead of reaching a cloud."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"cluster.yaml validation tried to use the network: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    before = set(sys.modules)
    yield
    new_cloud = sorted(m for m in set(sys.modules) - before if m.startswith(CLOUD_SDKS))
    assert not new_cloud, f"validation imported a cloud SDK: {new_cloud}"


def launcher_check(config: dict) -> dict:
    """What `ray up` checks before it talks to the provider; returns the defaults-filled config."""
    prepared = autoscaler_util.prepare_config(copy.deepcopy(config))
    autoscaler_util.validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_ray_launcher_validation(offline):
    prepared = launcher_check(load())
    assert prepared["cluster_name"] == "elastimesh"
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] == "head"
    # The provider defaults were merged in (validate_config insists on this key) and our own node
    # types replaced the default ones rather than being merged with them.
    assert "cluster_synced_files" in prepared
    assert set(prepared["available_node_types"]) == {"head", "gpu_worker"}


def test_head_has_no_gpu_and_workers_autoscale_from_zero(offline):
    config = load()
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU") == 0, "no training actor may land on the head"
    assert head["resources"].get("CPU", 0) > 0, "the driver runs on the head"
    worker = types["gpu_worker"]
    assert worker["min_workers"] == 0 < worker["max_workers"] <= config["max_workers"]
    assert config["provider"]["cache_stopped_nodes"] is False
    # After the launcher fills defaults, the head type gets no extra nodes of its own.
    prepared = launcher_check(config)
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


def test_start_commands_keep_the_dashboard_local_and_use_token_auth():
    config = load()
    head_start = " ".join(config["head_start_ray_commands"])
    assert "ray start --head --port=6379" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_start
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6379" in worker_start
    # Ray 2.60: a node's `ray start` without RAY_AUTH_MODE=token is refused by a token-auth head.
    for cmds in (head_start, worker_start):
        assert "RAY_AUTH_MODE=token" in cmds
    assert any(remote.endswith("/.ray/auth_token") for remote in config["file_mounts"])
    assert any("pip install -e /home/ubuntu/elastimesh" in c for c in config["setup_commands"])


def _misspell_top_level(c):
    c["idle_timeout_minute"] = c.pop("idle_timeout_minutes")


def _misspell_node_type_key(c):
    c["available_node_types"]["gpu_worker"]["min_worker"] = c["available_node_types"]["gpu_worker"].pop(
        "min_workers"
    )


def _max_workers_as_string(c):
    c["max_workers"] = "eight"


def _gpu_count_as_string(c):
    c["available_node_types"]["head"]["resources"]["GPU"] = "0"


def _head_type_not_defined(c):
    c["head_node_type"] = "ray.head.default"


def _min_workers_above_global_max(c):
    c["available_node_types"]["gpu_worker"]["min_workers"] = c["max_workers"] + 1


def _drop_node_config(c):
    del c["available_node_types"]["gpu_worker"]["node_config"]


@pytest.mark.parametrize(
    ("break_it", "kind", "message"),
    [
        (_misspell_top_level, "schema", "'idle_timeout_minute' was unexpected"),
        (_misspell_node_type_key, "schema", "'min_worker' was unexpected"),
        (_max_workers_as_string, "schema", "'eight' is not of type 'integer'"),
        (_gpu_count_as_string, "schema", "'0' is not of type 'integer'"),
        (_drop_node_config, "schema", "'node_config' is a required property"),
        (_head_type_not_defined, "value", "must be one of `available_node_types`"),
        (_min_workers_above_global_max, "value", "smaller than the sum of `min_workers`"),
    ],
)
def test_broken_copies_fail_the_same_validation(offline, break_it, kind, message):
    import jsonschema

    config = load()
    break_it(config)
    expected = jsonschema.ValidationError if kind == "schema" else ValueError
    with pytest.raises(expected, match=re.escape(message)):
        launcher_check(config)
