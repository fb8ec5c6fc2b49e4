"""ZeRO-0 with PowerSGD (train.grad_compression="powersgd"): trains, and sends >= 4x fewer bytes.

Bytes are measured, not computed: ``StepResult.dp_bytes`` sums the ``nbytes`` of every tensor the
PowerSGD hook all-reduces (P, Q and the tensors it leaves uncompressed), and under plain ZeRO-0 of
every buffer FSDP2's all-reduce sends (workers/compression.py). The hook runs two uncompressed steps
first (``start_powerSGD_iter=2``), so compressed steps are the 3rd on.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.distributed.test_mesh_equivalence import SMALL
from tests.helpers.world import reference, run_mesh, shutdown_pool


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def _bytes(run) -> list[int]:
    """Per step, the most bytes one rank all-reduced over dp."""
    return [max(r[i].dp_bytes for r in run.results.values()) for i in range(len(run.losses))]


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
    sent, full = _bytes(compressed), _bytes(plain)
    assert sent[:2] == full[:2] and full[0] > 0, (sent, full)
    assert all(4 * s <= f for s, f in zip(sent[2:], full[2:])), (sent, full)


@pytest.mark.slow  # 2 x 200 steps of the default model at dp=2 (~40 s idle)
@pytest.mark.timeout(900)
def test_powersgd_converges_near_uncompressed_over_200_steps() -> None:
    """The built-in corpus, the default model, dp=2, AdamW at lr 1e-3: PowerSGD's final loss (mean
    of the last 10 steps, for step-to-step noise) within 5% of the uncompressed run's, and every
    compressed step's measured bytes at least 4x fewer.

    Rank 8, not 2: on this model (d_model 64) rank 2 sends ~16x fewer bytes but ended 11-15% above
    the uncompressed loss (rank 4: 6.5%; rank 8: 3.4%; rank 16: 0.7%; measured with lr 1e-3 and
    3e-3, compression starting at step 2, 20 or 50), so the 5% bound holds from rank 8 here. At
    the default lr 3e-3 rank 2 ended +28.6% here and +26.2% under torch's own DDP + powerSGD_hook
    (rank 8: +3.3%): the gap is PowerSGD's at this size, not this adapter's (docs/design.md).
    """
    steps = 200
    base = ("train.lr=1e-3", "train.warmup_steps=10", f"train.steps={steps}", "mesh.zero=0")
    plain = run_mesh(2, 1, 1, base, steps, collect_params=False, timeout=800)
    compressed = run_mesh(2, 1, 1, (*base, 'train.grad_compression="powersgd"', "train.powersgd_rank=8"),
                          steps, collect_params=False, timeout=800)
    final_plain, final_psgd = np.mean(plain.losses[-10:]), np.mean(compressed.losses[-10:])
    assert abs(final_psgd - final_plain) <= 0.05 * final_plain, (final_psgd, final_plain)
    sent, full = _bytes(compressed), _bytes(plain)
    assert all(4 * s <= f for s, f in zip(sent[2:], full[2:])), (sent[:5], full[:5])
    print(f"final loss plain {final_plain:.4f} powersgd {final_psgd:.4f}; bytes/step {full[-1]} -> {sent[-1]} "
          f"({full[-1] / sent[-1]:.1f}x)")
