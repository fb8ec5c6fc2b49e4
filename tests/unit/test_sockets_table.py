"""One scan of this process's TCP sockets gives both what a join records for the kick — the listeners
its groups opened and the connections they made — (workers/sockets.py ``Table``), instead of a scan
per question (a join took seven, 10-30 ms each on a loaded 2-core host); the scan reads each socket
fd's own state, and lists what psutil's parse of the host's TCP table lists."""

from __future__ import annotations

import fcntl
import os
import socket

import psutil

from workers import bind, sockets


def test_one_table_holds_the_listener_and_both_ends_of_a_connection():
    before = sockets.table()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    try:
        after = sockets.table()
        assert port in after.ports and port not in before.ports
        assert after.listeners(after.ports - before.ports) == (("127.0.0.1", port),)
        assert after.listeners([port]) == bind.listeners([port])  # the same answer as a scan of its own
        opened = {(local, peer) for _, local, peer in after.established - before.established}
        client_end = client.getsockname()[:2]
        assert {(client_end, ("127.0.0.1", port)), (("127.0.0.1", port), client_end)} <= opened
        fds = {fd for fd, _, _ in after.established - before.established}
        assert {client.fileno(), accepted.fileno()} <= fds
    finally:
        for s in (accepted, client, server):
            s.close()


def _psutil_table() -> sockets.Table:
    """The oracle: psutil's listing of this process's TCP sockets (the scan the module once made)."""
    listening, conns = set(), set()
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr:
            listening.add((sockets._plain_ip(c.laddr.ip), c.laddr.port))
        elif c.status == psutil.CONN_ESTABLISHED and c.raddr and c.fd >= 0:
            conns.add((c.fd, (sockets._plain_ip(c.laddr.ip), c.laddr.port),
                       (sockets._plain_ip(c.raddr.ip), c.raddr.port)))
    return sockets.Table(frozenset(listening), frozenset(conns))


def test_the_scan_lists_what_psutil_lists():
    """IPv4 and IPv6 (v4-mapped, as TCPStore's and gloo's) listeners and connections, a UDP socket, a
    closed-by-peer connection (CLOSE_WAIT: neither) and a unix socket pair (none of them TCP)."""
    v4 = socket.create_server(("127.0.0.1", 0))
    v6 = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    c4 = socket.create_connection(("127.0.0.1", v4.getsockname()[1]))
    c6 = socket.create_connection(("127.0.0.1", v6.getsockname()[1]))
    a4, _ = v4.accept()
    a6, _ = v6.accept()
    half = socket.create_connection(("127.0.0.1", v4.getsockname()[1]))
    gone, _ = v4.accept()
    half.close()  # ``gone`` is left in CLOSE_WAIT
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    pair = socket.socketpair()
    try:
        scan = sockets.table()
        assert scan == _psutil_table()
        assert ("127.0.0.1", v4.getsockname()[1]) in scan.listening and v6.getsockname()[1] in scan.ports
        fds = {fd for fd, _, _ in scan.established}
        assert {c4.fileno(), c6.fileno(), a4.fileno(), a6.fileno()} <= fds and gone.fileno() not in fds
    finally:
        for s in (v4, v6, c4, c6, a4, a6, gone, udp, *pair):
            s.close()


def test_a_scan_leaves_every_socket_s_flags_as_they_were():
    """A socket object made on a duplicate fd sets O_NONBLOCK on the shared open file where a default
    timeout is set (``socket.setdefaulttimeout``): gloo's and the store's blocking sockets would then
    fail reads with EAGAIN. The scan and the kick's shutdown put the flags back."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
    accepted, _ = server.accept()
    for s in (server, client, accepted):
        s.setblocking(True)
    before = {s.fileno(): fcntl.fcntl(s.fileno(), fcntl.F_GETFL) for s in (server, client, accepted)}
    socket.setdefaulttimeout(5.0)
    try:
        scan = sockets.table()
        assert client.fileno() in {fd for fd, _, _ in scan.established}
        assert {fd: fcntl.fcntl(fd, fcntl.F_GETFL) for fd in before} == before
        assert all(flags & os.O_NONBLOCK == 0 for flags in before.values())
    finally:
        socket.setdefaulttimeout(None)
        for s in (accepted, client, server):
            s.close()
