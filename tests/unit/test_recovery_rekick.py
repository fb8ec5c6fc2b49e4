"""``orchestrator.recovery.settle`` kicks again the survivors that have not returned from a broken call
(a scripted group; no Ray, no processes).

Measured in the chaos bench (a rank killed, then another while the next generation joins): the kick
reached one survivor while it was still leaving the last generation; it then entered the rendezvous,
waited there for the dead rank, and returned only at the store timeout (15 s). A kick frees only a
rank already inside the rendezvous, so the ones still inside the call are kicked again.
"""

from __future__ import annotations

from meshspeak.messages import CallOutcome, WorkerStatus
from meshspeak.rank_calls import RankCalls
from orchestrator.recovery import settle as recovery


class LateJoiners:
    """A broken ``join_generation`` fan-out: ``late[actor]`` kicks pass before that survivor is inside
    the rendezvous (a kick before then frees nothing); the next kick frees it."""

    def __init__(self, members: list[int], dead: int, late: dict[int, int]) -> None:
        self.live = set(members) - {dead}
        self.node_ids: dict[int, str] = {}  # no node known: no spare is beside a lost member
        self.late = dict(late)
        self.returned: set[int] = set()
        self.kicks: list[list[int]] = []
        self.killed: list[int] = []
        self.collect_timeouts: list[float] = []

    @property
    def live_ids(self) -> list[int]:
        return sorted(self.live)

    def exited(self, actor_ids) -> set[int]:
        return set()  # every process still there (the survivors are alive, only late)

    def kill_now(self, actor_ids) -> None:
        self.killed += sorted(actor_ids)
        self.live -= set(actor_ids)

    def call(self, actor_ids, method, args=(), *, timeout_s: float) -> CallOutcome:
        assert method is RankCalls.kick
        out = CallOutcome()
        for actor in actor_ids:
            if self.late.get(actor, 0) > 0:
                self.late[actor] -= 1  # still leaving the last generation: nothing to shut yet
            else:
                self.returned.add(actor)  # its rendezvous fails at once
            out.results[actor] = 1
        self.kicks.append(sorted(actor_ids))
        return out

    def submit(self, actor_ids, method):  # a liveness probe (hang_watch.probe): every survivor answers
        assert method is RankCalls.status
        return {("status", a): a for a in actor_ids}

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        self.collect_timeouts.append(timeout_s)
        out = CallOutcome()
        for ref, actor in refs.items():
            if isinstance(ref, tuple):  # a probe's status call
                out.results[actor] = WorkerStatus(world_rank=0, pid=1, generation=1, busy=True, step=0, error=None)
            elif actor in self.returned:
                out.failed[actor] = "RuntimeError: kicked"
            else:
                out.pending.append(actor)
                out.pending_refs[ref] = actor
        return out


def broken_join(members: list[int], dead: int) -> CallOutcome:
    out = CallOutcome(dead={dead: "ActorDiedError"})
    out.pending = [a for a in members if a != dead]
    out.pending_refs = {f"ref{a}": a for a in out.pending}
    return out


def test_a_survivor_that_reached_the_rendezvous_after_the_kick_is_kicked_again():
    group = LateJoiners([0, 1, 2, 3], dead=3, late={2: 1})
    found = recovery.free_broken_call(group, broken_join([0, 1, 2, 3], 3), [0, 1, 2, 3], listeners={}, wait_s=20,
                            hang_reason="hung")
    assert found.lost == {3}  # before: actor 2 was waited for until the store timeout (here: killed)
    assert group.kicks == [[0, 1, 2], [2]]
    assert group.killed == [3]
    # kicked again soon, not a whole REKICK_S later
    assert group.collect_timeouts[0] <= recovery.REKICK_FIRST_S
    assert max(group.collect_timeouts) <= recovery.REKICK_S


def test_a_survivor_that_never_returns_is_killed_at_the_deadline():
    group = LateJoiners([0, 1, 2], dead=2, late={1: 10**6})
    found = recovery.free_broken_call(group, broken_join([0, 1, 2], 2), [0, 1, 2], listeners={}, wait_s=3,
                            hang_reason="hung")
    assert found.lost == {1, 2}
    assert found.reasons[1] == "did not return after the kick"
    assert len(group.kicks) <= 1 + len(recovery.rekick_waits(3))  # bounded even when no time passes


