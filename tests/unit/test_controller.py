"""The controller's state machine driven by a fake worker group: no processes, no Ray, real metrics file
and real checkpoint catalog in tmp (``testbed/fake_group.py`` scripts the ranks and their faults).

Every transition, and the test that covers it (``Controller.advance()`` answers the new state's kind):

* FORMING -> RUNNING (generation 1): ``test_start_forms_generation_one``
* FORMING -> REBUILDING (a member dies while generation 1 forms):
  ``test_member_lost_while_generation_one_forms_rebuilds``
* FORMING -> ERRORED (the start join breaks with nobody lost):
  ``test_start_that_breaks_with_nobody_lost_stops``
* RUNNING -> RUNNING (a step): ``test_a_step_trains_and_is_recorded``
* RUNNING -> FORMING -> RUNNING (planned resize at a step boundary while a checkpoint is in flight:
  the boundary decides it, FORMING commits the pending save, then the current step, then forms):
  ``test_requested_resize_commits_the_save_in_flight_first``; with missing actors started or not:
  ``test_requested_resize_starts_missing_actors_or_fits``
* RUNNING -> FORMING -> RUNNING (grow at a step boundary while a checkpoint is in flight):
  ``test_grow_adopts_new_actors_and_commits_the_save_in_flight_first``
* RUNNING -> FINISHED: ``test_runs_to_the_end``; through FINISHING (handlers/finished.py: the last
  step committed): ``test_the_end_of_a_run_is_the_finished_module``; ERRORED when that save fails:
  ``test_a_last_save_that_fails_at_the_end_is_errored_not_finished``
* RUNNING -> REBUILDING (a rank dies in a step): ``test_rank_dies_in_a_step_and_the_mesh_shrinks``;
  a rank hangs: ``test_hung_rank_is_killed_and_blamed``; a latched error:
  ``test_latched_error_rebuilds_with_everyone``; a timeout with every rank alive:
  ``test_timeout_with_every_rank_alive``; a save in flight is abandoned (never committed, its acks
  drained later): ``test_failure_abandons_the_save_in_flight``
* RUNNING -> ERRORED (restart budget spent): ``test_step_failure_beyond_the_budget_stops``;
  (checkpoint storage failed with every rank alive): ``test_storage_failure_stops``; the Running handler
  returns that ERRORED, nothing is raised: ``test_storage_failing_is_the_errored_state_its_handler_returns``
* REBUILDING -> RUNNING (shrunk dp; the rebuild event, with resumed_from_step and recovery_s, goes out
  with the first step trained): ``test_rank_dies_in_a_step_and_the_mesh_shrinks``
* REBUILDING -> REBUILDING (a member dies while joining / loading the checkpoint):
  ``test_member_dies_while_rebuilding`` (both phases)
* REBUILDING -> ERRORED (restart budget spent): ``test_rebuild_failure_beyond_the_budget_stops``;
  (below elastic.min_dp, nothing starting): ``test_below_min_dp_stops`` (while a replacement starts it
  is waited for: ``test_below_min_dp_waits_for_the_replacement_still_starting``); (broke with nobody lost):
  ``test_rebuild_that_breaks_with_nobody_lost_stops``; but a join that broke because the rendezvous
  store was lost is retried with a re-hosted store: ``test_join_broken_by_a_lost_store_rehosts_it``

* RUNNING -> DRAINING (a decision with steps in flight): tests/unit/test_controller_window.py and
  ``test_a_drain_held_across_a_failure_still_evacuates_the_node`` (test_controller_preemption.py)

The shape (#38): a rank failure visits each state's handler module once, in order:
``test_a_rank_failure_visits_each_state_module_once_in_order``; the controller holds the context,
the handlers and the state, nothing else: ``test_the_controller_holds_the_context_and_the_state``.

Preemption notices and stop requests: tests/unit/test_controller_preemption.py.

(That importing the controller loads neither Ray nor torch is checked in a fresh interpreter:
tests/process/test_fresh_interpreters.py.)
"""

from __future__ import annotations

import os

import pytest

from checkpoints.catalog import list_checkpoints
from checkpoints.layout import step_dir_name
from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from orchestrator.control.context import GROW_HOLD_STEPS
from orchestrator.errors import RebuildTimeoutError, TrainingFailed
from testbed.controller_run import make  # noqa: F401  (the fixture)


