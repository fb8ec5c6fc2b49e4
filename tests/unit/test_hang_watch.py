"""Liveness probes while a step runs (orchestrator/recovery/hang_watch.py), on a fake worker group: a
rank that answers no probe is hung and the step fails at once, blamed on it and killed, without the
status poll being asked again; a live but slow step is never cut short (every rank answers, so only
``elastic.step_timeout_s`` ends it); ``hang_probe_factor = 0`` and a run without a pace yet probe nothing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshspeak.messages import CallOutcome, WorkerStatus
from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from orchestrator.recovery import hang_watch
from orchestrator.recovery.hang_watch import MIN_HISTORY, PROBE_FLOOR_S, HangWatch
from testbed.controller_run import make  # noqa: F401  (the fixture)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_probe_interval_follows_the_median_step_with_a_floor():
    clock = Clock()
    watch = HangWatch(3.0, clock)
    for t in (0.0, 2.0, 4.0, 6.0):  # three intervals of 2 s once the first read set the start
        clock.t = t
        assert watch.probe_after_s() is None
        watch.step_read()
    assert len(watch.intervals) == MIN_HISTORY and watch.probe_after_s() == 6.0
    clock.t = 66.0  # one checkpoint step of 60 s: the median does not move
    watch.step_read()
    assert watch.probe_after_s() == 6.0
    watch.pause()  # a recovery: the next read starts a new interval, it is not one
    clock.t = 200.0
    watch.step_read()
    assert list(watch.intervals) == [2.0, 2.0, 2.0, 60.0]
    fast = HangWatch(3.0, clock)
    for t in (0.0, 0.1, 0.2, 0.3):
        clock.t = t
        fast.step_read()
    assert fast.probe_after_s() == PROBE_FLOOR_S
    off = HangWatch(0.0, clock)
    off.intervals.extend([1.0] * 5)
    assert off.probe_after_s() is None


def test_a_new_generation_learns_its_pace_anew():
    clock = Clock()
    watch = HangWatch(1.5, clock)
    for t in (0.0, 1.0, 2.0, 3.0):
        clock.t = t
        watch.step_read()
    assert watch.probe_after_s() == 1.5
    watch.new_generation()
    for t in (10.0, 14.0, 18.0):  # its first three reads: two intervals, no pace yet
        clock.t = t
        watch.step_read()
        assert watch.probe_after_s() is None
    clock.t = 22.0
    watch.step_read()
    assert list(watch.intervals) == [4.0, 4.0, 4.0] and watch.probe_after_s() == 6.0


def test_a_rebuilt_generation_is_not_probed_before_its_own_pace(make):
    """Its first steps are bounded by elastic.step_timeout_s alone, not probed at the pace of the
    generation before (a live rank slow in them was killed as hung at load ~25)."""
    r = make("train.steps=12")
    r.group.fail(RankCalls.train_step, 1, "die", at=6)
    r.steps(6)  # start, steps 1-5: a pace is known
    assert r.c.context.hang_watch.probe_after_s() == PROBE_FLOOR_S
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING  # generation 2, from the checkpoint of step 4
    assert r.c.context.hang_watch.probe_after_s() is None
    asked_before = _statuses(r).count(2)
    r.group.fail(RankCalls.train_step, 2, "hang", at=5)  # the new generation's first step
    assert r.c.advance() == State.REBUILDING
    hang = r.events("failure")[-1]
    assert r.c.generation.members[1] == 2  # actor 2 is world rank 1 of generation 2 (dp=2)
    assert hang["ranks"] == [1] and hang["reason"] == "no progress within elastic.step_timeout_s"
    assert r.group.killed == [1, 2]
    assert _statuses(r).count(2) == asked_before + 1  # settle's poll only, no probe


def test_a_member_silent_after_a_peer_broke_the_step_is_not_said_to_have_timed_out(make):
    """Actor 1 dies in step 3 (no pace yet: no probe while the step runs) and actor 2 is stopped in it:
    the step breaks on the death long before elastic.step_timeout_s, and settle's probe finds actor 2
    silent. Its reason says so (stopped, wedged, or its node gone: a node that vanished looks the same),
    not "no progress within elastic.step_timeout_s", which had not passed; still a hang in the report."""
    from orchestrator.report.goodput import failure_kind

    r = make("train.steps=10")
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.group.fail(RankCalls.train_step, 2, "hang", at=3)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [1, 2] and "step_timeout_s" not in failure["reason"]
    assert "no answer to a liveness probe after the step broke" in failure["reason"]
    assert failure_kind(failure, set()) == "hang" and sorted(r.group.killed) == [1, 2]


def _statuses(r) -> list[int]:
    return [actor for actor, _ in r.group.calls(RankCalls.status)]


def test_a_rank_that_answers_no_probe_is_hung_at_once(make):
    r = make("train.steps=10")
    r.group.fail(RankCalls.train_step, 2, "hang", at=6)
    r.steps(6)  # start, steps 1-5: a pace is known
    assert r.c.context.hang_watch.probe_after_s() == PROBE_FLOOR_S
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [2] and failure["step"] == 6
    assert failure["reason"].startswith("no answer within 1.0 s to a liveness probe while step 6 ran")
    assert r.group.killed == [2]
    # Probed once (the survivors were blocked in the step, so they are asked too); settle did not
    # ask the hung actor again, only the rest.
    assert _statuses(r).count(2) == 1
    r.steps(1)
    assert r.c.generation.number == 2 and 2 not in r.c.generation.members.values()


def test_a_slow_step_with_every_rank_answering_runs_to_the_step_timeout(make):
    r = make("train.steps=10")
    for actor in range(4):
        r.group.fail(RankCalls.train_step, actor, "slow", at=6)
    r.steps(6)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [] and failure["reason"].startswith("step 6 exceeded elastic.step_timeout_s=120")
    assert r.group.killed == []
    assert _statuses(r).count(0) > 1  # probed again and again: each time every rank answered


@pytest.mark.parametrize("factor,at", [("0", 6), ("3", 3)])
def test_no_probes_when_off_or_before_the_pace_is_known(make, factor, at):
    r = make("train.steps=10", f"elastic.hang_probe_factor={factor}")
    r.group.fail(RankCalls.train_step, 2, "hang", at=at)
    r.steps(at)
    assert r.c.advance() == State.REBUILDING
    failure, = r.events("failure")
    assert failure["ranks"] == [2] and failure["reason"] == "no progress within elastic.step_timeout_s"
    assert _statuses(r).count(2) == 1  # settle's poll only


class AnsweringAt:
    """A status fan-out whose actors answer at scripted times (None: never); each read advances the
    clock by its timeout, as a wait with nothing arriving would."""

    def __init__(self, answers: dict[int, float | None]) -> None:
        self.answers, self.clock = answers, Clock()

    def submit(self, actors, method):
        assert method is RankCalls.status
        return {f"ref{a}": a for a in actors}

    def collect(self, refs, timeout_s):
        self.clock.t += timeout_s
        out = CallOutcome()
        for ref, actor in refs.items():
            at = self.answers[actor]
            if at is not None and at <= self.clock.t:
                out.results[actor] = "status"
            else:
                out.pending.append(actor)
                out.pending_refs[ref] = actor
        return out


@pytest.mark.parametrize("answers,silent,given", [
    ({0: 0.01, 1: 0.01, 2: None}, {2}, hang_watch.PROBE_QUIET_FLOOR_S),  # peers fast: 1 s for the silent
    ({0: 0.01, 1: 0.6, 2: None}, {2}, hang_watch.PROBE_ANSWER_S),  # a slow peer: the full 2 s
    ({0: 0.01, 1: 0.9, 2: 0.95}, set(), None),  # slow but inside the floor: alive
    ({0: None, 1: None, 2: None}, {0, 1, 2}, hang_watch.PROBE_ANSWER_S),  # nobody answers: the full wait
])
def test_a_probe_gives_the_silent_ranks_ten_times_their_peers_slowest_answer(answers, silent, given):
    group = AnsweringAt(answers)
    polled, waited = hang_watch.probe(group, sorted(answers), group.clock)
    assert set(polled.pending) == silent and set(polled.results) == set(answers) - silent
    if silent:  # given that long, and no longer
        assert waited == pytest.approx(given) and group.clock.t == pytest.approx(given, abs=1e-9)
    else:  # every answer read as soon as it came
        assert group.clock.t == pytest.approx(max(answers.values()), abs=hang_watch.PROBE_POLL_S)


class StallingClock(Clock):
    """A clock that jumps ``stall_s`` at its ``at``-th read: the driver stalled there (the GIL, a slow
    ``ray.nodes()``) while the ranks' answers kept arriving."""

    def __init__(self, stall_s: float, at: int) -> None:
        super().__init__()
        self.stall_s, self.at, self.reads = stall_s, at, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads == self.at:
            self.t += self.stall_s
        return self.t


