"""Free a rank that is blocked in a gloo collective whose peer died, by shutting down that generation's sockets.

Why this exists: on gloo, ``abort()``/``shutdown()`` do not unblock an op already running, and with
FSDP2 holding the group alive ``destroy_process_group()`` does not close the sockets either, so
survivors would wait the full collective timeout (docs/design.md, Failure path; F1, F2). Shutting the TCP
connections down makes the blocked recv fail at once. It is a sharp tool: a first attempt that picked
sockets by "opened recently" hit a Ray socket and killed the actor. So we only touch connections whose
local port is one of *this generation's* gloo listening ports, or whose peer is a gloo listener of
some rank of this generation, and re-check each fd's addresses right before shutting it down.
A rank blocked in the *rendezvous* of a generation (a peer died before registering in the store) is
freed the same way, by shutting down its connection to the driver's store endpoint.
On GPU the proper tool is NCCL's communicator abort; this module is for the gloo path.

A connection this rank dialled to a peer that is gone (its host cut off: no FIN ever arrives) matches
only that peer's listener, and a gone peer's port may belong to another process by now, so the
listing of the moment never matches gone peers. The connections the generation's groups made are
recorded when the join ends instead (``established``: every gloo pair is connected by then, as
groups connect eagerly: workers/groups.py), and a gone peer's listener is matched against that
record only: a connection that existed while that port was the peer's gloo listener can only have
been dialled to it. Each recorded socket is shut only if its fd still has the recorded local and
peer address, both ip and port.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def listening_ports() -> set[int]:
    """TCP ports this process listens on now."""
    return table().ports


def _plain_ip(ip: str) -> str:
    # TCPStore and gloo use AF_INET6 sockets, whose IPv4 peers read as "::ffff:a.b.c.d"; a link-local
    # address's "%interface" is left out, as the kernel's TCP table (and psutil) show it.
    ip = ip.split("%", 1)[0]
    return ip[7:] if ip.startswith("::ffff:") else ip


def _dup_socket(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open), or None where ``fd`` is
    closed or no socket by now (its number reused). The duplicate shares ``fd``'s open file, whose
    flags making a socket object may change (O_NONBLOCK, where ``socket.setdefaulttimeout`` was
    called): they are put back at once, as the owner (gloo, the store, Ray) set them."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        flags = fcntl.fcntl(dup, fcntl.F_GETFL)
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    if fcntl.fcntl(dup, fcntl.F_GETFL) != flags:
        fcntl.fcntl(dup, fcntl.F_SETFL, flags)
    return sock


def endpoint(host: str, port: int) -> tuple[str, int]:
    """(ip, port) as a scan reports a peer: the store may be given by host name."""
    try:
        return socket.gethostbyname(host), port
    except OSError:
        return host, port


Conn = tuple[int, tuple[str, int], tuple[str, int]]  # (fd, local (ip, port), peer (ip, port)), ips plain


def established() -> frozenset[Conn]:
    """This process's established TCP connections now."""
    return table().established


@dataclass(frozen=True)
class Table:
    """This process's listening and established TCP sockets at one moment, from one scan (``table``).
    A join takes one before its groups and one after, and reads both kinds from each (it once took
    seven scans, each 10-30 ms on a loaded 2-core host while they went through psutil)."""

    listening: frozenset[tuple[str, int]]  # (ip, port), the ip plain
    established: frozenset[Conn]

    @property
    def ports(self) -> set[int]:
        return {port for _, port in self.listening}

    def listeners(self, ports: set[int] | list[int]) -> tuple[tuple[str, int], ...]:
        """(address, port) of the listening sockets at ``ports``, sorted."""
        wanted = set(ports)
        return tuple(sorted(pair for pair in self.listening if pair[1] in wanted))


TCP_ESTABLISHED, TCP_LISTEN = 1, 10  # tcp_info.tcpi_state (its first byte), as linux/tcp_states.h numbers them


def table() -> Table:
    """This process's TCP sockets now (one scan): each socket fd is asked for its state (``TCP_INFO``)
    and addresses through a duplicate of it, closed at once (the socket itself is left as it was).
    psutil's listing, the same answer (tests/unit/test_sockets_table.py), parses the whole host's
    TCP table for it: 13 ms in an idle Ray actor, 10-30 ms on a loaded 2-core host, against 0.5 ms
    here, and a join takes two such scans on every rank at once."""
    listening, conns = set(), set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
        except OSError:
            continue  # closed meanwhile
        sock = _dup_socket(fd)
        if sock is None:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            local = sock.getsockname()
            if state == TCP_LISTEN:
                listening.add((_plain_ip(local[0]), local[1]))
            elif state == TCP_ESTABLISHED:
                peer = sock.getpeername()
                conns.add((fd, (_plain_ip(local[0]), local[1]), (_plain_ip(peer[0]), peer[1])))
        except OSError:
            pass  # closed or reset meanwhile: not listed, as a scan a moment later would not list it
        finally:
            sock.close()
    return Table(frozenset(listening), frozenset(conns))


def shutdown_gloo_sockets(local_ports: set[int], peer_endpoints: set[tuple[str, int]], *,
                          recorded: frozenset[Conn] = frozenset(),
                          gone_endpoints: set[tuple[str, int]] = frozenset()) -> int:
    """Shut down established connections that belong to the given gloo listeners: accepted on one of
    ``local_ports`` or dialled to one of ``peer_endpoints`` (live peers); and among ``recorded`` (the
    generation's connections, see the module docstring) also those dialled to ``gone_endpoints``.
    Returns the count."""
    peers = {(_plain_ip(ip), port) for ip, port in peer_endpoints}
    gone = {(_plain_ip(ip), port) for ip, port in gone_endpoints}
    # Every gloo connection was either accepted by one of our listeners or dialled to a peer's.
    chosen = {c for c in established() if c[1][1] in local_ports or c[2] in peers}
    chosen |= {c for c in recorded if c[1][1] in local_ports or c[2] in peers | gone}
    return sum(_shut(*conn) for conn in chosen)


def _shut(fd: int, local: tuple[str, int], peer: tuple[str, int]) -> bool:
    """Shut down the connection on ``fd`` if it still joins ``local`` and ``peer``; whether it did."""
    sock = _dup_socket(fd)
    if sock is None:
        return False  # closed in the meantime
    try:
        # Re-check: the fd number may have been reused since it was listed or recorded.
        now_local, now_peer = sock.getsockname(), sock.getpeername()
        if (_plain_ip(now_local[0]), now_local[1]) != local or (_plain_ip(now_peer[0]), now_peer[1]) != peer:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()  # closes our dup only; the shutdown applies to the shared connection