def test_start_forms_generation_one(make):
    r = make()
    assert r.c.advance() == State.RUNNING
    gen = r.c.generation
    assert gen.number == 1 and gen.shape.dp == 4 and gen.members == {0: 0, 1: 1, 2: 2, 3: 3}
    specs = [args[0] for _, args in r.group.calls(RankCalls.join_generation)]
    assert [s.world_rank for s in specs] == [0, 1, 2, 3]
    assert {s.store_prefix for s in specs} == {f"{r.c.context.identity.run_id}-gen1"} and {s.generation for s in specs} == {1}
    assert set(gen.infos) == {0, 1, 2, 3}
    start, = r.events("start")
    assert (start["generation"], start["dp"], start["resumed_from_step"], start["spares"]) == (1, 4, 0, 0)
    assert r.c.next_step == 1 and not r.group.calls(RankCalls.load_checkpoint)  # nothing to resume from


def test_a_step_trains_and_is_recorded(make):
    r = make()
    r.steps(1)
    r.group.ranks[2].forward_s = 0.7  # the fake's step CPU seconds (StepResult.own_s)
    r.steps(1)
    assert r.c.next_step == 2 and r.c.losses == {1: pytest.approx(1.0)}
    assert sorted((a, args[0]) for a, args in r.group.calls(RankCalls.train_step)) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    rec, = [x for x in r.records() if "loss" in x]
    tokens = r.cfg.train.global_batch_size * r.cfg.model.seq_len
    assert (rec["step"], rec["dp"], rec["pp"], rec["tp"], rec["generation"]) == (1, 4, 1, 1, 1)
    assert rec["tokens"] == tokens and rec["tokens_per_s"] == pytest.approx(tokens / 0.5)
    assert rec["bubble"] == pytest.approx(0.2)  # compute 0.4 s of a 0.5 s step on every rank
    assert rec["cpu_s"] == pytest.approx(0.7)  # the most CPU seconds one rank spent in the step


def test_runs_to_the_end(make):
    r = make()
    summary = r.c.run()
    assert r.c.state.kind == State.FINISHED
    assert (summary.final_step, summary.generations, summary.restarts) == (6, 1, 0)
    assert summary.losses == {s: pytest.approx(s) for s in range(1, 7)}
    done, = r.events("done")
    assert done["step"] == 6
    assert [e["step"] for e in r.events("checkpoint")] == [2, 4, 6] and r.committed() == [2, 4, 6]


@pytest.mark.parametrize("steps,every,saved", [(7, 2, [2, 4, 6, 7]), (6, 4, [4, 6]), (6, 0, [6])])
def test_the_last_step_is_saved_at_the_end(make, steps, every, saved):
    """#36 item 4: the end of training commits the last step whatever ``checkpoint.every`` is (the
    default ``checkpoint.keep`` of 3 purges the oldest)."""
    r = make(f"train.steps={steps}", f"checkpoint.every={every}")
    r.c.run()
    assert r.c.state.kind == State.FINISHED and r.committed() == saved[-3:]
    assert [e["step"] for e in r.events("checkpoint")] == saved


def test_any_exit_closes_the_checkpoints(make, monkeypatch):
    """#36 item 12: an unexpected error (not TrainingFailed) still stops the purger and removes the
    temporary checkpoint root a run without checkpoint.dir keeps its planned-resize saves in."""
    r = make("checkpoint.dir=")
    tmp_root = r.c.ckpt.root
    assert os.path.isdir(tmp_root) and not r.c.ckpt.user_dir
    r.steps(2)

    def broken(state, context):
        raise KeyError("a bug")

    monkeypatch.setitem(r.c.handlers, type(r.c.state), broken)
    with pytest.raises(KeyError):
        r.c.run()
    assert not os.path.exists(tmp_root) and not r.c.ckpt.purger._thread.is_alive()


def test_a_rank_failure_visits_each_state_module_once_in_order(make):
    """#38: following a rank that dies in a step through the driver: running -> recovering -> forming
    -> running, each state's handler module once (recovering within the advance() that read the step)."""
    r = make()
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)  # start + steps 1-2
    visited = _record_visits(r)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    assert r.c.advance() == State.RUNNING
    assert visited == ["running", "recovering", "forming", "running"]


def test_the_controller_holds_the_context_and_the_state(make):
    """#38: everything else the controller used to hold (32 attributes) is the context's."""
    r = make()
    assert set(vars(r.c)) == {"context", "handlers", "state"}
    r.steps(2)
    assert set(vars(r.c)) == {"context", "handlers", "state"}


