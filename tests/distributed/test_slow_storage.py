"""A checkpoint whose storage is slow on one rank is waited for, with every rank alive (#36 item 2).

DCP's save ends with collectives on the checkpoint group (the write results gathered to rank 0, the
metadata written, a barrier): every rank waits there for the slowest one's storage. With the group's
timeout at ``elastic.collective_timeout_s`` a rank a few seconds behind failed the save on every rank
(read by the driver as storage failing: the run stopped). The group's bound now derives from the work
(``checkpoints.writer.checkpoint_group_timeout_s``). Here rank 1's storage stalls 4x the collective
timeout in its write; the save completes on both ranks and loads back.
"""

from __future__ import annotations

import functools

import pytest

from testbed.world import run_mesh, shutdown_pool

SMALL = ("model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.n_layers=2",
         "train.global_batch_size=4", "train.micro_batch_size=1")
COLLECTIVE_TIMEOUT_S = 2.0
SLOW_ITEM_S = 4 * COLLECTIVE_TIMEOUT_S


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def _slow_storage_on_rank_1_then_save(path: str, runtime):
    """Rank 1's first DCP item write stalls ``SLOW_ITEM_S`` (a throttled disk); the last step is saved."""
    import time

    from torch.distributed.checkpoint import filesystem

    from workers.write_faults import dcp_write_function

    if runtime.groups.world_rank == 1:
        real = dcp_write_function()

        def slow_write(*args, **kwargs):
            filesystem._write_item = real  # once: the rest of the shard at full speed
            time.sleep(SLOW_ITEM_S)
            return real(*args, **kwargs)

        filesystem._write_item = slow_write

    def finish():
        runtime.save_checkpoint(path, 2)
        ack = runtime.wait_checkpoint()
        step = runtime.load_checkpoint(path)
        return {"files": sorted(ack.files), "loaded_step": step}

    return finish


@pytest.mark.timeout(300)
def test_a_save_slower_than_the_collective_timeout_on_one_rank_completes(tmp_path):
    path = str(tmp_path / "step-2")
    run = run_mesh(2, 1, 1, SMALL, steps=2, collect_params=False, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                   instrument=functools.partial(_slow_storage_on_rank_1_then_save, path), fresh=True)
    assert {rank: extra["loaded_step"] for rank, extra in run.extras.items()} == {0: 2, 1: 2}
    assert any(".metadata" in extra["files"] for extra in run.extras.values())
