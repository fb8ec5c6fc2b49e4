"""The "ckpt_write" fault injections of ``RankActor.arm_fault``: a signal, or a stall, inside DCP's
shard write.

Test hooks only: a rank is made to die (or stop) after the first item of its next shard is on
disk, so the shard file is partial and the rank never acks it (tests of uncommitted checkpoints);
or its write stalls as on a slow storage (tests that a slow but live save is waited for).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def dcp_write_function():
    """DCP's per-item file write (private; looked up so a torch upgrade fails the fault test loudly)."""
    from torch.distributed.checkpoint import filesystem

    if not callable(getattr(filesystem, "_write_item", None)):
        raise RuntimeError("torch.distributed.checkpoint.filesystem._write_item is gone: update the "
                           "ckpt_write fault injection in workers/write_faults.py")
    return filesystem._write_item


def die_inside_next_dcp_write(sig: int) -> None:
    """Make this process receive ``sig`` on DCP's writer thread, after the first item of the next
    shard is on disk: the shard file is then partial and the rank never acks it."""
    from torch.distributed.checkpoint import filesystem

    real = dcp_write_function()

    def write_then_die(*args, **kwargs):
        result = real(*args, **kwargs)
        filesystem._write_item = real
        logger.warning("fault injection: signal %d inside the checkpoint write", sig)
        os.kill(os.getpid(), sig)
        return result

    filesystem._write_item = write_then_die


def stall_inside_next_dcp_write(seconds: float) -> None:
    """Make this rank's next shard write stall ``seconds`` before its first item (a throttled disk or
    bucket), on DCP's writer thread: training goes on, the save's collectives wait for this rank."""
    import time

    from torch.distributed.checkpoint import filesystem

    real = dcp_write_function()

    def stall_then_write(*args, **kwargs):
        filesystem._write_item = real
        logger.warning("fault injection: the checkpoint write stalls %.1f s (slow storage)", seconds)
        time.sleep(seconds)
        return real(*args, **kwargs)

    filesystem._write_item = stall_then_write
