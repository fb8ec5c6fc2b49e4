"""Which local network interface a rank's gloo groups (and NCCL's sockets) bind to: the one that carries
Ray's node address, whatever this host's name resolves to.

Why: gloo picks the address it listens on and advertises to its peers from the host name
(``gethostname()`` resolved through /etc/hosts) unless ``GLOO_SOCKET_IFNAME`` names an interface.
Debian and Ubuntu map the host name to 127.0.1.1, so a rank there advertised a loopback address and
its peers on other hosts could not connect (``Gloo connectFullMesh failed … remote=[127.0.1.1]:PORT
Connection refused``, issue 35). Ray's node address (``ray.util.get_node_ip_address()``) is the one
its other nodes already reach this host at, so the interface holding it is the one to bind.

How: gloo reads ``GLOO_SOCKET_IFNAME`` each time a group is constructed (measured on torch 2.13: a
group made with it set listens on that interface's address, the next one made after it is unset on
the host name's again), so ``bound_groups`` sets it only around the generation's group creation.
The per-group device (``ProcessGroupGloo.create_device(hostname=...)`` in ``_Options._devices``)
would be more exact, but ``init_process_group``/``new_group`` build gloo groups with the default
device whatever ``pg_options`` says (distributed_c10d's gloo branch ignores it), and a backend
registered under another name would lose torch's many ``"gloo"`` special cases (DCP, object
collectives). A user's own ``GLOO_SOCKET_IFNAME`` wins: they chose. NCCL reads ``NCCL_SOCKET_IFNAME``
once per process at its first communicator; ``nccl_interface`` sets it (unless set) before that.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from workers import sockets

logger = logging.getLogger(__name__)

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"


def interface_of(ip: str, addresses: dict | None = None) -> str | None:
    """The name of the local interface that holds address ``ip`` (``addresses``: as
    ``psutil.net_if_addrs()`` returns them, read now when None); None when no interface has it."""
    wanted = ip.split("%")[0]
    table = psutil.net_if_addrs() if addresses is None else addresses
    for name, addrs in table.items():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and addr.address.split("%")[0] == wanted:
                return name
    return None


def gloo_interface(bind_ip: str | None) -> str | None:
    """The interface gloo should bind to for ``bind_ip`` (None: leave gloo's own choice): none when
    the user set ``GLOO_SOCKET_IFNAME`` or no interface holds the address (logged: then gloo falls
    back to the host name's address, as it did before)."""
    if not bind_ip or os.environ.get(GLOO_IFNAME):
        return None
    name = interface_of(bind_ip)
    if name is None:
        logger.warning("Ray's node address %s is on no interface of this host: gloo binds to what the host "
                       "name %s resolves to; set %s if peers cannot connect", bind_ip, socket.gethostname(),
                       GLOO_IFNAME)
    return name


@contextmanager
def bound_groups(bind_ip: str | None) -> Iterator[str | None]:
    """Within: gloo groups made now listen on the interface holding ``bind_ip`` (see the module
    docstring); yields that interface's name, or None where gloo keeps its own choice."""
    name = gloo_interface(bind_ip)
    if name is None:
        yield None
        return
    os.environ[GLOO_IFNAME] = name
    try:
        yield name
    finally:
        os.environ.pop(GLOO_IFNAME, None)


def nccl_interface(bind_ip: str | None) -> None:
    """Point NCCL's bootstrap and socket transport at the interface holding ``bind_ip`` (before the
    process's first communicator), unless the user set ``NCCL_SOCKET_IFNAME``."""
    if not bind_ip or os.environ.get(NCCL_IFNAME):
        return
    name = interface_of(bind_ip)
    if name is not None:
        os.environ[NCCL_IFNAME] = name


def listeners(ports: set[int] | list[int]) -> tuple[tuple[str, int], ...]:
    """(address, port) of this process's listening sockets at ``ports``, sorted (IPv4-mapped IPv6
    shown plain): what peers dial, so what a kick matches their connections by."""
    return sockets.table().listeners(ports)


def listener_addresses(ports: set[int] | list[int]) -> set[str]:
    """The local addresses this process listens on at ``ports``."""
    return {ip for ip, _ in listeners(ports)}