def test_rank_dies_in_a_step_and_the_mesh_shrinks(make):
    r = make()
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.steps(5)  # start + steps 1-4
    r.clock.t = 100.0
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert (failure["step"], failure["ranks"]) == (5, [1]) and "ActorDiedError" in failure["reason"]
    assert r.group.killed == [1] and r.c.restarts == 1
    kicks = r.group.calls(RankCalls.kick)
    assert sorted(a for a, _ in kicks) == [0, 2, 3]
    assert sorted(kicks[0][1][0]) == [("10.0.0.1", 40_000), ("10.0.0.1", 40_002), ("10.0.0.1", 40_003)]
    assert kicks[0][1][1] == [("10.0.0.1", 40_001)]  # the dead rank's: matched against recorded connections only

    r.clock.t = 103.0
    assert r.c.advance() == State.RUNNING  # REBUILDING -> RUNNING: 3 live actors, dp=3 does not split 8
    gen = r.c.generation
    assert (gen.number, gen.shape.dp, gen.members) == (2, 2, {0: 0, 1: 2})
    # The survivors were told to leave generation 1 as soon as they were freed; the spare among them
    # is not told again.
    assert r.group.calls(RankCalls.leave_generation) == [(0, (1,)), (2, (1,)), (3, (1,))]
    assert sorted(a for a, _ in r.group.calls(RankCalls.load_checkpoint)) == [0, 2]
    # The step-4 save was still to be committed after step 5: abandoned, so step 2 is the newest.
    assert r.group.calls(RankCalls.load_checkpoint)[0][1] == (str(r.ckpt / step_dir_name(2) / "g1"),)  # its attempt dir
    skipped, = r.events("checkpoint_skipped")
    assert skipped["step"] == 4 and skipped["reason"].startswith("partial")
    assert r.c.next_step == 3 and not r.events("rebuild")  # the event goes out with the first step

    r.clock.t = 110.0
    r.steps(1)
    rebuild, = r.events("rebuild")
    assert (rebuild["generation"], rebuild["dp"], rebuild["resumed_from_step"]) == (2, 2, 2)
    assert (rebuild["reason"], rebuild["spares"], rebuild["recovery_s"]) == ("failure", 1, 10.0)
    # Where the recovery went: every phase ended by the fake clock's 100 s, the step at 110 s.
    assert list(rebuild["phases_s"]) == ["settled", "snapshots_settled", "restore_planned", "planned", "joined", "restored"]
    assert all(0.0 <= t <= 10.0 for t in rebuild["phases_s"].values())
    summary = r.c.run()
    assert (summary.final_step, summary.restarts) == (6, 1) and summary.losses[5] == pytest.approx(5)


def test_hung_rank_is_killed_and_blamed(make):
    r = make()
    r.group.fail(RankCalls.train_step, 2, "hang", at=3)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [2] and failure["reason"] == "no progress within elastic.step_timeout_s"
    assert r.group.killed == [2]


def test_latched_error_rebuilds_with_everyone(make):
    r = make()
    r.group.fail(RankCalls.train_step, 2, "raise", at=4, message="RuntimeError: CUDA out of memory")
    r.steps(4)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [2] and failure["reason"] == "RuntimeError: CUDA out of memory"
    assert r.group.killed == [] and r.c.restarts == 1
    r.steps(1)
    assert (r.c.generation.number, r.c.generation.shape.dp, r.c.next_step) == (2, 4, 3)  # from step 2


def test_timeout_with_every_rank_alive(make):
    r = make()
    for actor in range(4):
        r.group.fail(RankCalls.train_step, actor, "slow", at=4)
    r.steps(4)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [] and failure["reason"] == (
        "step 4 exceeded elastic.step_timeout_s=120 with every rank alive and none progressing for that "
        "long (wedged in a kernel or a collective): raise it if one action legitimately takes this long")
    assert r.group.killed == [] and sorted(a for a, _ in r.group.calls(RankCalls.kick)) == [0, 1, 2, 3]
    assert r.c.restarts == 1
    r.steps(1)
    assert (r.c.generation.number, r.c.generation.members, r.c.next_step) == (2, {0: 0, 1: 1, 2: 2, 3: 3}, 3)


@pytest.mark.parametrize("method,stage", [(RankCalls.join_generation, "joining"),
                                          (RankCalls.load_checkpoint, "loading the checkpoint")])
def test_member_dies_while_rebuilding(make, method, stage):
    r = make()
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.group.fail(method, 2, "die", at=2)  # actor 2 holds rank 1 of generation 2
    r.steps(5)
    r.clock.t = 100.0
    assert r.c.advance() == State.REBUILDING
    r.clock.t = 101.0
    assert r.c.advance() == State.REBUILDING  # REBUILDING -> REBUILDING
    first, second = r.events("failure")
    assert second["reason"].startswith(f"rebuild of generation 2 failed while {stage}: ActorDiedError")
    assert (second["step"], second["ranks"]) == (5, [1])
    assert r.group.killed == [1, 2] and r.c.restarts == 2
    assert [a for a, _ in r.group.calls(RankCalls.kick)].count(0) == 2  # actor 0 was freed each time, not killed
    r.clock.t = 104.0
    assert r.c.advance() == State.RUNNING
    assert (r.c.generation.number, r.c.generation.members) == (3, {0: 0, 1: 3})
    r.steps(1)
    rebuild, = r.events("rebuild")  # generation 2 never trained
    assert (rebuild["generation"], rebuild["resumed_from_step"], rebuild["recovery_s"]) == (3, 2, 4.0)