@pytest.mark.parametrize("at", [2, 3])  # right after the probe was sent, or after its first read
def test_a_driver_stalled_past_the_probe_wait_marks_no_live_rank_hung(at):
    group = AnsweringAt({0: 0.01, 1: 0.05, 2: None})  # 2 is really stopped
    group.clock = StallingClock(3.0, at)  # longer than PROBE_ANSWER_S
    polled, _ = hang_watch.probe(group, [0, 1, 2], group.clock)
    assert set(polled.results) == {0, 1} and polled.pending == [2]


class CompilingRanks:
    """Ranks whose step answers at ``done_at`` (None: never) and whose status says they compiled
    ``min(now, compile_until)`` seconds inside the step (``train.compile``); each read advances the
    clock by its timeout, as a wait with nothing arriving would."""

    def __init__(self, done_at: float | None, compile_until: float) -> None:
        self.done_at, self.compile_until, self.clock = done_at, compile_until, Clock()

    def submit(self, actors, method):
        return {(method, a): a for a in actors}

    def collect(self, refs, timeout_s, stop_early=None):
        self.clock.t += timeout_s
        out = CallOutcome()
        for ref, actor in refs.items():
            if ref[0] is RankCalls.status:
                out.results[actor] = WorkerStatus(world_rank=actor, pid=100 + actor, generation=1, busy=True,
                                                  step=6, error=None,
                                                  step_compile_s=min(self.clock.t, self.compile_until))
            elif self.done_at is not None and self.clock.t >= self.done_at:
                out.results[actor] = f"step of {actor}"
            else:
                out.pending.append(actor)
                out.pending_refs[ref] = actor
        return out


