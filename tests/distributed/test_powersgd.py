"""ZeRO-0 with PowerSGD (train.grad_compression="powersgd"): trains, and sends >= 4x fewer bytes.

Bytes are measured, not computed: ``StepResult.dp_bytes`` sums the ``nbytes`` of every tensor the
PowerSGD hook all-reduces (P, Q and the tensors it leaves uncompressed), and under plain ZeRO-0 of
every buffer FSDP2's all-reduce sends (workers/compression.py). The hook runs
``train.powersgd_plain_steps`` (default 2) uncompressed steps first, so compressed steps are the 3rd on.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.mesh_cases import SMALL
from testbed.reference import reference
from testbed.world import run_mesh, shutdown_pool


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", [(2, 1, 1), (2, 1, 2)], ids=["dp2", "dp2-tp2"])
def test_powersgd_trains_and_sends_4x_fewer_bytes(shape) -> None:
    steps = 6
    plain = run_mesh(*shape, (*SMALL, "mesh.zero=0"), steps, collect_params=False)
    compressed = run_mesh(*shape, (*SMALL, "mesh.zero=0", 'train.grad_compression="powersgd"',
                                   "train.powersgd_rank=2"), steps, collect_params=False)
    ref = reference(SMALL, steps)
    # The first two steps are plain all-reduces (the same math as one process); later ones are lossy.
    np.testing.assert_allclose(compressed.losses[:2], ref.losses[:2], rtol=1e-5, atol=0)
    assert all(math.isfinite(x) for x in compressed.losses)
    np.testing.assert_allclose(compressed.losses, ref.losses, rtol=5e-2, atol=0)
    sent, full = compressed.dp_bytes_per_step(), plain.dp_bytes_per_step()
    assert sent[:2] == full[:2] and full[0] > 0, (sent, full)
    assert all(4 * s <= f for s, f in zip(sent[2:], full[2:])), (sent, full)


@pytest.mark.timeout(240)
def test_powersgd_plain_steps_defers_compression() -> None:
    """``train.powersgd_plain_steps=4``: steps 1-4 are plain all-reduces (one process's math, the full
    bytes), steps 5-6 compressed."""
    steps = 6
    run = run_mesh(2, 1, 1, (*SMALL, "mesh.zero=0", 'train.grad_compression="powersgd"', "train.powersgd_rank=2",
                             "train.powersgd_plain_steps=4"), steps, collect_params=False)
    np.testing.assert_allclose(run.losses[:4], reference(SMALL, steps).losses[:4], rtol=1e-5, atol=0)
    sent = run.dp_bytes_per_step()
    assert sent[:4] == [sent[0]] * 4 and all(4 * s <= sent[0] for s in sent[4:]), sent


@pytest.mark.slow  # 2 x 200 steps of the default model at dp=2 per case (~40 s idle)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lr,rank", [("3e-4", 2), ("1e-3", 8)], ids=["lr3e-4-rank2", "lr1e-3-rank8"])
def test_powersgd_converges_near_uncompressed_over_200_steps(lr, rank) -> None:
    """The built-in corpus, the default model (d_model 64, 4 layers, seq 64, global batch 8), dp=2,
    AdamW: PowerSGD's final loss (mean of the last 10 steps, for step-to-step noise) within 5% of the
    uncompressed run's, and every compressed step's measured bytes at least 4x fewer.

    Rank 2 (21.7x fewer bytes) holds the 5% only at lr 3e-4 (measured +2.5% at seeds 0 and 1), where
    the uncompressed run itself ends at ~3.1 nats/byte. The further the uncompressed run gets in 200
    steps, the wider rank 2's gap (bench/powersgd_convergence.py, docs/design.md PowerSGD): lr 5e-4
    +6.3%, lr 1e-3 +15%, lr 3e-3 +30%; d_model 128 +12% at lr 3e-4 and +40% at 1e-3; global batch 32
    x seq 128 +32% at 1e-3. torch's own DDP + powerSGD_hook shows the same gap (+26% at lr 3e-3), so
    it is PowerSGD's with AdamW here, not this adapter's. At lr 1e-3 the 5% needs rank 8 (5.6x fewer
    bytes).
    """
    steps = 200
    base = (f"train.lr={lr}", "train.warmup_steps=10", f"train.steps={steps}", "mesh.zero=0")
    plain = run_mesh(2, 1, 1, base, steps, collect_params=False, timeout=800)
    compressed = run_mesh(2, 1, 1, (*base, 'train.grad_compression="powersgd"', f"train.powersgd_rank={rank}"),
                          steps, collect_params=False, timeout=800)
    final_plain, final_psgd = np.mean(plain.losses[-10:]), np.mean(compressed.losses[-10:])
    assert abs(final_psgd - final_plain) <= 0.05 * final_plain, (final_psgd, final_plain)
    sent, full = compressed.dp_bytes_per_step(), plain.dp_bytes_per_step()
    assert all(4 * s <= f for s, f in zip(sent[2:], full[2:])), (sent[:5], full[:5])
    print(f"final loss plain {final_plain:.4f} powersgd {final_psgd:.4f}; bytes/step {full[-1]} -> {sent[-1]} "
          f"({full[-1] / sent[-1]:.1f}x)")