def test_member_lost_while_generation_one_forms_rebuilds(make):
    r = make()
    r.group.fail(RankCalls.join_generation, 3, "die", at=1)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["reason"].startswith("rebuild of generation 1 failed while joining") and failure["ranks"] == [3]
    assert r.c.advance() == State.RUNNING
    assert (r.c.generation.number, r.c.generation.members, r.c.restarts) == (2, {0: 0, 1: 1}, 1)


def test_start_that_breaks_with_nobody_lost_stops(make):
    r = make()
    r.group.fail(RankCalls.join_generation, 2, "raise", at=1, message="ValueError: bad layer split")
    assert r.c.advance() == State.ERRORED
    assert type(r.c.error) is TrainingFailed and r.c.restarts == 0 and r.group.killed == []
    assert str(r.c.error) == "rebuild of generation 1 failed while joining: ValueError: bad layer split"
    with pytest.raises(TrainingFailed):
        r.c.run()


def test_rebuild_that_breaks_with_nobody_lost_stops(make):
    r = make()
    r.group.fail(RankCalls.train_step, 1, "die", at=4)
    r.group.fail(RankCalls.load_checkpoint, 0, "raise", at=2, message="RuntimeError: shape mismatch")
    r.steps(4)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.ERRORED
    assert type(r.c.error) is TrainingFailed and r.c.restarts == 1
    assert str(r.c.error).startswith("rebuild of generation 2 failed while loading the checkpoint")
    assert r.events("failure")[-1]["ranks"] == []


class LostStore:
    """A StoreSource whose host dies right after handing out its address once (``dies``); the next
    ``address()`` re-hosts it on a new port, as ``StoreProvider`` does."""

    def __init__(self) -> None:
        self.port, self.alive, self.dies = 29500, True, False
        self.steps_read = 0

    def address(self) -> tuple[str, int]:
        if not self.alive:
            self.port, self.alive = self.port + 1, True
        address = ("127.0.0.1", self.port)
        if self.dies:
            self.alive, self.dies = False, False
        return address

    def healthy(self) -> bool:
        return self.alive

    def step_read(self) -> None:
        self.steps_read += 1  # the step loop tells the store each step (StoreProvider starts its standby)


def test_join_broken_by_a_lost_store_rehosts_it(make):
    r = make()
    store = r.c.context.store = LostStore()
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING  # rank 1 lost in step 3
    # The store's host dies while generation 2 forms: the join breaks with nobody lost.
    store.dies = True
    r.group.fail(RankCalls.join_generation, 0, "raise", at=2, message="DistNetworkError: connect timed out")
    assert r.c.advance() == State.REBUILDING  # not ERRORED: the store, not a bug
    failure = r.events("failure")[-1]
    assert failure["ranks"] == [] and "rendezvous store was lost" in failure["reason"]
    assert r.c.advance() == State.RUNNING
    ports = {(args[0].generation, args[0].store_port) for _, args in r.group.calls(RankCalls.join_generation)}
    assert ports == {(1, 29500), (2, 29500), (3, 29501)}  # generation 3 joined the re-hosted store
    assert r.c.restarts == 2
    r.steps(1)
    trained = [x for x in r.records() if "loss" in x and "event" not in x]
    assert store.steps_read == len(trained) > 0  # each step read is told to the store (its standby's start)


def test_step_failure_beyond_the_budget_stops(make):
    r = make("elastic.max_restarts=0")
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)
    assert r.c.advance() == State.ERRORED  # RUNNING -> ERRORED
    assert type(r.c.error) is TrainingFailed
    assert str(r.c.error).startswith("giving up after 0 restarts (elastic.max_restarts=0); last failure at step 3")


def test_rebuild_failure_beyond_the_budget_stops(make):
    r = make("elastic.max_restarts=1")
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.group.fail(RankCalls.join_generation, 2, "die", at=2)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.ERRORED
    assert isinstance(r.c.error, RebuildTimeoutError)
    assert str(r.c.error).startswith("could not form generation 2 within elastic.max_restarts=1 tries "
                                     "(rebuild of generation 2 failed while joining")
    with pytest.raises(RebuildTimeoutError):
        r.c.run()


def test_below_min_dp_stops(make):
    r = make("elastic.min_dp=4")
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.ERRORED
    assert type(r.c.error) is TrainingFailed and "below elastic.min_dp=4" in str(r.c.error)
    assert r.group.starting == 0  # nothing could be started (no room): nothing to wait for