def _watch(clock, paced: bool) -> HangWatch:
    watch = HangWatch(3.0 if paced else 0.0, clock)
    watch.intervals.extend([1.0] * MIN_HISTORY)  # paced: probed every 3 s into the step
    return watch


@pytest.mark.parametrize("paced", [False, True])
@pytest.mark.parametrize("done_at,compile_until,answered,ran", [
    (30.0, 25.0, True, 30.0),  # 25 s compiling + 5 s of work: inside a 10 s step_timeout_s
    (30.0, 0.0, False, 10.0),  # nothing compiled: the step times out as before
    (None, 25.0, False, 35.0),  # compiled 25 s, then stuck: 10 s of step time after the compile
])
def test_compile_time_inside_a_step_is_not_step_time(paced, done_at, compile_until, answered, ran):
    _check_step_bound(CompilingRanks(done_at, compile_until), paced, answered, ran)


class ProgressingRanks(CompilingRanks):
    """As ``CompilingRanks``, but the status says how long ago the rank last progressed in its step
    (``stalled_s``): an action done every second until ``progress_until`` (None: no status field,
    as a rank outside a step answers), then nothing."""

    def __init__(self, done_at: float | None, progress_until: float | None) -> None:
        super().__init__(done_at, 0.0)
        self.progress_until = progress_until

    def collect(self, refs, timeout_s, stop_early=None):
        out = super().collect(refs, timeout_s, stop_early)
        now = self.clock.t
        for actor, status in list(out.results.items()):
            if isinstance(status, WorkerStatus) and self.progress_until is not None:
                last = min(float(int(now)), self.progress_until)  # the last whole second it finished an action
                out.results[actor] = replace(status, stalled_s=now - last)
        return out


