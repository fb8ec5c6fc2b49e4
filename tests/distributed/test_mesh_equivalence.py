"""Every mesh layout and pipeline schedule trains exactly like one process.

Each test trains 10 fp32 steps on a local (dp, pp, tp) gloo mesh (``testbed.world.run_mesh``:
``build_process_groups`` + ``RankRuntime`` + the driver's schedule, ranks kept in a shared worker pool)
and compares with the single-process ``ReferenceTrainer`` on the same config: every step's global loss
within 1e-5 relative, and every final parameter (same name set) within 1e-5 absolute. A small model
(d_model 32, seq_len 32, 4 layers) keeps a TP step well under a second on 2 cores.

The schedules need: n_layers >= pp * virtual_stages (4 >= 2 * 2) and, for 1F1B and interleaved,
microbatches per replica >= pp and (interleaved) divisible by pp; with global_batch_size 8 and
micro_batch_size 1 that is 8 microbatches at dp=1 and 4 at dp=2.

The last tests check the harness itself: a rank that raises, dies or hangs ends the run with a
``MeshRunError`` (and the rank's traceback) instead of leaving the test blocked in a collective. They
check *what* ended the wait (``MeshRunError.ended_by``) and that the healthy rank, blocked in a
collective with a 60 s timeout, had not timed out by then (it is not among the ranks that raised),
rather than timing the run.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from orchestrator.plan.mesh_plan import describe, make_plan
from testbed.mesh_cases import SMALL, STEPS, mesh_id
from testbed.reference import assert_matches_reference, reference
from testbed.world import MeshRunError, mesh_config, run_mesh, shutdown_pool

SCHEDULE_BATCH = ("train.global_batch_size=8", "train.micro_batch_size=1")

# (1, 2, 2) is in the slow run only (~9 s, for suite time): pipeline + TP without FSDP2 is the (2, 2, 2)
# case's pipeline and TP, and TP without FSDP2 the (1, 1, 2) case's.
ONE_F_ONE_B = [(2, 1, 1), (1, 2, 1), (4, 1, 1), (1, 1, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1),
               pytest.param((1, 2, 2), marks=pytest.mark.slow), (2, 2, 2)]


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    """The ranks are re-used across this module's tests; stop them when it is done."""
    yield
    shutdown_pool()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", ONE_F_ONE_B, ids=mesh_id)
def test_1f1b_matches_reference(shape: tuple[int, int, int]) -> None:
    dp, pp, tp = shape
    run = run_mesh(dp, pp, tp, SMALL, STEPS, schedule="1f1b")
    assert len(run.layers_per_stage) == pp and sum(run.layers_per_stage) == 4
    assert_matches_reference(run.losses, run.params, reference(SMALL, STEPS))


@pytest.mark.timeout(240)
# At (2, 2, 2) both are in the slow run only (~20 s and ~30 s, for suite time): GPipe and interleaved
# 1F1B stay in the default run at (1, 2, 1), and schedules at (2, 2, 2) there are 1F1B (above) and
# zero-bubble V, which runs two virtual stages per rank as interleaved 1F1B does (below).
@pytest.mark.parametrize(("shape", "schedule", "virtual_stages"), [
    pytest.param((1, 2, 1), "gpipe", 1, id="dp1-pp2-tp1-gpipe"),
    pytest.param((1, 2, 1), "interleaved_1f1b", 2, id="dp1-pp2-tp1-interleaved"),
    pytest.param((2, 2, 2), "gpipe", 1, id="dp2-pp2-tp2-gpipe", marks=pytest.mark.slow),
    pytest.param((2, 2, 2), "interleaved_1f1b", 2, id="dp2-pp2-tp2-interleaved", marks=pytest.mark.slow),
])
def test_schedule_matches_reference(shape: tuple[int, int, int], schedule: str, virtual_stages: int) -> None:
    dp, pp, tp = shape
    overrides = SMALL + SCHEDULE_BATCH
    run = run_mesh(dp, pp, tp, overrides, STEPS, schedule=schedule, virtual_stages=virtual_stages)
    assert len(run.layers_per_stage) == pp * virtual_stages
    assert run.microbatches == 8 // dp
    assert_matches_reference(run.losses, run.params, reference(overrides, STEPS))


