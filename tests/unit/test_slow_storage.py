"""testbed/slow_storage.py: the throttled filesystem works as a data location and a checkpoint
location, paced to its rate (asserted on the seconds it asked to sleep, not on a clock)."""

from __future__ import annotations

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from checkpoints.reader import load_training_state
from checkpoints.state import training_state
from checkpoints.writer import AsyncCheckpointWriter
from meshdata import microbatch_tokens, open_source
from testbed.slow_storage import PROTOCOL, ThrottledFileSystem, read_throttled, register

RATE = 5e7  # fast enough for a unit test; the pacing asked for is what is checked


def _fs(**options) -> ThrottledFileSystem:
    """The instance fsspec hands out for these options (the code under test asks with none: 1 MB/s)."""
    register()
    return fsspec.filesystem(PROTOCOL, **options)


def test_every_byte_is_paced_to_the_rate(tmp_path):
    fs = _fs(bytes_per_s=RATE)
    before_s, before_b = fs.slept_s, fs.moved_bytes
    payload = bytes(range(256)) * 400
    with fsspec.open(f"{PROTOCOL}://{tmp_path}/f.bin", "wb", bytes_per_s=RATE) as fh:
        fh.write(payload)
    assert fs.cat_file(f"{PROTOCOL}://{tmp_path}/f.bin") == payload
    assert fs.moved_bytes - before_b == 2 * len(payload)
    assert abs((fs.slept_s - before_s) - 2 * len(payload) / RATE) < 1e-9
    assert read_throttled(str(tmp_path), bytes_per_s=RATE) == len(payload)


def test_a_data_path_on_throttled_storage_reads_as_the_local_one(tmp_path):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 300, rng.integers(1, 50)).tolist() for _ in range(60)]
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}),
                   str(tmp_path / "d" / "part-0.parquet"), row_group_size=8)
    fs = _fs()
    moved = fs.moved_bytes
    slow, local = open_source(f"{PROTOCOL}://{tmp_path / 'd'}"), open_source(str(tmp_path / "d"))
    ids = rng.permutation(local.num_samples(9))
    for a, b in zip(microbatch_tokens(slow, ids, 9), microbatch_tokens(local, ids, 9)):
        np.testing.assert_array_equal(a, b)
    assert fs.moved_bytes > moved  # the footer and row groups came through the throttle


def test_a_checkpoint_on_throttled_storage_round_trips(tmp_path):
    fs = _fs()
    moved = fs.moved_bytes
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    uri = f"{PROTOCOL}://{tmp_path}/ckpt/step-00000001"
    writer = AsyncCheckpointWriter()
    writer.save(training_state(model, opt, step=1, data_cursor=8), uri).result(timeout=60)
    writer.close()
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    assert load_training_state(uri, other, other_opt).step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert fs.moved_bytes > moved and (tmp_path / "ckpt" / "step-00000001" / ".metadata").exists()