def test_below_min_dp_waits_for_the_replacement_still_starting(make):
    """Too few live actors, but a replacement is starting (room for one): the rebuild waits for it to
    answer instead of stopping, and forms the full mesh with it (bench/chaos.py --quick stopped at
    0 live actors while four replacements were seconds from answering)."""
    r = make("elastic.min_dp=4", capacity=1)
    r.group.start_polls = 3  # it answers at the 4th poll after it was asked for
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    assert r.c.generation.shape.dp == 4 and r.group.live_ids == [0, 2, 3, 4] and r.group.starting == 0
    while r.c.advance() != State.FINISHED:
        pass
    assert r.events("actors_ready")[0]["actors"] == [4] and len(r.events("failure")) == 1


def test_storage_failure_stops(make):
    r = make()
    r.group.fail(RankCalls.wait_checkpoint, 0, "raise", at=2, message="OSError: [Errno 28] No space left on device")
    r.steps(3)  # start, steps 1-2; the step-2 save starts
    assert r.c.advance() == State.ERRORED  # step 3 trains, then its commit finds the failed write
    assert str(r.c.error).startswith("checkpoint.dir: saving step 2 failed (OSError: [Errno 28] No space")
    failed, = r.events("checkpoint_failed")
    assert failed["step"] == 2 and r.committed() == []


def _record_visits(r) -> list[str]:
    """Wrap each state's handler so that the module of every one called is recorded, in order."""
    visited = []
    for state_type, handler in list(r.c.handlers.items()):
        def recording(state, context, handler=handler):
            visited.append(handler.__module__.rsplit(".", 1)[-1])
            return handler(state, context)
        r.c.handlers[state_type] = recording
    return visited


def test_storage_failing_is_the_errored_state_its_handler_returns(make):
    """#38, errors become returned states: the Running handler meets the failed commit and answers
    Errored (advance() converts nothing)."""
    r = make()
    r.group.fail(RankCalls.wait_checkpoint, 0, "raise", at=2, message="OSError: [Errno 28] No space left on device")
    r.steps(3)
    state = r.c.handlers[type(r.c.state)](r.c.state, r.c.context)
    assert state.kind == State.ERRORED and str(state.error).startswith("checkpoint.dir: saving step 2 failed")


def test_the_end_of_a_run_is_the_finished_module(make):
    """The boundary after the last step is Finishing, handled by handlers/finished.py within the same
    advance(): the last step committed, ``done`` logged, FINISHED."""
    r = make()
    r.steps(6)  # start, steps 1-5
    visited = _record_visits(r)
    assert r.c.advance() == State.RUNNING  # step 6
    assert r.c.advance() == State.FINISHED
    assert visited == ["running", "running", "finished"]
    assert r.committed() == [2, 4, 6] and [e["step"] for e in r.events("done")] == [6]
    assert r.c.run().final_step == 6


def test_a_last_save_that_fails_at_the_end_is_errored_not_finished(make):
    r = make()
    r.group.fail(RankCalls.wait_checkpoint, 1, "raise", at=6, message="OSError: [Errno 5] I/O error")
    r.steps(7)  # start, steps 1-6: the step-6 save is writing
    visited = _record_visits(r)
    assert r.c.advance() == State.ERRORED and "saving step 6 failed" in str(r.c.error)
    assert visited == ["running", "finished"] and not r.events("done")
    with pytest.raises(TrainingFailed, match="saving step 6 failed"):  # the Errored outcome: raised to the caller
        r.c.run()


def test_a_write_slower_than_the_step_timeout_is_waited_for_while_its_ranks_live(make):
    """#36 item 3: the save's acks missing after elastic.step_timeout_s, three times over, with every
    writer answering its liveness probe: still committed, no failure, no restart."""
    r = make()
    r.group.collects_pending[RankCalls.wait_checkpoint] = 3
    summary = r.c.run()
    assert r.committed() == [2, 4, 6] and not r.events("checkpoint_failed") and summary.restarts == 0
    assert len(r.group.calls(RankCalls.status)) >= 4 * 3  # each wait ended with a probe of the 4 writers


def test_a_writer_that_answers_no_probe_is_not_waited_for(make):
    r = make()
    r.group.collects_pending[RankCalls.wait_checkpoint] = 1_000_000  # never done
    r.group.fail(RankCalls.status, 2, "hang")  # the probe after the first wait finds actor 2 silent
    r.steps(3)  # start, steps 1-2; the step-2 save starts
    r.c.advance()  # step 3, then the commit: waits once, probes, gives up on the save
    failed, = r.events("checkpoint_failed")
    assert failed["step"] == 2 and r.committed() == []


