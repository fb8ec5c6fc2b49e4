"""An SSH server on each namespace host (testbed.netns_hosts), for Ray's cluster launcher (`ray up` with
the `local` provider SSHes into the head and the workers).

Everything is made in a folder of the caller's: the client key pair (``keys``), each host's host key and
``sshd_config`` (listening only on the host's own address, root by that key only, no PAM). Each
``sshd`` runs isolated on its host (``HostNet.popen(..., isolate=True)``): its own PID namespace, so a
`ray stop` run through it sees that host's processes only, and its own /root and /tmp, so each host
keeps its own ``~/ray_bootstrap_config.yaml``, ``~/.ray`` and ``/tmp/ray`` as separate machines would.
That folder must therefore not lie under /tmp (each host's /tmp is its own): use /var/tmp.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from testbed.netns_hosts import Host, HostNet

SSH_OPTIONS = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "IdentitiesOnly=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR"]


def unavailable_reason() -> str | None:
    """Why sshd-on-hosts cannot run here (the tools `ray up` needs), or None."""
    for tool, package in (("/usr/sbin/sshd", "openssh-server"), ("ssh", "openssh-client"),
                          ("ssh-keygen", "openssh-client"), ("rsync", "rsync")):
        if shutil.which(tool) is None and not Path(tool).exists():
            return f"`{tool}` is not installed (apt-get install {package})"
    return None


def keys(folder: Path) -> Path:
    """A client key pair in ``folder``; returns the private key's path (``.pub`` beside it)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "elastimesh-test", "-f", str(key)],
                   check=True, capture_output=True)
    return key


def start_sshd(net: HostNet, host: Host, folder: Path, client_key: Path, env: dict) -> subprocess.Popen:
    """``sshd -D`` on ``host`` (isolated), accepting ``client_key`` for root; its files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    host_key = folder / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True,
                   capture_output=True)
    authorized = folder / "authorized_keys"
    shutil.copy(client_key.with_suffix(".pub"), authorized)
    config = folder / "sshd_config"
    config.write_text("\n".join([
        "Port 22", f"ListenAddress {host.ip}", f"HostKey {host_key}", f"AuthorizedKeysFile {authorized}",
        f"PidFile {folder / 'sshd.pid'}", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PrintMotd no",
        "Subsystem sftp internal-sftp", "MaxStartups 100:30:200", "MaxSessions 100", "",
    ]))
    # sshd refuses to start without its privilege-separation directory (the package makes it at boot).
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    return net.popen(host, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], env=env,
                     log=folder / "sshd.log", isolate=True)


def ssh(host: Host, key: Path, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-i", str(key), *SSH_OPTIONS, f"root@{host.ip}", command],
                          capture_output=True, text=True, timeout=timeout)


def wait_ssh(host: Host, key: Path, timeout_s: float = 60) -> None:
    """Until ``host`` answers over SSH; then check it is isolated (its own PID namespace), without which
    a `ray stop` run there would end every Ray on this machine."""
    deadline = time.monotonic() + timeout_s
    while (out := ssh(host, key, "readlink /proc/self/ns/pid")).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no SSH on {host.hostname} ({host.ip}): {out.stderr.strip()}")
        time.sleep(0.5)
    if out.stdout.strip() == os.readlink("/proc/self/ns/pid"):
        raise RuntimeError(f"{host.hostname}'s sshd shares this machine's PID namespace; refusing to go on")