# Zero-bubble schedules (split I/W backwards, meshspeak/zero_bubble.py): both at (1,2,1) and (1,4,1),
# and zbv at (2,2,2), in the default run, covering FSDP2 over dp with TP and the V placement (zb-h1 at
# (2,2,2) is slow: ~30 s, for suite time); zbv at pp=4 holds 8 stages. The other slow three cover the other
# data-parallel plans (meshspeak/dp_plan.py) FSDP2's by-hand reduction after a stage's last W must
# serve: ZeRO-0 (HSDP all-reduce), ZeRO-1 (kept gathered) and HSDP ZeRO-3.
ZERO_BUBBLE = [
    pytest.param("zb-h1", (1, 2, 1), (), id="zb-h1-dp1-pp2-tp1"),
    pytest.param("zb-h1", (1, 4, 1), (), id="zb-h1-dp1-pp4-tp1"),
    # slow (~30 s): zbv at (2,2,2) keeps FSDP2 over dp with TP under split backwards in the default run
    pytest.param("zb-h1", (2, 2, 2), (), id="zb-h1-dp2-pp2-tp2", marks=pytest.mark.slow),
    pytest.param("zbv", (1, 2, 1), (), id="zbv-dp1-pp2-tp1"),
    pytest.param("zbv", (1, 4, 1), (), id="zbv-dp1-pp4-tp1"),
    pytest.param("zbv", (2, 2, 2), (), id="zbv-dp2-pp2-tp2"),
    pytest.param("zb-h1", (2, 2, 1), ("mesh.zero=0",), id="zb-h1-dp2-pp2-tp1-zero0", marks=pytest.mark.slow),
    pytest.param("zbv", (2, 2, 2), ("mesh.zero=1",), id="zbv-dp2-pp2-tp2-zero1", marks=pytest.mark.slow),
    pytest.param("zb-h1", (4, 2, 1), ("mesh.dp_replicate=2",), id="zb-h1-dp4-pp2-tp1-hsdp",
                 marks=pytest.mark.slow),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("schedule", "shape", "extra"), ZERO_BUBBLE)
def test_zero_bubble_schedule_matches_reference(schedule: str, shape: tuple[int, int, int], extra) -> None:
    """Input and weight gradients computed apart (I now, W later; FSDP2 reduces after the last W)
    train exactly like one process, on the loop placement and on zbv's V (in-memory hand-offs)."""
    dp, pp, tp = shape
    virtual_stages = 2 if schedule == "zbv" else 1
    layers = 8 if pp * virtual_stages > 4 else 4
    overrides = (*SMALL[:-1], f"model.n_layers={layers}", *SCHEDULE_BATCH, *extra)
    run = run_mesh(dp, pp, tp, overrides, STEPS, schedule=schedule, virtual_stages=virtual_stages)
    assert len(run.layers_per_stage) == pp * virtual_stages
    assert any(a.op.value == "W" for rank in run.actions for a in rank)
    assert_matches_reference(run.losses, run.params, reference(overrides, STEPS))


def count_fsdp_units(runtime):
    """An ``instrument`` hook: the number of FSDP units (parameter groups) of each stage on this rank."""
    from torch.distributed.fsdp import FSDPModule

    # Modules sharded together (fully_shard on a list) share one state: count distinct groups.
    counts = [
        len({id(group) for m in stage.module.modules() if isinstance(m, FSDPModule)
             for group in m._get_fsdp_state()._fsdp_param_groups})
        for stage in runtime.executor.stages.values()
    ]  # fmt: skip
    return lambda: counts


# A SMALL block holds ~66 KB of fp32 parameters (~33 KB per tp shard); 0.1 MB units pair them at tp=1.
FSDP_UNIT_CASES = [
    ((2, 1, 1), 3, 0, 5),  # one unit per block + the root (TorchTitan's wrapping)
    ((2, 1, 1), 3, 0.1, 3),  # blocks paired + the root
    ((2, 1, 1), 2, 0.1, 3),
    ((2, 1, 1), 3, 25, 1),  # the default: 4 small blocks all in the root unit
    # per stage: 2 blocks + the root; slow (~18 s): the units' regrouping is the (2, 1, 1) cases'
    pytest.param((2, 2, 2), 3, 0, 3, marks=pytest.mark.slow),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("shape", "zero", "unit_mb", "units"), FSDP_UNIT_CASES,
                         ids=[f"{mesh_id(c[0])}-zero{c[1]}-unit{c[2]}MB"
                              for c in (getattr(case, "values", case) for case in FSDP_UNIT_CASES)])
def test_fsdp_unit_size_changes_collectives_not_math(shape, zero, unit_mb, units) -> None:
    """``mesh.fsdp_unit_mb`` regroups blocks into FSDP units; the training stays the reference's."""
    dp, pp, tp = shape
    overrides = (*SMALL, f"mesh.zero={zero}", f"mesh.fsdp_unit_mb={unit_mb}")
    run = run_mesh(dp, pp, tp, overrides, STEPS, instrument=count_fsdp_units)
    assert all(counts == [units] for counts in run.extras.values()), run.extras
    # `elastimesh plan` shows the same units (its block units + the root) for every stage.
    cfg = mesh_config(dp, pp, tp, overrides)
    assert [len(s["fsdp_units"]) + 1 for s in describe(cfg, make_plan(cfg))["stages"]] == [units] * pp
    assert_matches_reference(run.losses, run.params, reference(SMALL, STEPS))


