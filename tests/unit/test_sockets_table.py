"""One scan of this process's TCP sockets gives both what a join records for the kick — the listeners
its groups opened and the connections they made — (workers/sockets.py ``Table``), instead of a scan
per question (a join took seven, 10-30 ms each on a loaded 2-core host)."""

from __future__ import annotations

import socket

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
