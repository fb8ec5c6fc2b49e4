"""examples/onprem_cluster.yaml is a launcher config Ray 2.60 accepts (its own schema, after the `local`
provider's preparation), and keeps what docs/cluster.md promises: a 0-CPU head, every agent port fixed,
nothing installed at `ray up` time. tests/e2e/test_hosts_ray_up.py runs it for real."""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "onprem_cluster.yaml"


def test_ray_accepts_the_onprem_example():
    from ray.autoscaler._private.local.config import prepare_local
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(EXAMPLE.read_text())
    validate_config(prepare_config(config))
    prepared, _ = prepare_local(config)
    assert config["provider"]["type"] == "local"
    # min = max = every machine listed: `ray up` keeps them all running
    node_type = prepared["available_node_types"]["local.cluster.node"]
    assert node_type["min_workers"] == node_type["max_workers"] == len(config["provider"]["worker_ips"])


def test_onprem_example_head_has_no_cpus_fixed_ports_and_installs_nothing():
    config = yaml.safe_load(EXAMPLE.read_text())
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    assert "--num-cpus=0" in head and f"--node-ip-address={config['provider']['head_ip']}" in head
    for start in (head, workers):
        for flag in ("--dashboard-agent-listen-port=", "--dashboard-agent-grpc-port=", "--runtime-env-agent-port=",
                     "--metrics-export-port="):
            assert flag in start, (flag, start)
    commands = [c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                              "initialization_commands") for c in config.get(key, [])]
    assert not [c for c in commands if "pip install" in c or "curl" in c], commands