@pytest.mark.timeout(180)
def test_bf16_smoke_close_to_fp32() -> None:
    """bf16 compute (FSDP2 mixed precision, fp32 master weights and reductions) at dp=2 x tp=2."""
    steps = 3
    run = run_mesh(2, 1, 2, SMALL + ('train.dtype="bfloat16"',), steps, collect_params=False)
    ref = reference(SMALL, steps)
    assert all(math.isfinite(loss) for loss in run.losses), run.losses
    np.testing.assert_allclose(run.losses, ref.losses, rtol=0, atol=2e-2, err_msg="bf16 loss vs fp32 reference")
    assert run.losses != list(ref.losses), "bf16 run matched fp32 bit for bit: is bf16 actually used?"


def fail_on_rank_one(runtime):
    """An ``instrument`` hook that raises on world rank 1 after the runtime is built."""
    if runtime.groups.world_rank == 1:
        raise ValueError("injected failure on rank 1")
    return None


def exit_on_rank_one(runtime):
    """An ``instrument`` hook whose rank 1 process dies without a word (as a crash would)."""
    if runtime.groups.world_rank == 1:
        os._exit(3)
    return None


def abort_on_rank_one(runtime):
    """An ``instrument`` hook whose rank 1 aborts as a native heap check would (SIGABRT)."""
    if runtime.groups.world_rank == 1:
        os.abort()
    return None


def hang_on_rank_one(runtime):
    """An ``instrument`` hook whose rank 1 never comes back."""
    if runtime.groups.world_rank == 1:
        time.sleep(600)
    return None


@pytest.mark.timeout(120)
def test_harness_reports_a_failing_rank_without_hanging() -> None:
    """A rank that raises ends the run with its traceback (rank 0 is stuck in a barrier)."""
    with pytest.raises(MeshRunError, match="injected failure on rank 1") as info:
        run_mesh(2, 1, 1, SMALL, 1, instrument=fail_on_rank_one, collective_timeout_s=60, fresh=True)
    assert "ranks raised: [1]" in str(info.value)
    assert "Traceback" in str(info.value)
    # Rank 1's failure ended the wait; rank 0 was still blocked, before its collective timeout.
    error = info.value
    assert (error.ended_by, error.raised, error.missing, error.died) == ("raised", (1,), (0,), {})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("hook", "run_timeout", "expected", "ended_by"),
    [(exit_on_rank_one, 120.0, r"ranks died \(rank -> exit code\): \{1: 3\}", "died"),
     # slow: it waits out the 15 s bound; the harness's kill itself is the "dies" case's
     pytest.param(hang_on_rank_one, 15.0, r"no result from ranks \[0, 1\]", "timeout", marks=pytest.mark.slow)],
    ids=["dies", "hangs"],
)  # fmt: skip
def test_harness_kills_the_world_when_a_rank_dies_or_hangs(hook, run_timeout: float, expected: str,
                                                            ended_by: str) -> None:
    """A death ends the wait at once; a hang ends it at the run's timeout (15 s), which is shorter than
    the collective timeout (60 s): rank 0, blocked in a collective with the hung rank, never raised."""
    with pytest.raises(MeshRunError, match=expected) as info:
        run_mesh(2, 1, 1, SMALL, 1, timeout=run_timeout, instrument=hook, collective_timeout_s=60, fresh=True)
    error = info.value
    assert error.ended_by == ended_by
    if ended_by == "died":
        assert error.died == {1: 3}
    else:
        assert error.raised == () and error.missing == (0, 1)


@pytest.mark.timeout(120)
def test_harness_re_runs_once_after_a_native_crash_then_fails(tmp_path, monkeypatch) -> None:
    """A rank killed by SIGABRT (docs/design.md, "A rare native crash in the test pool") gets one
    re-run in fresh processes, with a warning and a record in the session's native-crash file (printed
    at the end by tests/conftest.py); crashing again fails the run (an exit code, as in the test above,
    is never re-run)."""
    from testbed.rank_pool import NATIVE_CRASH_LOG_ENV, native_crash_report, read_native_crashes

    log = tmp_path / "native_crashes.jsonl"
    monkeypatch.setenv(NATIVE_CRASH_LOG_ENV, str(log))
    with pytest.warns(UserWarning, match="crashed in native code") as caught, \
            pytest.raises(MeshRunError, match=r"ranks died \(rank -> exit code\): \{1: -6\}") as info:
        run_mesh(2, 1, 1, SMALL, 1, instrument=abort_on_rank_one, collective_timeout_s=60)
    assert info.value.died == {1: -6}
    assert len([w for w in caught if "native code" in str(w.message)]) == 1
    (record,) = read_native_crashes(log)  # the first crash, which was re-run; the second failed the test
    assert record["died"] == {"1": -6} and record["ended_by"] == "died"
    assert "test_harness_re_runs_once_after_a_native_crash_then_fails" in record["test"]
    assert record["run"] == "run_mesh(dp=2, pp=1, tp=1, steps=1)"
    report = native_crash_report(log)
    assert len(report) == 2 and report[0].startswith("1 mesh run(s) re-ran after a native crash")
