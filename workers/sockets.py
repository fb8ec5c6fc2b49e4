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
"""

from __future__ import annotations

import logging
import os
import socket

import psutil

logger = logging.getLogger(__name__)


def listening_ports() -> set[int]:
    """TCP ports this process listens on now."""
    return {
        c.laddr.port
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr
    }


def _plain_ip(ip: str) -> str:
    # TCPStore and gloo use AF_INET6 sockets, so psutil shows IPv4 peers as "::ffff:a.b.c.d".
    return ip[7:] if ip.startswith("::ffff:") else ip


def endpoint(host: str, port: int) -> tuple[str, int]:
    """(ip, port) as psutil reports a peer: the store may be given by host name."""
    try:
        return socket.gethostbyname(host), port
    except OSError:
        return host, port


def shutdown_gloo_sockets(local_ports: set[int], peer_endpoints: set[tuple[str, int]]) -> int:
    """Shut down established connections that belong to the given gloo listeners. Returns the count."""
    closed = 0
    peer_endpoints = {(_plain_ip(ip), port) for ip, port in peer_endpoints}
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.fd < 0:
            continue
        ours = conn.laddr.port in local_ports
        # Every gloo connection was either accepted by one of our listeners or dialled to a peer's.
        theirs = (_plain_ip(conn.raddr.ip), conn.raddr.port) in peer_endpoints
        if not (ours or theirs):
            continue
        try:
            sock = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            continue  # closed in the meantime
        try:
            # Re-check: the fd number may have been reused since the listing.
            local, peer = sock.getsockname(), sock.getpeername()
            if local[1] != conn.laddr.port or peer[1] != conn.raddr.port:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.close()  # closes our dup only; the shutdown applies to the shared connection
    return closed

