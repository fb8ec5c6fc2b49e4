"""Whether a joining rank can reach what a generation needs over the network, told in one line.

Two things a rank dials while it joins: the rendezvous store (``workers.store.StoreHost``, on the
driver's node) and its peers' gloo listeners. A network that blocks either is the cluster's
configuration, not a fault to recover from elastically, so both end the join with a ``RankError``
whose kind the driver recognises (``meshspeak.rank_errors.UNREACHABLE``) and whose text names the
address and what to open; the driver then stops the run with that line (exit 2) instead of taking
the ranks for hung and shrinking the mesh (issue 35).

* The store: ``TCPStore`` retries a refused or silent port for its whole timeout
  (``elastic.collective_timeout_s``, 60 s by default) and then fails with a C++ trace. So the join
  first opens a plain TCP connection to it, retrying for at most ``STORE_REACH_S``.
* A peer: gloo's ``connectFullMesh`` fails with the peer's advertised address in its text
  (``remote=[127.0.1.1]:5543 Connection refused``); ``peer_unreachable`` turns that into the line.
  Errors a kick causes (a connection reset or closed mid-join) are not unreachability.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time

from meshspeak.rank_errors import PEER_UNREACHABLE, STORE_UNREACHABLE, RankError

STORE_REACH_S = 10.0  # how long a join retries a store it cannot connect to (a store just re-hosted answers at once)
CONNECT_TRY_S = 2.0  # one connect attempt (a firewall that drops packets answers nothing)
RETRY_S = 0.5
# gloo's words for a connection that could not be made (not one that was made and then cut).
_REFUSED = ("refused", "timeout", "timed out", "no route", "unreachable")
_REMOTE = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")
OPEN_ADVICE = ("allow TCP between the cluster's nodes (the store and gloo listen on ports the OS picks, as Ray's "
               "own workers do)")


def check_store(addr: str, port: int, where: str, *, reach_s: float = STORE_REACH_S) -> None:
    """Return once a TCP connection to the store at ``addr``:``port`` opens; ``where`` names this rank
    ("rank 3 on 10.0.0.7").

    Raises:
        RankError: (kind ``StoreUnreachable``) no connection within ``reach_s``: one line naming the
            address and what to open.
    """
    deadline = time.monotonic() + reach_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=CONNECT_TRY_S).close()
            return
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() + RETRY_S >= deadline:
            break
        time.sleep(RETRY_S)
    raise RankError(STORE_UNREACHABLE, (
        f"{where} cannot reach the rendezvous store at {addr}:{port} ({why}, for {reach_s:g}s): open TCP port "
        f"{port} on {addr} to every node of the cluster; {OPEN_ADVICE}"))


def peer_unreachable(exc: BaseException, where: str, bound_to: str | None) -> RankError | None:
    """The one-line error for a join that failed because a peer's gloo listener could not be connected
    to (``exc`` from making the groups), or None when ``exc`` is something else. ``bound_to``: the
    address this rank's gloo listens on (None: gloo's own choice)."""
    text = str(exc)
    if "connectFullMesh" not in text or not any(w in text.lower() for w in _REFUSED):
        return None
    found = _REMOTE.search(text)
    remote = f"{found.group(1)}:{found.group(2)}" if found else "a peer's address"
    why = text.split("connectFullMesh failed with", 1)[-1].strip().splitlines()[0][-160:]
    fix = OPEN_ADVICE
    if found and _loopback(found.group(1)) and not (bound_to and _loopback(bound_to)):
        fix = (f"the peer advertised the loopback address {found.group(1)} (its host name resolves there, as "
               "Debian's /etc/hosts maps it to 127.0.1.1, or its GLOO_SOCKET_IFNAME names a loopback "
               "interface): start its Ray node with --node-ip-address set to an address the other nodes reach, "
               "and leave GLOO_SOCKET_IFNAME unset (gloo then binds to that address's interface)")
    return RankError(PEER_UNREACHABLE, f"{where} could not connect to a peer's gloo listener at {remote} "
                                       f"({why}): {fix}")


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False
