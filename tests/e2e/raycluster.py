"""A real Ray cluster on this machine for e2e tests: `ray start --head --block` in its own process
session (nodes the autoscaler adds are its descendants), driven through the `ray` CLI as a user would.

Isolation from everything else running Ray here (other test sessions share the machine):
  * its own ``--temp-dir`` and free ports for every listener (GCS, dashboard, agents, metrics);
  * token auth with its own token file (RAY_AUTH_MODE=token + RAY_AUTH_TOKEN_PATH), so the
    user's ``~/.ray/auth_token`` is neither used nor created;
  * teardown never runs ``ray stop`` (it ends every Ray on the machine). It sends SIGTERM to the
    ``ray start --block`` processes it started (each then stops its own node), waits, and SIGKILLs
    what is left: processes of those process groups, their descendants, and any process whose
    environment carries this cluster's token path. Ray's workers run in process groups of their
    own, so the process group alone would miss them; the token path marks exactly our processes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from testbed.ray_start import free_ports, stop_cluster

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Not worth uploading with --working-dir (Ray already leaves out .git, .venv and .gitignore'd files).
EXCLUDES = [".git", ".mypy_cache", ".ruff_cache", ".pytest_cache", "bench/results"]


class RayCluster:
    def __init__(self, root: Path, *, num_cpus: int, autoscaling_config: dict | None = None,
                 head_env: dict | None = None, node_ip: str = "127.0.0.1") -> None:
        self.root = root
        self.node_ip = node_ip  # the head's address (a bridge's, with hosts in namespaces: testbed.netns_hosts)
        self.num_cpus = num_cpus
        self.autoscaling_config = autoscaling_config
        self.head_env = head_env or {}  # the head's `ray start` only (e.g. autoscaler v2's switches)
        self.token_path = root / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.temp_dir = root / "ray"
        (self.gcs_port, self.dashboard_port, self.client_port, self.agent_listen_port, self.agent_grpc_port,
         self.runtime_env_port, self.metrics_port) = free_ports(7)
        self.gcs_address = f"{node_ip}:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update({
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # `elastimesh`, `ray` of this venv
            "RAY_AUTH_MODE": "token",  # clients too: Ray 2.60 clients stay 'disabled' without it
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # SIGTERM stops the node now, not after 30 s
            "RAY_DEDUP_LOGS": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        })
        self.procs: list[subprocess.Popen] = []

    # -- nodes ------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 240.0) -> None:
        cmd = ["ray", "start", "--head", "--block", f"--temp-dir={self.temp_dir}",
               f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}",
               "--dashboard-host=127.0.0.1", "--include-dashboard=true",
               f"--ray-client-server-port={self.client_port}",
               f"--dashboard-agent-listen-port={self.agent_listen_port}",
               f"--dashboard-agent-grpc-port={self.agent_grpc_port}",
               f"--runtime-env-agent-port={self.runtime_env_port}",
               f"--metrics-export-port={self.metrics_port}",
               "--min-worker-port=0", "--max-worker-port=0",  # OS-chosen: no clash with other clusters
               f"--num-cpus={self.num_cpus}", "--num-gpus=0", "--disable-usage-stats"]
        if self.node_ip != "127.0.0.1":
            cmd.append(f"--node-ip-address={self.node_ip}")
        env = {**self.env, **self.head_env}
        if self.autoscaling_config is not None:
            cmd.append(f"--autoscaling-config={self.write_autoscaling_config(self.autoscaling_config)}")
            # Ray's fake multi-node provider: the autoscaler "launches" nodes as local raylets.
            env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        self._spawn(cmd, env, self.root / "head.log")
        self._wait_ready(timeout_s)

    def write_autoscaling_config(self, config: dict) -> Path:
        """Write the launcher config the autoscaler reads (autoscaler v2 re-reads it every round, so
        a test may change e.g. a node type's max_workers while the cluster runs)."""
        config = {**config, "provider": {**config["provider"], "gcs_address": self.gcs_address}}
        path = self.root / "autoscaling.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config))
        tmp.replace(path)  # never a half-written file for the autoscaler to read
        return path

    def _spawn(self, cmd: list[str], env: dict, log: Path) -> None:
        with open(log, "ab") as out:  # (its own session: teardown signals it, never other processes)
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True, cwd=self.root))

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        log = self.root / "head.log"
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head failed or timed out:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        # The job API answers once the dashboard and the head's job agent are up.
        while self.ray("job", "list", "--address", self.dashboard, timeout=60).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard's job API never answered")
            time.sleep(2)

    def add_node(self, num_cpus: int, *, env: dict | None = None, timeout_s: float = 180.0,
                 on_host=None) -> subprocess.Popen:
        """Start one more node (`ray start --address ... --block`) with its own temp dir and ports; it
        is stopped like a real node by SIGTERM to the returned process (``stop_node``) or at shutdown.
        ``on_host``: (HostNet, Host) of testbed.netns_hosts: the node runs on that host, at its address."""
        index = len(self.procs)
        agent_listen, agent_grpc, runtime_env, metrics = free_ports(4)
        log = self.root / f"node{index}.log"
        cmd = ["ray", "start", f"--address={self.gcs_address}", "--block",
               f"--temp-dir={self.root / f'ray{index}'}",
               f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
               "--min-worker-port=0", "--max-worker-port=0",
               f"--num-cpus={num_cpus}", "--num-gpus=0", "--disable-usage-stats"]
        if on_host is not None:
            net, host = on_host
            cmd = net.command(host, [*cmd, f"--node-ip-address={host.ip}"])
        self._spawn(cmd, {**self.env, **(env or {})}, log)
        proc = self.procs[-1]
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start (node {index}) failed or timed out:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        return proc

    def alive_nodes(self) -> int:
        """How many nodes the cluster counts as alive now."""
        out = self.python("import ray\nray.init(log_to_driver=False)\n"
                          "print('ALIVE', sum(bool(n['Alive']) for n in ray.nodes()))\n")
        return int(next(x for x in out.splitlines() if x.startswith("ALIVE ")).split()[1])

    def wait_nodes(self, count: int, timeout_s: float = 180.0) -> None:
        """Until ``count`` nodes are alive (nodes joining one after another: two `ray start`s on one
        filesystem at the same moment sometimes leave one out, shared/notes/hosts-facts.md)."""
        deadline = time.monotonic() + timeout_s
        while (alive := self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{alive} nodes alive after {timeout_s:.0f}s, not {count}")
            time.sleep(1)

    # -- the CLI ----------------------------------------------------------------------------------
    def ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ray", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)

    def submit(self, submission_id: str, train_args: list[str], *, wait: bool, timeout: float = 900,
               working_dir: bool = True, env_vars: dict | None = None) -> subprocess.CompletedProcess:
        """`ray job submit --working-dir . -- elastimesh train ...`, from the repository root.

        ``working_dir=False`` leaves the upload out: the job then runs the package installed in this
        venv. Needed where several nodes share this machine's session directory (see
        test_autoscale_grow.py): a node that joins later unpacks the same package into the same
        directory again, deleting it under processes that are starting there. ``env_vars`` go into
        the job's runtime env (e.g. RAY_JOB_STOP_WAIT_TIME_S, which the job's supervisor reads)."""
        cmd = ["job", "submit", "--address", self.dashboard, "--submission-id", submission_id]
        runtime_env = {"env_vars": env_vars} if env_vars else {}
        if working_dir:
            runtime_env["excludes"] = EXCLUDES
            cmd += ["--working-dir", "."]
        if runtime_env:
            cmd += ["--runtime-env-json", json.dumps(runtime_env)]
        if not wait:
            cmd.append("--no-wait")
        return self.ray(*cmd, "--", "elastimesh", "train", *train_args, timeout=timeout)

    def job_status(self, submission_id: str) -> str:
        out = self.ray("job", "status", "--address", self.dashboard, submission_id, timeout=60)
        text = out.stdout + out.stderr
        # What `ray job status` prints (ray/dashboard/modules/job/cli.py, _log_job_status).
        for needle, status in ((f"Job '{submission_id}' succeeded", "SUCCEEDED"),
                               (f"Job '{submission_id}' failed", "FAILED"),
                               (f"Job '{submission_id}' was stopped", "STOPPED"),
                               (": RUNNING", "RUNNING"), (": PENDING", "PENDING")):
            if needle in text:
                return status
        return f"unknown: {text[-1000:]}"

    def wait_job(self, submission_id: str, timeout_s: float, until=("SUCCEEDED", "FAILED", "STOPPED")) -> str:
        deadline = time.monotonic() + timeout_s
        status = self.job_status(submission_id)
        while status not in until and time.monotonic() < deadline:
            time.sleep(3)
            status = self.job_status(submission_id)
        return status

    def job_logs(self, submission_id: str) -> str:
        return self.ray("job", "logs", "--address", self.dashboard, submission_id, timeout=60).stdout

    def driver(self, train_args: list[str], log: Path) -> subprocess.Popen:
        """`elastimesh train ...` as a driver started by hand on the head (RAY_ADDRESS set), not a job."""
        env = {**self.env, "RAY_ADDRESS": self.gcs_address, "PYTHONPATH": str(REPO)}
        with open(log, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "orchestrator", "train", "--no-progress", *train_args],
                                    env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def python(self, code: str, timeout: float = 120) -> str:
        """Run `code` in a driver connected to this cluster; returns its stdout."""
        out = subprocess.run([sys.executable, "-c", code], env={**self.env, "RAY_ADDRESS": self.gcs_address},
                             capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        return out.stdout

    def autoscaler_request(self) -> list[dict]:
        """The bundles last passed to ray.autoscaler.sdk.request_resources, as the cluster stores them
        for its autoscaler (the v1 autoscaler reads this GCS key)."""
        code = (
            "import json, ray\n"
            "ray.init(log_to_driver=False)\n"
            "from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL as K\n"
            "from ray.experimental.internal_kv import _internal_kv_get\n"
            "raw = _internal_kv_get(K)\n"
            "print('REQUEST=' + (raw.decode() if raw else '[]'))\n"
        )
        line = next(x for x in self.python(code).splitlines() if x.startswith("REQUEST="))
        return json.loads(line.removeprefix("REQUEST="))

    # -- teardown ---------------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 60.0) -> None:
        # `ray start --block` stops its own node on SIGTERM (the monitor's fake nodes go with it).
        stop_cluster(self.procs, self.token_path, grace_s)


@contextmanager
def running_cluster(prefix: str, **kwargs):
    """A started ``RayCluster`` in its own temp root (short, under /tmp: Ray's unix socket paths have a
    ~107-byte limit), shut down and removed afterwards, whatever happened. ``kwargs`` go to RayCluster."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    c = RayCluster(root, **kwargs)
    try:
        c.start()
        yield c
    finally:
        c.shutdown()
        shutil.rmtree(root, ignore_errors=True)


# --- what the e2e tests share besides the cluster -----------------------------------------------


def records(path: Path) -> list[dict]:
    """The records of a metrics JSONL file so far ([] before it exists)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(metrics: Path, driver: subprocess.Popen, log: Path, done, what: str, timeout_s: float = 600,
             poll_s: float = 0.5) -> list[dict]:
    """Poll ``metrics`` until ``done(records)``; fail with the driver's log if it exits first or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while not done(recs := records(metrics)):
        assert driver.poll() is None, f"driver exited before {what}:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what} in time: {recs[-3:]}\n{log.read_text()[-2000:]}"
        time.sleep(poll_s)
    return recs


def fake_autoscaling_config(name: str, worker_max: int, head_cpus: int, provider: dict) -> dict:
    """A full launcher config for Ray's fake multi-node provider (the autoscaler does not merge Ray's
    defaults itself): a head of ``head_cpus`` CPUs and up to ``worker_max`` 2-CPU workers."""
    return {
        "cluster_name": name,
        "max_workers": worker_max,
        "provider": provider,
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus, "GPU": 0}, "node_config": {}, "max_workers": 0},
            "cpu_worker": {"resources": {"CPU": 2, "object_store_memory": 300 * 1024**2}, "node_config": {},
                           "min_workers": 0, "max_workers": worker_max},
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }
