"""A cluster of hosts on one machine: Linux network namespaces, each a host with its own address on a
bridge, its own hostname and its own ``/etc/hosts``; faults on them (a host killed, a host cut off).

``HostNet(n)`` makes, as root:
  * a bridge in the root namespace holding ``.1`` of a /24 drawn at random from 198.18.0.0/15 (the
    block reserved for benchmarking networks; a /24 already on this machine is never drawn). The root
    namespace is "the head": a Ray head there binds ``net.bridge_ip``;
  * ``n`` namespaces, each joined to the bridge by a veth pair (the host's end is ``eth0`` inside its
    namespace, the other end ``Host.veth`` on the bridge), holding ``.11``, ``.12``, ...;
  * ``/etc/netns/NS/hosts`` per host, which ``ip netns exec`` mounts over ``/etc/hosts``: either every
    hostname on its own address, or (``loopback_hostnames=True``) each host's own name on 127.0.1.1 as
    Debian and Ubuntu install it, the others on their addresses (as DNS would give them).

``HostNet.popen(host, argv)`` runs a command on a host: ``ip netns exec NS unshare --uts sh -c
'hostname NAME; exec argv'``, in a session of its own. ``isolate=True`` adds a PID and mount namespace
and binds the host's own directories over ``/root`` and ``/tmp``, for commands that believe they own
the machine (``sshd`` for ``ray up``, whose ``ray stop`` would otherwise end every Ray on it).

Faults: ``kill_host`` SIGKILLs every process of the host's namespace (``ip netns pids NS``: exactly
those); ``cut``/``heal`` set the host's bridge-side veth down/up (this kernel has no netem).

Nothing else is touched: names carry a random tag per ``HostNet``, only addresses from 198.18.0.0/15
are used and only on namespaces made here, and ``teardown`` (also run at interpreter exit for every
HostNet not torn down) kills the namespaces' processes, deletes the namespaces (their veths go with
them), the bridge and the ``/etc/netns`` entries.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SUPERNET = ipaddress.ip_network("198.18.0.0/15")
NETNS_ETC = Path("/etc/netns")


def _kept_under_root() -> list[str]:
    """Entries of /root an isolated host must still see: where this Python really lives (a venv's
    interpreter may link into /root/.pyenv), since its own /root hides the machine's."""
    real = Path(os.path.realpath(sys.executable))
    return [real.relative_to("/root").parts[0]] if real.is_relative_to("/root") else []
_LIVE: set[HostNet] = set()  # torn down at exit if a caller did not


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be made here (not root, no `ip`/`unshare`, `ip netns` refused), or
    None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs, a bridge)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"emprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Host:
    index: int
    ns: str  # the network namespace
    hostname: str
    ip: str
    veth: str  # the bridge-side end of its link (down = cut off)
    home: Path  # its root/ and tmp/ are bound over /root and /tmp for isolated commands
    procs: list[subprocess.Popen] = field(default_factory=list)


def _run(*argv: str) -> None:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed: {out.stderr.strip()}")


def _subnets_in_use() -> set[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    nets = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.add(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


def _draw_subnet() -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no address on this machine's root namespace overlaps."""
    used = _subnets_in_use()
    candidates = list(SUPERNET.subnets(new_prefix=24))
    random.SystemRandom().shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("every /24 of 198.18.0.0/15 is in use on this machine")


class HostNet:
    """``n`` namespace hosts on one bridge; see the module docstring."""

    def __init__(self, n: int, root: Path, *, loopback_hostnames: bool = False) -> None:
        self.tag = secrets.token_hex(2)
        self.root = root
        self.loopback_hostnames = loopback_hostnames
        self.subnet = _draw_subnet()
        self.bridge = f"emb{self.tag}"
        self.bridge_ip = str(self.subnet.network_address + 1)
        self.hosts = [Host(i, f"em{self.tag}h{i}", f"host{i}-{self.tag}", str(self.subnet.network_address + 11 + i),
                           f"emv{self.tag}{i}", root / f"host{i}") for i in range(n)]
        self._timers: list[threading.Timer] = []
        self._made: list[tuple[str, str]] = []  # ("netns"|"link"|"etc", name): what teardown removes
        _LIVE.add(self)
        try:
            self._make()
        except BaseException:
            self.teardown()
            raise

    # -- making ---------------------------------------------------------------------------------------
    def _make(self) -> None:
        prefix = self.subnet.prefixlen
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.bridge_ip}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.ns)
            self._made.append(("netns", host.ns))
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            _run("ip", "link", "set", host.veth, "master", self.bridge)
            _run("ip", "link", "set", host.veth, "up")
            inside = ("ip", "netns", "exec", host.ns)
            _run(*inside, "ip", "addr", "add", f"{host.ip}/{prefix}", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            self._write_hosts_file(host)
            for sub in ("root", "tmp", *(f"root/{keep}" for keep in _kept_under_root())):
                (host.home / sub).mkdir(parents=True, exist_ok=True)

    def _write_hosts_file(self, host: Host) -> None:
        own = "127.0.1.1" if self.loopback_hostnames else host.ip
        lines = ["127.0.0.1\tlocalhost", f"{own}\t{host.hostname}"]
        lines += [f"{other.ip}\t{other.hostname}" for other in self.hosts if other is not host]
        folder = NETNS_ETC / host.ns
        folder.mkdir(parents=True, exist_ok=True)
        self._made.append(("etc", host.ns))
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    # -- running things on a host ---------------------------------------------------------------------
    def command(self, host: Host, argv: list[str], *, isolate: bool = False) -> list[str]:
        """``argv`` as run on ``host``: in its network namespace, under its own hostname (a UTS
        namespace); ``isolate`` adds its own PID namespace (with its /proc) and its own /root and /tmp."""
        script = f"hostname {shlex.quote(host.hostname)}"
        unshare = ["unshare", "--uts"]
        if isolate:
            unshare += ["--mount", "--pid", "--fork", "--mount-proc", "--kill-child"]
            for keep in _kept_under_root():  # first, while the machine's /root is still in view
                script += f" && mount --bind {shlex.quote(f'/root/{keep}')} {shlex.quote(str(host.home / 'root' / keep))}"
            for sub in ("root", "tmp"):
                script += f" && mount --rbind {shlex.quote(str(host.home / sub))} /{sub}"
        return ["ip", "netns", "exec", host.ns, *unshare, "sh", "-c", script + ' && exec "$@"', "sh", *argv]

    def popen(self, host: Host, argv: list[str], *, env: dict, log: Path, isolate: bool = False,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` on ``host`` in a session of its own, output appended to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.command(host, argv, isolate=isolate), env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd or self.root)
        host.procs.append(proc)
        return proc

    # -- faults ---------------------------------------------------------------------------------------
    @staticmethod
    def pids(host: Host) -> list[int]:
        """Every process in the host's network namespace (in this machine's PID numbering)."""
        out = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) > 1]

    def kill_host(self, host: Host, timeout_s: float = 20.0) -> int:
        """SIGKILL every process of the host (repeatedly, as some may still fork); returns how many."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids(host)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        for proc in host.procs:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        return len(killed)

    def cut(self, host: Host) -> None:
        """Partition: the host's link goes down (its processes live on, unreachable)."""
        _run("ip", "link", "set", host.veth, "down")

    def heal(self, host: Host) -> None:
        _run("ip", "link", "set", host.veth, "up")

    def cut_for(self, host: Host, seconds: float) -> threading.Timer:
        """Cut the host off now and heal it ``seconds`` later (on a timer thread); returns the timer."""
        self.cut(host)
        timer = threading.Timer(seconds, self.heal, args=(host,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return timer

    # -- teardown -------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Kill every process on the hosts, delete the namespaces, the bridge and /etc/netns entries.
        Idempotent; never raises."""
        for timer in self._timers:
            timer.cancel()
        for kind, name in reversed(self._made):
            try:
                if kind == "netns":
                    host = next(h for h in self.hosts if h.ns == name)
                    self.kill_host(host)
                    subprocess.run(["ip", "netns", "del", name], capture_output=True)
                elif kind == "link":
                    subprocess.run(["ip", "link", "del", name], capture_output=True)
                else:
                    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            except Exception as exc:  # teardown goes on with the rest
                print(f"netns_hosts teardown: {kind} {name}: {exc}", flush=True)
        self._made.clear()
        _LIVE.discard(self)


@atexit.register
def _teardown_all() -> None:
    for net in list(_LIVE):
        net.teardown()