def test_re_kicks_come_soon_at_first_then_every_rekick_s():
    waits = recovery.rekick_waits(3.0)
    assert waits[0] == recovery.REKICK_FIRST_S < recovery.REKICK_S
    assert all(b == min(2 * a, recovery.REKICK_S) for a, b in zip(waits, waits[1:-1]))
    assert abs(sum(waits) - 3.0) < 1e-9 and max(waits) == recovery.REKICK_S
    assert recovery.rekick_waits(0.05) == [0.05]


def test_a_wedged_survivor_of_a_step_is_waited_for_a_few_steps_not_the_group_timeout():
    # Group timeout 15 s (+5): a training step's survivors get 3 steps, at least 5 s; a join or a
    # load (no pace) the whole bound.
    assert recovery.kicked_wait_s(20.0, None) == 20.0
    assert recovery.kicked_wait_s(20.0, 1.2) == recovery.KICKED_FLOOR_S == 5.0
    assert recovery.kicked_wait_s(20.0, 4.0) == 12.0
    assert recovery.kicked_wait_s(20.0, 30.0) == 20.0
    group = LateJoiners([0, 1, 2], dead=2, late={1: 10**6})
    found = recovery.free_broken_call(group, broken_join([0, 1, 2], 2), [0, 1, 2], listeners={},
                            wait_s=recovery.kicked_wait_s(20.0, 1.2), hang_reason="hung")
    assert found.lost == {1, 2} and found.reasons[1] == "did not return after the kick"


class ReadingJoiners(LateJoiners):
    """Survivors of a broken join still reading (a large checkpoint, a slow ``init_from``): a kick
    cannot stop a read; ``reads[actor]`` liveness probes after the kick pass before its read ends and
    its join returns (``probes`` counts those). ``silent`` actors answer no probe (stopped)."""

    def __init__(self, members: list[int], dead: int, reads: dict[int, int], silent: set[int] = frozenset()) -> None:
        super().__init__(members, dead, late={a: 10**6 for a in reads})
        self.reads, self.silent, self.probes = dict(reads), set(silent), 0

    def submit(self, actor_ids, method):
        assert method is RankCalls.status
        if not self.kicks:  # the probe sorting the broken call's survivors from the hung
            return super().submit(actor_ids, method)
        self.probes += 1
        for actor in actor_ids:
            if actor in self.reads and actor not in self.silent:
                self.reads[actor] -= 1
                if self.reads[actor] <= 0:
                    self.returned.add(actor)  # its read is done: the kicked join returns
        return {("status", a): a for a in actor_ids}

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        status = {r: a for r, a in refs.items() if isinstance(r, tuple)}
        out = super().collect({r: a for r, a in refs.items() if r not in status}, timeout_s)
        for actor in status.values():
            if actor in self.silent:
                out.pending.append(actor)
                out.pending_refs[("status", actor)] = actor
            else:
                out.results[actor] = WorkerStatus(world_rank=0, pid=1, generation=1, busy=True, step=0, error=None)
        return out


def test_a_survivor_still_reading_in_a_broken_join_is_waited_for_while_it_answers_probes():
    """#36 item 1: a kicked survivor of a join or load that is still reading returns only when its read
    does; it used to be killed as "did not return after the kick" after wait_s. Now each wait_s it is
    probed: alive, it is waited for again; one that answers no probe is killed as before."""
    group = ReadingJoiners([0, 1, 2, 3], dead=3, reads={1: 3, 2: 10**6}, silent={2})
    found = recovery.free_broken_call(group, broken_join([0, 1, 2, 3], 3), [0, 1, 2, 3], listeners={}, wait_s=3,
                                      hang_reason="hung", while_alive=True)
    assert found.lost == {2, 3}  # 1 waited for through three waits; 2 silent: killed
    # 2 answered no probe from the start: hung, killed with the dead one (hang_watch.probe decides it,
    # before the kick as after it)
    assert group.killed == [2, 3] and found.reasons[2] == "hung" and 1 in group.returned
    assert group.probes == 3
    stepping = ReadingJoiners([0, 1, 2], dead=2, reads={1: 3})  # a training step's survivor: no such wait
    found = recovery.free_broken_call(stepping, broken_join([0, 1, 2], 2), [0, 1, 2], listeners={}, wait_s=3,
                                      hang_reason="hung")
    assert found.lost == {1, 2} and stepping.probes == 0
