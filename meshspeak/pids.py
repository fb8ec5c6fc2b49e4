"""Which pid namespace a process is in (``/proc/<pid>/ns/pid``'s inode).

A pid means a process only inside its namespace: two Ray nodes on one host (containers, pods) each
number their own, and a driver in a container beside a node's raylet may share the node's network
but not its processes. The driver signals or watches an actor's process by pid (``WorkerGroup``'s
``kill_now``, ``exited``, ``ExitWatch``) only when the actor reported the driver's own namespace as
its own in its ``ping`` answer, not merely the same Ray node. Without ``/proc`` (macOS) every process
of the host shares the one numbering: 0 on both sides.
"""

from __future__ import annotations

import os


def pid_namespace(pid: int | str = "self") -> int:
    """The pid namespace's inode for process ``pid`` (this process by default); 0 where there is none
    to read."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0