@pytest.mark.parametrize("method", [RankCalls.join_generation, RankCalls.load_checkpoint])
def test_a_join_or_load_slower_than_rebuild_timeout_completes_while_everyone_lives(make, method):
    """#36 item 1: a generation's join (a large model's build, an init_from read) or its checkpoint
    load still unanswered after elastic.rebuild_timeout_s, twice over, with every member answering its
    liveness probe, is waited for: no failure, no restart, nothing killed."""
    r = make()
    r.steps(4)  # start, steps 1-3 (step 2 committed)
    r.group.fail(RankCalls.train_step, 3, "die", at=4)
    assert r.c.advance() == State.REBUILDING
    r.group.collects_pending[method] = 2
    assert r.c.advance() == State.RUNNING  # generation 2 formed from the 3 that live
    assert r.group.collects_pending[method] == 0 and r.group.killed == [3] and r.c.next_step == 3
    assert r.c.run().restarts == 1 and not r.events("checkpoint_failed")


def test_failure_abandons_the_save_in_flight(make):
    r = make()
    r.group.slow_writes = True
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)  # the step-2 save is staged and still writing
    waits = [c for c in r.group._calls if c.method is RankCalls.wait_checkpoint]
    assert r.c.advance() == State.REBUILDING
    assert r.committed() == [] and not r.events("checkpoint")  # never committed
    assert r.c.advance() == State.RUNNING and r.c.next_step == 1  # nothing to resume from
    assert not r.group.calls(RankCalls.load_checkpoint)
    r.group.finish_writes()
    r.steps(1)
    assert set(r.group.drained) == set(waits)  # the abandoned acks were read once they came in


def test_a_save_due_while_one_writes_is_deferred_and_training_goes_on(make):
    """Storage slower than ``checkpoint.every`` steps (the chaos campaign's slow_storage fault): the save
    of step 4 is due while step 2's still writes. Waiting for it stalled every rank until storage caught
    up (3-4 s a time in the campaign); with ``checkpoint.when_busy = "defer"`` step 4's save is
    owed, said in an event, and made at the first step after step 2's commit (5, not the next periodic 6)."""
    r = make("train.steps=8", "checkpoint.when_busy=defer")
    r.group.slow_writes = True
    r.steps(5)  # start, steps 1-4: step 2's save writes on; step 4's is due
    assert r.committed() == [] and r.c.next_step == 5
    assert sorted({args[1] for _, args in r.group.calls(RankCalls.save_checkpoint)}) == [2]  # 4 not started
    deferred, = r.events("checkpoint_deferred")
    assert (deferred["step"], deferred["writing"]) == (4, 2) and r.c.ckpt.owed_step == 4
    r.group.finish_writes()
    r.group.slow_writes = False
    r.steps(1)  # step 5's boundary: step 2 commits, then the owed save is made (5)
    assert r.c.run().restarts == 0
    assert [e["step"] for e in r.events("checkpoint")] == [2, 5, 6, 8] and r.c.ckpt.owed_step is None
    assert len(r.events("checkpoint_deferred")) == 1


@pytest.mark.parametrize("slow_for", range(3, 9))
def test_a_deferred_save_never_takes_a_later_step_in_flight(make, slow_for):
    """With steps in flight (window 2), a save that must wait for a slow write does not hold them back:
    the step after it is sent. Its save is then owed until a boundary where nothing later was sent, so
    no save is ever made of a rank that trained a later step (it would carry that step's state). The
    write ends after ``slow_for`` advances: at every point of the window's pace."""
    r = make("train.steps=12", "checkpoint.when_busy=defer", window=2)
    r.group.slow_writes = True
    r.steps(slow_for)
    r.group.finish_writes()
    r.group.slow_writes = False
    assert r.c.run().restarts == 0
    saved = [e["step"] for e in r.events("checkpoint")]
    assert saved[0] == 2 and saved[-1] == 12
    assert bool(r.events("checkpoint_deferred")) == (slow_for >= 5)  # step 4 due while 2 writes
    log = r.group.log
    for i, (method, _, args) in enumerate(log):
        if method is RankCalls.save_checkpoint:
            assert not any(m is RankCalls.train_step and a[0] > args[1] for m, _, a in log[:i]), args[1]


def test_a_save_due_with_a_later_step_sent_stays_owed(make):
    """The coordinator's half of the guard above: the write it waited for ended between the window's
    look (``wants_empty_window``: not yet, so the next step went out) and the boundary; the due save
    is not started then (it would carry the later step's state) but owed, and the window waits for it
    next time."""
    r = make("train.steps=8", "checkpoint.when_busy=defer")
    r.group.slow_writes = True
    r.steps(3)  # start, steps 1-2: step 2's save writes
    ckpt = r.c.ckpt
    assert not ckpt.wants_empty_window(r.group, 4)  # due, but the write goes on: steps go on too
    r.group.finish_writes()
    r.group.slow_writes = False
    ckpt.after_step(r.group, r.c.generation, 4, later_sent=True)
    assert r.committed() == [2] and ckpt.owed_step == 4
    assert sorted({args[1] for _, args in r.group.calls(RankCalls.save_checkpoint)}) == [2]
    assert [(e["step"], e["writing"]) for e in r.events("checkpoint_deferred")] == [(4, 2)]
    assert ckpt.wants_empty_window(r.group, 5)  # owed, nothing writing: the next step waits for it


