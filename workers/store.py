"""StoreHost: a tiny Ray actor that hosts the TCPStore every generation rendezvouses through.

It is not a rank, so it survives any rank's death; ``orchestrator.cluster.store_provider`` pins it to the
driver's node and re-hosts it if it dies anyway. Each generation uses its own key prefix (see
workers/groups.py).

The store has no authentication, so it listens on one address only: this node's own address, or
loopback when the whole job is on this machine, and never a public (globally routable) address
(``bind_host``). TCPStore itself always binds the wildcard address (``::``) whatever host it is
given, so we bind the listening socket ourselves and hand it over (``master_listen_fd``;
docs/design.md, F18). Its keys carry a per-run secret (``messages.JoinSpec.store_secret``), but a
client that reaches the port can list them (``TCPStore.list_keys``): the network is the boundary
(README, Trust boundary).
"""

from __future__ import annotations

import ipaddress
import socket

import ray

from meshspeak.rank_errors import RankError
from workers.heavy_imports import collector_paused


def listen_on(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (an IPv4 or IPv6 literal), port chosen by the OS."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_host(node_ip: str, loopback: bool) -> str:
    """The address the store listens on: loopback, or the node's own address if it is not public.

    Raises:
        RuntimeError: the node's address is globally routable (one line, for the driver's report).
    """
    if loopback:
        return "::1" if ":" in node_ip else "127.0.0.1"
    if ipaddress.ip_address(node_ip.split("%")[0]).is_global:
        raise RuntimeError(f"the rendezvous store has no authentication and Ray's node address {node_ip} is "
                           "public: run the cluster on a private network (ray start --node-ip-address)")
    return node_ip


@ray.remote(num_cpus=0, max_concurrency=2)
class StoreHost:
    def __init__(self, loopback: bool = False) -> None:
        try:
            with collector_paused():  # the start imports torch (workers/heavy_imports.py)
                self._start(loopback)
        except Exception as exc:  # text only: the driver never unpickles a torch error (meshspeak/rank_errors.py)
            raise RankError.of(exc) from exc

    def _start(self, loopback: bool) -> None:
        import torch.distributed as dist

        host = bind_host(ray.util.get_node_ip_address(), loopback)
        sock = listen_on(host)
        port = sock.getsockname()[1]
        # wait_for_workers=False: ranks come and go across generations; the store never waits for them.
        # The store takes the fd over (it closes it on destruction), so detach it from the socket.
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    master_listen_fd=sock.detach())
        self._addr = (host, port)
        self._node_id = ray.get_runtime_context().get_node_id()

    def address(self) -> tuple[str, int]:
        return self._addr

    def where(self) -> tuple[str, tuple[str, int]]:
        """(node id, address): the provider's health check, and where tests look."""
        return self._node_id, self._addr
