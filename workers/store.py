"""StoreHost: a tiny Ray actor that hosts the TCPStore every generation rendezvouses through.

It is not a rank, so it survives any rank's death, and it lives beside the driver (which must not
import torch.distributed itself). Each generation uses its own key prefix (see workers/groups.py).
"""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0, max_concurrency=2)
class StoreHost:
    def __init__(self) -> None:
        import torch.distributed as dist

        # wait_for_workers=False: ranks come and go across generations; the store never waits for them.
        self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self._addr = ray.util.get_node_ip_address()

    def address(self) -> tuple[str, int]:
        return self._addr, self._store.port