def test_when_busy_wait_stalls_until_the_save_in_flight_committed(make):
    r = make("train.steps=8")  # the default: "wait"
    r.group.slow_writes = True  # the fake answers a blocking collect at once: the wait "ends" there
    r.steps(5)
    assert r.committed() == [2] and not r.events("checkpoint_deferred")
    assert sorted({args[1] for _, args in r.group.calls(RankCalls.save_checkpoint)}) == [2, 4]


def test_a_late_write_of_an_abandoned_save_cannot_reach_a_later_attempt(make):
    """#36 item 5 (the fence): generation 1's save of step 2 is abandoned by a failure while it writes;
    generation 2 saves step 2 again. Files the abandoned writer puts down afterwards (a survivor's
    thread, a partitioned host's process) land in its own attempt directory, so the committed step 2
    stays whole (with one directory per step, a late truncated shard would have replaced the new one)."""
    r = make()
    r.group.slow_writes = True
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)  # the step-2 save of generation 1 is staged and still writing
    abandoned = {args[0] for _, args in r.group.calls(RankCalls.save_checkpoint)}
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING and r.c.next_step == 1  # nothing committed to resume from
    r.group.finish_writes()
    r.group.slow_writes = False
    r.steps(3)  # generation 2 trains steps 1-3; its save of step 2 commits after step 3
    for late in abandoned:  # the abandoned attempt's files arrive now, truncated
        os.makedirs(late, exist_ok=True)
        for name in os.listdir(os.path.join(late, os.pardir, "g2")):
            with open(os.path.join(late, name), "wb") as fh:
                fh.write(b"x")
    assert r.committed() == [2]
    info = list_checkpoints(str(r.ckpt))[0]
    assert info.valid and info.manifest.dcp_dir == "g2" and info.dcp_path not in abandoned


def test_requested_resize_commits_the_save_in_flight_first(make):
    r = make()
    r.group.slow_writes = True
    r.c.resize_requests = {4: 2}
    r.steps(4)  # start, steps 1-3: the step-2 save is still writing
    assert r.committed() == []
    assert r.c.advance() == State.FORMING  # the step-4 boundary decides the resize
    assert r.c.advance() == State.RUNNING  # it forms: the save in flight, then step 3, committed first
    assert [e["step"] for e in r.events("checkpoint")] == [2, 3] and r.committed() == [2, 3]
    methods = [(m, args) for m, _, args in r.group.log]
    last_save = max(i for i, (m, args) in enumerate(methods) if m is RankCalls.save_checkpoint and args[1] == 3)
    first_join = min(i for i, (m, args) in enumerate(methods) if m is RankCalls.join_generation and args[0].generation == 2)
    assert last_save < first_join
    assert (r.c.generation.number, r.c.generation.shape.dp, r.c.next_step) == (2, 2, 4)
    r.steps(1)
    rebuild, = r.events("rebuild")
    assert (rebuild["reason"], rebuild["resumed_from_step"], rebuild["spares"]) == ("requested", 3, 2)
    assert r.c.run().restarts == 0


@pytest.mark.parametrize("capacity,dp", [(0, 2), (2, 4)])
def test_requested_resize_starts_missing_actors_or_fits(make, capacity, dp):
    r = make("mesh.dp=2", capacity=capacity)
    r.c.resize_requests = {3: 4}
    r.steps(3)
    assert r.c.advance() == State.FORMING
    assert r.c.advance() == State.RUNNING
    assert (r.c.generation.number, r.c.generation.shape.dp) == (2, dp)
    assert len(r.group.live_ids) == 2 + capacity