@pytest.mark.parametrize("paced", [False, True])
@pytest.mark.parametrize("done_at,progress_until,answered,ran", [
    (40.0, 40.0, True, 40.0),  # 4x a 10 s step_timeout_s, progressing all along: waited for
    (None, 15.0, False, 25.0),  # progressed until 15 s, then wedged: fails 10 s after its last progress
    (None, None, False, 10.0),  # no progress reported: the step times out at step_timeout_s as before
])
def test_a_step_fails_only_after_step_timeout_without_progress(paced, done_at, progress_until, answered, ran):
    _check_step_bound(ProgressingRanks(done_at, progress_until), paced, answered, ran)


def _check_step_bound(group: CompilingRanks, paced: bool, answered: bool, ran: float) -> None:
    """Step 6 on ``group`` with a 10 s ``elastic.step_timeout_s``: whether both ranks' answers came
    (``answered``; else both still pending, none called hung) and the time it was read until (``ran``)."""
    refs = group.submit([0, 1], RankCalls.train_step)
    outcome = hang_watch.collect_watching(group, refs, 10.0, None, _watch(group.clock, paced), step=6)
    assert (set(outcome.results) == {0, 1}) == answered
    assert outcome.pending == ([] if answered else [0, 1]) and not outcome.hung
    assert group.clock.t == pytest.approx(ran, abs=3.1)  # read in probe-sized chunks when paced


# -- one definition of "hung": the probe decides it wherever the driver asks (#38) --------------------
class SilentAfterTheStep:
    """A broken step's survivors on a scripted group: ``silent`` actors answer no status call (stopped),
    the others answer every one; a kick frees every live survivor. Records how each was asked."""

    def __init__(self, members: list[int], silent: set[int], node_ids: dict[int, str] | None = None,
                 dead: set[int] = frozenset()) -> None:
        self.live, self.silent, self.dead = set(members), set(silent), set(dead)  # dead: a probe raises ActorDiedError
        self.node_ids = dict(node_ids or {})  # actor id -> Ray node id (none known: no spare is beside)
        self.killed: list[int] = []
        self.status_asked: list[tuple[str, int]] = []  # ("probe" | "call", actor)
        self.kicked = False

    @property
    def live_ids(self) -> list[int]:
        return sorted(self.live)

    def exited(self, actor_ids) -> set[int]:
        return set()

    def driver_node(self) -> str:
        return "driver"

    def kill_now(self, actor_ids) -> None:
        self.killed += sorted(actor_ids)
        self.live -= set(actor_ids)

    def call(self, actor_ids, method, args=(), *, timeout_s: float) -> CallOutcome:
        self.status_asked += [("call", a) for a in actor_ids if method is RankCalls.status]
        self.kicked |= method is RankCalls.kick
        return CallOutcome(results={a: 1 for a in actor_ids if a not in self.silent})

    def submit(self, actor_ids, method):
        assert method is RankCalls.status
        self.status_asked += [("probe", a) for a in actor_ids]
        return {("status", a): a for a in actor_ids}

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        out = CallOutcome()
        for ref, actor in refs.items():
            if isinstance(ref, tuple) and actor in self.dead:
                out.dead[actor] = "ActorDiedError"
            elif isinstance(ref, tuple) and actor not in self.silent:
                out.results[actor] = WorkerStatus(world_rank=actor, pid=1, generation=1, busy=True, step=6, error=None)
            elif not isinstance(ref, tuple) and self.kicked:
                out.results[actor] = "kicked out of the step"
            else:
                out.pending.append(actor)
                out.pending_refs[ref] = actor
        return out


