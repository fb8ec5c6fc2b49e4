"""The driver never imports torch (issue 35): neither by importing what it ships to the ranks (the
actor classes) nor by unpickling what a rank hands it (an error raised in a rank arrives as a
``RankError``: text, never the torch object). A driver whose working directory was replaced under it
(`ray job submit` to a 0-CPU head on one machine) died importing torch: MKL's fatal error, exit 2.
The run-time guard (a whole run in a driver that may not import torch) is tests/ray/test_driver_torch_free.py."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from meshspeak.rank_errors import RankError, kind_of


def test_importing_the_actor_classes_imports_no_torch():
    code = ("import sys\nimport workers.actor, workers.store, orchestrator.launch, orchestrator.cluster.worker_group\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_torch_error_raised_in_a_rank_call_reaches_the_driver_as_text():
    import torch.distributed as dist

    from workers.rank_methods import plain

    class Rank:
        _train_threads: set = set()

        def join(self, addr: str) -> None:
            raise dist.DistNetworkError(f"failed to connect to {addr}")

    join = plain(Rank.join)
    with pytest.raises(RankError) as info:
        join(Rank(), "10.0.0.9:1234")
    err = info.value
    assert (kind_of(err), str(err)) == ("DistNetworkError", "failed to connect to 10.0.0.9:1234")
    assert isinstance(err.__cause__, dist.DistNetworkError)  # the rank's log keeps the original
    raw = pickle.dumps(err)
    assert b"torch" not in raw  # unpickling it cannot import torch
    back = pickle.loads(raw)
    assert (kind_of(back), str(back)) == ("DistNetworkError", "failed to connect to 10.0.0.9:1234")


def test_the_driver_line_names_the_rank_side_class():
    from ray.exceptions import RayTaskError

    from orchestrator.cluster.ray_calls import error_line

    cause = RankError("DeviceError", "resources.use_gpu: no GPU")
    wrapped = RayTaskError("RankActor.join_generation", "tb", cause,
                           proctitle="ray::RankActor.join_generation()").as_instanceof_cause()
    assert error_line(wrapped) == "DeviceError: resources.use_gpu: no GPU"
    assert RankError.of(cause) is cause
