"""Goodput accounting of a run from its metrics JSONL, in the form of Google's ML Goodput.

Every second of the run's wall time lands in exactly one bucket: ``useful`` (the step time of the
steps that count: each step's last record), ``startup`` (launch to the first step), ``checkpoint``
(the steps' checkpoint stalls, and from the last step to ``done``: the final saves), ``snapshot`` (in-memory snapshot stalls),
``evaluation``, ``recovery`` by fault kind (``failure``, ``hang``, ``preemption``, ``eviction``,
``grow``, ``resize``, ``rollback``: detection, re-forming and reloading), ``rerun`` (steps trained
and then lost: re-run after a recovery, or discarded as bad), ``overhead`` (the driver's time
between steps) and ``down`` (between two processes of one run, e.g. after a stop until the resume).

How: records are taken in file order, each with its ``time`` (when it was written). The gap since
the previous record is given to the bucket of what happened in it: the step time of a step record,
the stall of the checkpoint or snapshot taken after the previous step, an open recovery, ... so the
buckets partition the time from the first ``launch`` to the last record exactly. A recovery opens at
a ``failure`` (from the last step or progress record before it: the failed step and its detection,
markers written on the way included), an ``evict`` (the save
before it included) or an evacuating ``preemption``, and closes when the next generation starts its
first step (that step's record minus its step time); a grow or requested resize has no opening
record: its gap is the one that ends with the new generation's first step (README, "Report").

A run still going is accounted up to its last record; a last line cut in the middle is left out.
Pure: no matplotlib, no Ray; ``bench/chaos.py`` prints its goodput through ``account`` too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

BUCKETS = ("useful", "startup", "checkpoint", "snapshot", "evaluation", "recovery", "rerun", "overhead", "down")
FAULT_KINDS = ("failure", "hang", "preemption", "eviction", "grow", "resize", "rollback")
HANG_WORDS = ("step_timeout_s", "no progress", "no answer within", "no answer to a liveness probe")


def is_step(rec: dict) -> bool:
    return "event" not in rec and "step" in rec and "loss" in rec


@dataclass
class Recovery:
    """One recovery episode: the fault kind, when it began and ended (the run's clock), what caused it."""

    kind: str
    start: float
    end: float | None = None
    generation: int | None = None  # the generation it formed
    reason: str = ""
    failures: int = 0  # failure events inside it (a failed re-forming adds one)

    @property
    def seconds(self) -> float:
        return 0.0 if self.end is None else max(0.0, self.end - self.start)


@dataclass
class Ledger:
    """The accounting (see the module docstring); ``as_dict`` is what ``report.json`` holds."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    recovery_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0.0))
    recoveries: list[Recovery] = field(default_factory=list)
    wall_s: float = 0.0
    start: float | None = None
    end: float | None = None
    steps_final: int = 0  # distinct steps trained
    step_records: int = 0
    steps_rerun: int = 0  # step records superseded by a later record of the same step
    bad_steps: int = 0
    restarts: int = 0  # failure events
    generations: int = 0
    sessions: int = 0  # processes (launch records)
    finished: bool = False  # a done or stopped event closes the file
    untimed_steps: int = 0  # step records without a time (older files): placed after the previous record

    def add(self, bucket: str, seconds: float, kind: str | None = None) -> None:
        self.seconds[bucket] += seconds
        if kind is not None:
            self.recovery_by_kind[kind] = self.recovery_by_kind.get(kind, 0.0) + seconds

    @property
    def goodput(self) -> float:
        return self.seconds["useful"] / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        total = sum(self.seconds.values())
        return {
            "wall_s": self.wall_s, "accounted_s": total, "goodput": self.goodput,
            "seconds": dict(self.seconds), "recovery_by_kind": dict(self.recovery_by_kind),
            "fractions": {k: (v / self.wall_s if self.wall_s > 0 else 0.0) for k, v in self.seconds.items()},
            "recoveries": [{"kind": r.kind, "start": r.start, "end": r.end, "seconds": r.seconds,
                            "generation": r.generation, "failures": r.failures, "reason": r.reason}
                           for r in self.recoveries],
            "steps": {"final": self.steps_final, "records": self.step_records, "rerun": self.steps_rerun,
                      "bad": self.bad_steps},
            "restarts": self.restarts, "generations": self.generations, "sessions": self.sessions,
            "finished": self.finished, "start": self.start, "end": self.end, "untimed_steps": self.untimed_steps,
        }


def failure_kind(rec: dict, preempted_ranks: set[int]) -> str:
    """``hang`` for a timeout, ``preemption`` when every blamed rank was on a draining node, else ``failure``."""
    ranks = set(rec.get("ranks") or ())
    if ranks and ranks <= preempted_ranks:
        return "preemption"
    reason = str(rec.get("reason", ""))
    return "hang" if any(w in reason for w in HANG_WORDS) else "failure"


def _sessions(records: list[dict]) -> list[list[dict]]:
    """The records split at each ``launch`` (one process each); records before the first launch
    (a file written by a harness without one) form a session of their own."""
    out: list[list[dict]] = []
    for rec in records:
        if rec.get("event") == "launch" or not out:
            out.append([])
        out[-1].append(rec)
    return out


def _times(session: list[dict], ledger: Ledger) -> list[float]:
    """Each record's time; a step record without one (written before step records had it) is put
    its step time after the previous record."""
    times: list[float] = []
    for rec in session:
        t = rec.get("time")
        if not isinstance(t, (int, float)):
            ledger.untimed_steps += is_step(rec)
            t = (times[-1] if times else 0.0) + float(rec.get("step_time_s", 0.0))
        times.append(float(t))
    return times


def account(records: list[dict]) -> Ledger:
    """The ``Ledger`` of a run's records, in file order (see the module docstring)."""
    ledger = Ledger()
    steps = [r for r in records if is_step(r)]
    last_index = {r["step"]: i for i, r in enumerate(steps)}
    final = {id(steps[i]) for i in last_index.values()}
    ledger.steps_final, ledger.step_records = len(last_index), len(steps)
    ledger.steps_rerun = len(steps) - len(last_index)
    previous_end = None
    for session in _sessions(records):
        times = _times(session, ledger)
        if previous_end is not None and times[0] > previous_end:
            ledger.add("down", times[0] - previous_end)
        _account_session(session, times, final, ledger)
        ledger.start = times[0] if ledger.start is None else ledger.start
        previous_end = max(times)
        ledger.end = previous_end
    ledger.wall_s = (ledger.end - ledger.start) if ledger.start is not None else 0.0
    return ledger


def _stalls(session: list[dict]) -> dict[int, tuple[float, float]]:
    """Step record index -> (checkpoint stall, snapshot stall) taken after it: the first event of each
    kind naming its step that comes after it and before the step's next record. Keyed by record, not
    by step: a re-run step's first try has its own stalls (a snapshot event comes a step or two late,
    once its relay is done, so an event is matched to the newest record of its step so far)."""
    found: dict[int, dict[str, float]] = {}
    newest: dict[int, int] = {}  # step -> index of its newest record so far
    for i, rec in enumerate(session):
        if is_step(rec):
            newest[rec["step"]] = i
            found[i] = {}
        elif rec.get("event") in ("checkpoint", "snapshot") and rec.get("step") in newest:
            found[newest[rec["step"]]].setdefault(rec["event"], float(rec.get("stall_s") or 0.0))
    return {i: (f.get("checkpoint", 0.0), f.get("snapshot", 0.0)) for i, f in found.items()}


def _opens(rec: dict) -> bool:
    """A record that opens a recovery: a failure, an eviction, a preemption that evacuates ranks."""
    event = rec.get("event")
    return event in ("failure", "evict") or (event == "preemption" and rec.get("action") == "evacuate"
                                             and bool(rec.get("ranks")))


def _resizes(session: list[dict]) -> dict[int, str]:
    """Record index -> "grow" / "resize" for the records of a re-forming that no fault record opened:
    those after the last step (or eval) record before a new generation's first step; and ->
    "eviction" for the checkpoint records of the save an ``evict`` record follows."""
    out: dict[int, str] = {}
    prev = None  # index of the previous step record
    for j, rec in enumerate(session):
        if not is_step(rec):
            continue
        if prev is not None and rec.get("generation") != session[prev].get("generation") and \
                not any(_opens(r) for r in session[prev + 1:j]):
            begin = max([prev] + [i for i in range(prev + 1, j) if session[i].get("event") == "eval"])
            found = [r for r in session[j:] if r.get("event") in ("rebuild", "grow")
                     and r.get("generation") == rec.get("generation")]
            kind = "grow" if found and (found[0]["event"] == "grow" or found[0].get("reason") == "grow") else "resize"
            out.update(dict.fromkeys(range(begin + 1, j + 1), kind))
        prev = j
    for j, rec in enumerate(session):  # an eviction saves the step first: that save is part of it
        if rec.get("event") == "evict":
            k = j
            while k > 0 and session[k - 1].get("event") == "checkpoint" and session[k - 1].get("step") == rec.get("step"):
                k -= 1
            out.update(dict.fromkeys(range(k, j), "eviction"))
    return out


@dataclass
class _SessionWalk:
    """Where the walk through one session's records stands (``_account_session``)."""

    stalls: dict[int, tuple[float, float]]  # step record index -> (checkpoint, snapshot) stall after it
    resizes: dict[int, str]  # record index -> the re-forming no fault record opened (``_resizes``)
    last_step: int  # index of the session's last step record
    finishing: bool  # a done/stopped event follows the last step
    cursor: float  # the time accounted up to
    started: bool = False  # the session's first step trained: start-up is over
    episode: Recovery | None = None
    # Ranks of drain notices too short for a save (the failure path follows).
    preempted: set[int] = field(default_factory=set)
    due: list[list] = field(default_factory=list)  # [bucket, seconds] stalls still to take from the next gaps
    # Seconds before a marker event (a snapshot or checkpoint completing, a spare requested...) that
    # the next step record takes as part of its own gap: with steps in flight the driver logs the
    # acknowledgements that come with step k's results just before step k's record, so the marker,
    # not the step, closes the interval in which step k trained (control/window.py). A failure
    # record instead takes it into the recovery it opens (the step in flight was lost).
    carry: float = 0.0


def _account_session(session: list[dict], times: list[float], final: set[int], ledger: Ledger) -> None:
    ledger.sessions += session[0].get("event") == "launch"
    # After the session's last step, a finished run only waits for its last saves to commit (their
    # checkpoint/snapshot events come in that wait) before ``done``/``stopped``: all of it is checkpoint.
    last_step = max((i for i, rec in enumerate(session) if is_step(rec)), default=len(session))
    finishing = any(r.get("event") in ("done", "stopped") for r in session[last_step + 1:])
    walk = _SessionWalk(_stalls(session), _resizes(session), last_step, finishing, cursor=times[0])
    for i, (rec, t) in enumerate(zip(session, times)):
        gap, walk.cursor = max(0.0, t - walk.cursor), max(walk.cursor, t)
        if is_step(rec):
            gap, walk.carry = gap + walk.carry, 0.0
        elif walk.carry and not _marker(rec, walk.episode, walk.started):
            if walk.episode is None and rec.get("event") == "failure":
                # The step in flight since the last step record was lost, whatever markers (a spare
                # found gone, an ack) were logged on the way to the failure: its recovery starts there.
                gap += walk.carry
            else:
                _spend(walk.due, walk.carry, "overhead", ledger)  # as the marker's own gap was spent before
            walk.carry = 0.0
        if walk.episode is None and i in walk.resizes:  # a grow or requested resize begins with this gap
            walk.episode = Recovery(walk.resizes[i], t - gap)
            ledger.recoveries.append(walk.episode)
            walk.due = []
        if is_step(rec):
            _account_step(walk, ledger, i, rec, t, gap, final)
            continue
        gap = _note_fault(walk, ledger, rec, t, gap)
        if walk.episode is not None:
            walk.episode.failures += rec.get("event") == "failure"
            ledger.add("recovery", gap, walk.episode.kind)
            walk.episode.end = t  # until a step closes it (a run still going ends here)
            continue
        _account_between_steps(walk, ledger, i, rec, t, gap)
    _spend(walk.due, walk.carry, "overhead", ledger)


def _account_step(walk: _SessionWalk, ledger: Ledger, i: int, rec: dict, t: float, gap: float,
                  final: set[int]) -> None:
    """A step record: its step time is useful (or rerun); the rest of its gap closes a recovery, ends
    the start-up, or goes to the stalls due and the driver's overhead."""
    taken = min(gap, float(rec.get("step_time_s") or 0.0))
    ledger.add("useful" if id(rec) in final else "rerun", taken)
    rest = gap - taken
    if walk.episode is not None:  # the new generation's first step closes the recovery
        walk.episode.end, walk.episode.generation = t - taken, rec.get("generation")
        ledger.add("recovery", rest, walk.episode.kind)
        walk.episode = None
    elif not walk.started:
        ledger.add("startup", rest)
    else:
        _spend(walk.due, rest, "overhead", ledger)
    walk.started = True
    ledger.generations = max(ledger.generations, rec.get("generation") or 0)
    walk.due = [["checkpoint", walk.stalls[i][0]], ["snapshot", walk.stalls[i][1]]]


def _note_fault(walk: _SessionWalk, ledger: Ledger, rec: dict, t: float, gap: float) -> float:
    """Count a failure, remember a short drain's ranks, and open a recovery at a record that opens one;
    the gap still to account is returned (none after a preemption notice: spent as ordinary)."""
    event = rec.get("event")
    if event == "failure":
        ledger.restarts += 1
    if event == "preemption" and rec.get("action") != "evacuate":
        walk.preempted |= set(rec.get("ranks") or ())
    if _opens(rec) and walk.episode is None:  # (an eviction's episode opened at its save: ``_resizes``)
        kind = "eviction" if event == "evict" else "preemption" if event == "preemption" else \
            failure_kind(rec, walk.preempted)
        # A preemption notice comes at the step boundary: the gap before it is ordinary.
        walk.episode = Recovery(kind, t if event == "preemption" else t - gap, reason=str(rec.get("reason", ""))[:200])
        ledger.recoveries.append(walk.episode)
        if event == "preemption":
            _spend(walk.due, gap, "overhead", ledger)
            gap = 0.0
        walk.due = []
    return gap


def _account_between_steps(walk: _SessionWalk, ledger: Ledger, i: int, rec: dict, t: float, gap: float) -> None:
    """A record outside any recovery: start-up, an eval, the final saves, a bad step, a rollback, or a
    marker whose gap the next step takes (``_SessionWalk.carry``)."""
    event = rec.get("event")
    if not walk.started:
        ledger.add("startup", gap)
    elif event == "eval":
        _spend(walk.due, gap, "evaluation", ledger)
    elif event in ("done", "stopped") or (walk.finishing and i > walk.last_step):
        _spend(walk.due, gap, "checkpoint", ledger)  # the final saves are waited for
        ledger.finished = ledger.finished or event in ("done", "stopped")
    elif event == "bad_step" and rec.get("reason") != "recorded":
        ledger.bad_steps += 1
        _spend(walk.due, gap, "rerun", ledger)  # trained, then thrown away
    elif event == "rollback":
        ledger.add("recovery", gap, "rollback")
        ledger.recoveries.append(Recovery("rollback", t - gap, t, None, str(rec.get("restored_from", ""))))
    else:
        walk.carry += gap  # a marker: see ``_SessionWalk.carry``


def _marker(rec: dict, episode, started: bool) -> bool:
    """Whether ``rec`` may be a marker between steps (``_account_between_steps``' last branch), decided
    before the branches run so a carry is spent, as the old per-marker spend did, ahead of whatever
    else a record opens. Conservative: a record it rejects (a replayed ``bad_step`` "recorded" also
    lands in the last branch) only spends the carry earlier, as before the carry existed."""
    event = rec.get("event")
    return (episode is None and started and not _opens(rec)
            and event not in ("eval", "done", "stopped", "bad_step", "rollback"))


def _spend(due: list[list], gap: float, rest_bucket: str, ledger: Ledger) -> None:
    """Give ``gap`` to the stalls still due (in order, each at most what is left), the rest to ``rest_bucket``."""
    for item in due:
        taken = min(gap, item[1])
        if taken > 0:
            ledger.add(item[0], taken)
            item[1] -= taken
            gap -= taken
    ledger.add(rest_bucket, gap)


def per_kind_counts(ledger: Ledger) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for r in ledger.recoveries:
        counts[r.kind] += 1
    return dict(counts)