def test_settle_sorts_the_hung_from_the_blocked_with_the_probe():
    """The survivors still inside a broken call are asked by ``hang_watch.probe`` (no poll of its own):
    the silent one is hung, blamed with the caller's reason and killed; the others are kicked free."""
    from orchestrator.recovery import settle

    group = SilentAfterTheStep([0, 1, 2, 3], silent={2})
    broken = CallOutcome(dead={3: "ActorDiedError"}, pending=[0, 1, 2],
                         pending_refs={"step0": 0, "step1": 1, "step2": 2})
    found = settle.free_broken_call(group, broken, [0, 1, 2, 3], listeners={}, wait_s=5.0, hang_reason="hung in step 6")
    assert found.lost == {2, 3} and found.reasons[2] == "hung in step 6" and group.killed == [2, 3]
    assert sorted(group.status_asked) == [("probe", 0), ("probe", 1), ("probe", 2)]  # each once, by the probe
    assert not hasattr(settle, "STATUS_POLL_S")  # the second definition is gone


def test_settle_drops_the_silent_spares_beside_a_lost_member_and_asks_no_other():
    """Member 3 died on node b: the spares on node b are probed (4 silent: gone with the node, dropped
    and killed but not blamed; 6 answers and stays); spare 5 on node a is not asked, silent or not.
    The members that returned from the call (0, 1, 2) are asked in the same probe, judged not at all:
    their answers give the silent spare the quiet window (1.0 s), not the probe's whole 2.0 s."""
    from orchestrator.recovery import settle
    from orchestrator.recovery.hang_watch import PROBE_QUIET_FLOOR_S

    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "b", 5: "a", 6: "b"}
    group = SilentAfterTheStep([0, 1, 2, 3, 4, 5, 6], silent={4, 5}, node_ids=nodes)
    broken = CallOutcome(dead={3: "ActorDiedError"}, results={0: "error", 1: "error", 2: "error"})
    found = settle.free_broken_call(group, broken, [0, 1, 2, 3], listeners={}, wait_s=5.0, hang_reason="hung")
    assert found.lost == {3} and set(found.spares_lost) == {4}
    assert found.spares_lost[4] == f"no answer within {PROBE_QUIET_FLOOR_S:.1f} s to a liveness probe"
    assert sorted(group.status_asked) == [("probe", 0), ("probe", 1), ("probe", 2), ("probe", 4), ("probe", 6)]
    assert group.killed == [3, 4] and group.live_ids == [0, 1, 2, 5, 6]


def test_settle_asks_a_vanished_nodes_member_and_spare_in_one_probe_beside_the_returned():
    """A node vanished with member 2 and spare 4 on it (neither answers; Ray has not reported them dead):
    the survivors' step already failed (connection reset), so no member is left to answer beside the
    silent ones. One probe asks 2 and 4 with the returned survivors 0 and 1: 2 is hung, 4 is dropped
    within the quiet window, each asked once; spare 5, beside the live members on node a, stays."""
    from orchestrator.recovery import settle
    from orchestrator.recovery.hang_watch import PROBE_QUIET_FLOOR_S

    nodes = {0: "a", 1: "a", 2: "b", 4: "b", 5: "a"}
    group = SilentAfterTheStep([0, 1, 2, 4, 5], silent={2, 4}, node_ids=nodes)
    broken = CallOutcome(failed={0: "RuntimeError: Connection reset by peer", 1: "RuntimeError: Connection reset"},
                         pending=[2], pending_refs={"step2": 2})
    found = settle.free_broken_call(group, broken, [0, 1, 2], listeners={}, wait_s=5.0, hang_reason="silent")
    assert found.lost == {2} and found.reasons[2] == "silent"
    assert found.spares_lost == {4: f"no answer within {PROBE_QUIET_FLOOR_S:.1f} s to a liveness probe"}
    assert sorted(group.status_asked) == [("probe", 0), ("probe", 1), ("probe", 2), ("probe", 4)]
    assert group.killed == [2, 4] and group.live_ids == [0, 1, 5]


