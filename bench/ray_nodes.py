"""A real `ray start` cluster on this machine for benchmarks that need one (``bench/node_loss.py``).

``bench/`` never imports ``tests/``, so this is the benchmarks' own small launcher; the e2e tests have a
fuller one (``tests/e2e/raycluster.py``); both take free ports, find their own processes and tear down
through ``testbed/ray_start.py``, with the same isolation rules:

* every node is `ray start --block` in its own process session, with its own ``--temp-dir`` and free
  ports for every listener, so other Ray clusters on the machine are never touched;
* token auth with this cluster's own token file (``RAY_AUTH_MODE=token`` + ``RAY_AUTH_TOKEN_PATH``);
* teardown never runs ``ray stop`` (it ends every Ray on the machine): SIGTERM to the ``ray start``
  processes we started, then SIGKILL to what is left of *our* processes (their descendants and any
  process whose environment carries this cluster's token path).

``gcs_pid()`` is the head's ``gcs_server``, found among the descendants of the head's ``ray start``
(never by name across the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# the repository root is on sys.path once bench/common.py is imported (every script imports it first)
from testbed.ray_start import free_ports, stop_cluster

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


class RayStartCluster:
    """Head and worker nodes as `ray start --block` processes; ``nodes[i]`` is node i's process."""

    def __init__(self, head_cpus: int, head_ip: str = "127.0.0.1") -> None:
        """``head_ip``: the head's address (a bridge's, for worker nodes on namespace hosts:
        ``add_node(on_host=...)``, testbed.netns_hosts)."""
        self.root = Path(tempfile.mkdtemp(prefix="em-bench-", dir="/tmp"))  # short: unix socket paths
        self.token_path = self.root / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.gcs_port, self.dashboard_port = free_ports(2)
        self.gcs_address = f"{head_ip}:{self.gcs_port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update({
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1",
        })
        self.nodes: list[subprocess.Popen] = []
        self.failed: list[subprocess.Popen] = []  # `ray start`s that gave up (their own sessions: teardown)
        try:
            self._node(["--head", f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}",
                        "--dashboard-host=127.0.0.1", "--include-dashboard=true",
                        f"--ray-client-server-port={free_ports(1)[0]}",
                        *([f"--node-ip-address={head_ip}"] if head_ip != "127.0.0.1" else [])], head_cpus, {})
        except BaseException:  # a head that gave up (Ray's 30 s under load): nothing of it is left behind
            self.shutdown()
            raise

    def add_node(self, cpus: int, env: dict | None = None, attempts: int = 3, on_host=None) -> subprocess.Popen:
        """A worker node. `ray start` gives a raylet 30 s (hard-coded in Ray 2.60's node.py) to register
        with the GCS and exits otherwise, which happens on this machine under a load of ~100: try again
        (the failed attempt's processes die with its `ray start`: Ray's kernel fate-sharing).
        ``on_host``: (HostNet, Host) of testbed.netns_hosts: the node runs on that host, at its address."""
        for attempt in range(attempts):
            try:
                return self._node([f"--address={self.gcs_address}"], cpus, env or {}, on_host)
            except RuntimeError:
                self.failed.append(self.nodes.pop())
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _node(self, args: list[str], cpus: int, env: dict, on_host=None) -> subprocess.Popen:
        index = len(self.nodes) + len(self.failed)
        agent_listen, agent_grpc, runtime_env, metrics = free_ports(4)
        log = self.root / f"node{index}.log"
        cmd = ["ray", "start", "--block", *args, f"--temp-dir={self.root / f'ray{index}'}",
               f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
               "--min-worker-port=0", "--max-worker-port=0", f"--num-cpus={cpus}", "--num-gpus=0",
               "--disable-usage-stats"]
        if on_host is not None:
            net, host = on_host
            cmd = net.command(host, [*cmd, f"--node-ip-address={host.ip}"])
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=self.root)
        self.nodes.append(proc)
        deadline = time.monotonic() + 240
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start (node {index}) failed:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        return proc

    def gcs_pid(self) -> int:
        head = psutil.Process(self.nodes[0].pid)
        return next(p.pid for p in head.children(recursive=True) if p.name() == "gcs_server")

    def node_id_of(self, proc: subprocess.Popen) -> str:
        """The Ray node id of the node that ``proc`` (a `ray start` we started) runs: its raylet's
        ``--node_id`` argument."""
        for child in psutil.Process(proc.pid).children(recursive=True):
            for arg in child.cmdline():
                if child.name() == "raylet" and arg.startswith("--node_id="):
                    return arg.split("=", 1)[1]
        raise RuntimeError("no raylet found under that node's `ray start`")

    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ray", *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=REPO)

    def driver(self, train_args: list[str], log: Path) -> subprocess.Popen:
        """`python -m orchestrator train ...` on the head with RAY_ADDRESS (a driver started by hand)."""
        env = {**self.env, "RAY_ADDRESS": self.gcs_address, "PYTHONPATH": str(REPO)}
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "orchestrator", "train", "--no-progress", *train_args],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def shutdown(self) -> None:
        stop_cluster(self.nodes + self.failed, self.token_path)
        shutil.rmtree(self.root, ignore_errors=True)