def test_grow_adopts_new_actors_held_while_a_save_writes(make):
    """The grow waits at the step boundaries while step 4's save is still being written (training on
    at dp=2), and is made at the first boundary after the write ended: no rank idles waiting for it."""
    r = make("mesh.dp=2", "elastic.max_dp=4", capacity=2)
    r.group.slow_writes = True
    r.steps(4)  # start, steps 1-3 (no grow check yet: the clock stands still); step 2's save writes
    assert r.c.generation.shape.dp == 2 and r.committed() == []
    r.clock.t = 10.0
    assert r.c.advance() == State.RUNNING  # the step-4 boundary's grow check: 2 actors begun, step 4 trains
    assert r.group.live_ids == [0, 1] and r.group.starting == 2 and r.c.next_step == 5
    assert r.c.advance() == State.RUNNING  # the step-5 boundary: they answered, step 4's save writes: held
    assert r.group.live_ids == [0, 1, 2, 3] and r.c.generation.shape.dp == 2 and r.c.next_step == 6
    assert r.committed() == [2]  # step 4's still writing
    r.group.finish_writes()
    assert r.c.advance() == State.FORMING  # the step-6 boundary: the write is done, so grow now
    assert r.c.advance() == State.RUNNING
    assert r.committed() == [2, 4, 5]  # the save in flight committed, then step 5 saved before the re-form
    assert (r.c.generation.number, r.c.generation.shape.dp, r.c.next_step) == (2, 4, 6)
    assert r.c.context.grow_check.held == 0
    ready, = r.events("actors_ready")
    assert ready["actors"] == [2, 3]
    r.clock.t = 12.0
    r.steps(1)
    grow, = r.events("grow")
    assert (grow["reason"], grow["resumed_from_step"], grow["recovery_s"]) == ("grow", 5, 2.0)
    assert not r.events("rebuild")


def test_a_grow_held_by_a_slow_write_is_made_after_grow_hold_steps(make):
    """Storage slower than a few steps (the write never ends here until waited for): the grow is held
    for GROW_HOLD_STEPS boundaries, then made, waiting for the write as before."""
    r = make("mesh.dp=2", "elastic.max_dp=4", "train.steps=12", capacity=2)
    r.group.slow_writes = True
    r.steps(4)
    r.clock.t = 10.0
    assert r.c.advance() == State.RUNNING  # the step-4 boundary: 2 actors begun, step 4 trains
    for step in range(5, 5 + GROW_HOLD_STEPS):
        assert r.c.advance() == State.RUNNING, step  # held at the boundary before this step
    assert r.c.generation.shape.dp == 2 and r.c.next_step == 5 + GROW_HOLD_STEPS
    assert r.c.advance() == State.FORMING
    assert r.c.advance() == State.RUNNING
    assert r.c.generation.shape.dp == 4 and 4 in r.committed()


def test_a_grow_held_when_a_rank_dies_is_decided_afresh_by_the_next_generation(make):
    """Rank 1 dies in the step trained while a grow was held: the rebuilt generation starts with no
    grow held, so its boundaries wait for ``grow_check_s`` again instead of checking (and starting
    actors) at every one of them."""
    r = make("mesh.dp=2", "elastic.max_dp=4", "train.steps=12", capacity=2)
    r.group.slow_writes = True
    r.steps(4)
    r.clock.t = 10.0
    assert r.c.advance() == State.RUNNING  # the step-4 boundary: 2 actors begun, step 4 trains, its save starts
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    states = [r.c.advance() for _ in range(2)]
    assert r.c.context.grow_check.held == 0 and State.REBUILDING in states
    assert r.c.generation.number == 2 and not r.c.context.grow_check.due()  # the clock stood still


def test_a_held_grow_that_lapses_releases_the_check(make):
    """The actors a held grow counted on are gone at the next boundary (no larger mesh to form): the
    hold ends with the decision, and the next check waits for ``grow_check_s``."""
    r = make("mesh.dp=2", "elastic.max_dp=4", "train.steps=12", capacity=2)
    r.group.slow_writes = True
    r.steps(4)
    r.clock.t = 10.0
    assert r.c.advance() == State.RUNNING  # 2 actors begun; step 4 trains
    assert r.c.advance() == State.RUNNING  # they answered: the grow is held (step 4's save writes)
    assert r.c.context.grow_check.held == 1
    r.group.kill([2])  # one of them went: dp=2 is all the live actors allow
    assert r.c.advance() == State.RUNNING
    assert r.c.context.grow_check.held == 0 and r.c.generation.shape.dp == 2
    assert not r.c.context.grow_check.due()


def test_a_rank_whose_process_is_gone_is_dead_without_a_status_poll(make):
    # SIGKILLed: the peers' step fails at once, Ray has not reported the death yet (the call still
    # runs), and the driver sees the process gone on its node: dead, blamed as such, never polled
    # (a poll would run its full 3 s and call the rank hung; the chaos campaign did, 4 times).
    r = make()
    r.group.fail(RankCalls.train_step, 2, "hang", at=3)  # its call never answers, as a dead one's
    r.group.exited_ids.add(2)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [2] and failure["reason"] == "ActorDiedError (its process is gone)"
    assert [a for a, _ in r.group.calls(RankCalls.status)].count(2) == 0
    assert r.group.killed == [2]