def test_settle_drops_a_spare_its_probe_found_dead_though_no_member_on_its_node_was_lost():
    """Member 2 is still inside the call on node b and answers (alive): spare 4 beside it is asked in the
    same probe and found dead (ActorDiedError): it is dropped, not left for the next formation to
    promote; spare 5 there answers and stays."""
    from orchestrator.recovery import settle

    nodes = {0: "a", 1: "a", 2: "b", 4: "b", 5: "b"}
    group = SilentAfterTheStep([0, 1, 2, 4, 5], silent=set(), node_ids=nodes, dead={4})
    broken = CallOutcome(dead={1: "ActorDiedError"}, results={0: "error"}, pending=[2], pending_refs={"step2": 2})
    found = settle.free_broken_call(group, broken, [0, 1, 2], listeners={}, wait_s=5.0, hang_reason="hung")
    assert found.lost == {1} and set(found.spares_lost) == {4} and "found it dead" in found.spares_lost[4]
    assert sorted(group.killed) == [1, 4] and group.live_ids == [0, 2, 5]


def test_a_broken_join_asks_no_returned_member_for_reference():
    """In a join or a load (``while_alive``) a host may stall as a whole: members idle elsewhere are not
    asked beside the silent, who keep the probe's whole wait (no quiet window from the idle)."""
    from orchestrator.recovery import settle
    from orchestrator.recovery.hang_watch import PROBE_ANSWER_S

    nodes = {0: "a", 1: "a", 2: "b", 4: "b"}
    group = SilentAfterTheStep([0, 1, 2, 4], silent={2, 4}, node_ids=nodes)
    broken = CallOutcome(failed={0: "RuntimeError: x", 1: "RuntimeError: y"}, pending=[2], pending_refs={"join2": 2})
    found = settle.free_broken_call(group, broken, [0, 1, 2], listeners={}, wait_s=5.0, hang_reason="silent",
                                    while_alive=True)
    assert sorted(group.status_asked) == [("probe", 2), ("probe", 4)]
    assert found.lost == {2} and found.spares_lost == {4: f"no answer within {PROBE_ANSWER_S:.1f} s to a liveness probe"}


def test_settle_asks_no_spare_on_the_drivers_node():
    """A member lost on the driver's own node crashed (the node is up: the driver runs there), so the
    spare beside it is not asked, even one that would not answer."""
    from orchestrator.recovery import settle

    group = SilentAfterTheStep([0, 1, 2], silent={2}, node_ids={0: "driver", 1: "a", 2: "driver"})
    broken = CallOutcome(dead={0: "ActorDiedError"}, results={1: "error"})
    found = settle.free_broken_call(group, broken, [0, 1], listeners={}, wait_s=5.0, hang_reason="hung")
    assert found.lost == {0} and not found.spares_lost and group.status_asked == []
    assert group.killed == [0] and group.live_ids == [1, 2]


def test_a_save_before_a_resize_that_failed_asks_the_probe_who_is_hung(make):
    """control/formation.save_before_reform: the pre-resize save failed; a member that answers no probe
    is hung (a failure to recover from, blamed on it, not asked again by settle); with every member
    answering, the save failing is storage failing (Errored)."""
    r = make()
    r.c.resize_requests = {4: 2}
    r.group.fail(RankCalls.save_checkpoint, 1, "hang", at=3)  # the step-3 save before the resize
    r.steps(4)  # start, steps 1-3
    assert r.c.advance() == State.FORMING  # the step-4 boundary decides the resize
    assert r.c.advance() == State.REBUILDING  # the save broke: actor 1 answers no probe
    failure, = r.events("failure")
    assert failure["ranks"] == [1] and "liveness probe after a save failed" in failure["reason"]
    assert r.group.killed == [1]
    # Asked twice: by the save's own wait (collect_while_alive) and after the save failed; never by settle.
    assert _statuses(r).count(1) == 2
    assert r.c.advance() == State.RUNNING and r.c.generation.shape.dp == 2


def test_a_save_before_a_resize_that_failed_with_every_member_answering_is_storage_failing(make):
    r = make()
    r.c.resize_requests = {4: 2}
    r.group.fail(RankCalls.wait_checkpoint, 0, "raise", at=3, message="OSError: [Errno 28] No space left on device")
    r.steps(4)
    assert r.c.advance() == State.FORMING
    assert r.c.advance() == State.ERRORED and "No space left" in str(r.c.error)
    assert r.group.killed == [] and not r.events("failure")
