"""`elastimesh report`'s goodput accounting (orchestrator/report/goodput.py) against figures computed
here, independently, from the JSONL.

Two inputs: a hand-made record stream whose every bucket is worked out by hand below, and the
metrics of a real run with faults: ``tests/data/chaos_quick_metrics.jsonl``, the metrics copy of
``python bench/chaos.py --quick --metrics-copy ...`` (60 steps, dp=4 + 1 spare on a local
multi-node Ray, 9 injected faults of 9 kinds: kills, a hang, a node removal, a drain, a straggler
evicted, a grow back; recorded on this 2-core machine under load 30-60).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.report.goodput import BUCKETS, account, failure_kind

RECORDED = Path(__file__).resolve().parents[1] / "data" / "chaos_quick_metrics.jsonl"


def _step(step, t, st, gen, dp=2):
    return {"step": step, "loss": 5.0 - step * 0.1, "lr": 1e-3, "tokens": 512, "step_time_s": st,
            "tokens_per_s": 512 / st, "dp": dp, "pp": 1, "tp": 1, "generation": gen, "time": t}


def hand_made() -> list[dict]:
    return [
        {"event": "launch", "time": 100.0},
        {"event": "start", "generation": 1, "dp": 2, "pp": 1, "tp": 1, "time": 103.0},
        _step(1, 105.0, 1.5, 1),  # +0.5 start-up around its 1.5 s
        {"event": "checkpoint", "step": 1, "stall_s": 0.25, "write_s": 1.0, "time": 105.5},
        {"event": "snapshot", "step": 1, "stall_s": 0.1, "time": 105.6},
        _step(2, 107.0, 1.0, 1),  # lost below: re-run
        {"event": "failure", "step": 3, "ranks": [1], "reason": "ActorDiedError", "time": 110.0},
        _step(2, 113.0, 1.0, 2, dp=1),  # the re-run closes the failure's recovery at 112
        {"event": "rebuild", "generation": 2, "dp": 1, "pp": 1, "tp": 1, "reason": "failure",
         "recovery_s": 3.0, "time": 113.01},
        _step(3, 115.0, 1.5, 2, dp=1),
        {"event": "eval", "step": 3, "loss": 4.9, "perplexity": 134.0, "time": 116.0},
        _step(4, 120.0, 1.0, 3),  # a new generation no fault opened: a grow, from the eval on
        {"event": "grow", "generation": 3, "dp": 2, "pp": 1, "tp": 1, "reason": "grow", "time": 120.02},
        {"event": "done", "step": 4, "time": 121.0},
    ]


def test_hand_made_run_splits_as_worked_out() -> None:
    ledger = account(hand_made())
    expected = {
        "useful": 1.5 + 1.0 + 1.5 + 1.0,  # steps 1, 2 (its second record), 3, 4
        "rerun": 1.0,  # step 2's first record
        "startup": 3.0 + 0.5,
        "checkpoint": 0.25 + 1.0,  # step 1's stall, then last step to done: the final saves
        "snapshot": 0.1,
        "evaluation": 1.0,
        "recovery": (3.0 + 2.0) + 3.0,  # failure: detection 3 + re-forming 2; grow: 116 -> 119
        "overhead": 0.15 + 0.1 + 0.4 + 0.01 + 0.49,
        "down": 0.0,
    }
    assert ledger.wall_s == pytest.approx(21.0)
    for bucket in BUCKETS:
        assert ledger.seconds[bucket] == pytest.approx(expected[bucket], abs=1e-9), bucket
    assert ledger.recovery_by_kind["failure"] == pytest.approx(5.0)
    assert ledger.recovery_by_kind["grow"] == pytest.approx(3.0)
    assert [(r.kind, r.start, r.end, r.generation) for r in ledger.recoveries] == [
        ("failure", 107.0, 112.0, 2), ("grow", 116.0, 119.0, 3)]
    assert (ledger.steps_final, ledger.steps_rerun, ledger.restarts, ledger.generations) == (4, 1, 1, 3)
    assert ledger.finished


def test_a_run_still_going_and_a_second_process() -> None:
    records = hand_made()
    going = account(records[:7])  # cut inside the recovery: it is open, counted up to the last record
    assert going.wall_s == pytest.approx(10.0) and not going.finished
    assert going.recoveries[-1].kind == "failure" and going.recoveries[-1].end == 110.0
    assert sum(going.seconds.values()) == pytest.approx(going.wall_s)
    # A resumed process appends to the same file: the time between the two is "down".
    resumed = records + [{"event": "launch", "time": 130.0}, {"event": "start", "generation": 1, "time": 131.0},
                         _step(5, 133.0, 1.0, 1), {"event": "done", "step": 5, "time": 133.5}]
    ledger = account(resumed)
    assert ledger.seconds["down"] == pytest.approx(9.0) and ledger.sessions == 2
    assert ledger.seconds["startup"] == pytest.approx(3.5 + 1.0 + 1.0)  # launch -> start, start -> step 5
    assert sum(ledger.seconds.values()) == pytest.approx(33.5) == pytest.approx(ledger.wall_s)


def test_a_failure_recovers_from_the_last_step_though_markers_came_before_it() -> None:
    """A node removal: the step in flight since step 2's record is lost, and on the way to the failure
    record the driver wrote a ``spares_lost`` marker (a spare gone with the node, found by the same
    probe). The recovery starts at step 2's record, as without the marker: the 2.4 s before it are
    not the driver's overhead between steps (the chaos bench had them there)."""
    records = [{"event": "launch", "time": 100.0}, {"event": "start", "generation": 1, "time": 101.0},
               _step(1, 102.0, 1.0, 1), _step(2, 103.0, 1.0, 1),
               {"event": "spares_lost", "actors": [6], "reason": "its probe found it dead", "time": 105.4},
               {"event": "failure", "step": 3, "ranks": [0], "reason": "ActorDiedError", "time": 105.4},
               _step(2, 108.0, 1.0, 2), {"event": "rebuild", "generation": 2, "reason": "failure", "time": 108.01},
               {"event": "done", "step": 2, "time": 108.1}]
    ledger = account(records)
    assert [(r.kind, r.start, r.end) for r in ledger.recoveries] == [("failure", 103.0, 107.0)]
    assert ledger.seconds["recovery"] == pytest.approx(4.0) and ledger.seconds["overhead"] == 0.0
    assert sum(ledger.seconds.values()) == pytest.approx(8.1)


def test_steps_in_flight_put_the_snapshot_event_before_the_step_it_came_with() -> None:
    # With a window of steps in flight, step k's results carry the acknowledgements of step k-1's
    # snapshot, so the driver writes that ``snapshot`` event just before step k's record: the marker,
    # not step k-1's record, starts the interval in which step k trained. Each step is still useful
    # in full; the stall goes to snapshot (as the run's chaos campaign found: 9% before, all steps).
    records = [{"event": "launch", "time": 100.0}, {"event": "start", "generation": 1, "time": 100.5},
               _step(1, 102.0, 1.0, 1)]
    t = 102.0
    for step in range(2, 12):
        records.append({"event": "snapshot", "step": step - 1, "stall_s": 0.05, "time": t + 0.9})
        t += 1.0
        records.append(_step(step, t, 0.9, 1))
    records.append({"event": "done", "step": 11, "time": t + 0.1})
    ledger = account(records)
    assert ledger.seconds["useful"] == pytest.approx(1.0 + 10 * 0.9)
    assert ledger.seconds["snapshot"] == pytest.approx(10 * 0.05)
    assert ledger.seconds["overhead"] == pytest.approx(10 * 0.05)
    assert sum(ledger.seconds.values()) == pytest.approx(t + 0.1 - 100.0)


def _recorded() -> list[dict]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines()]


# Records that are progress, not markers written on the way (acks, spares found or lost): a failure's
# recovery starts at the last of these before it (README, Metrics: "from the last progress before the fault").
PROGRESS_EVENTS = ("eval", "done", "stopped", "bad_step", "rollback", "failure", "evict")


def last_progress(records: list[dict], k: int) -> int:
    """Index of the last record before ``k`` that is a step or a progress event."""
    j = k - 1
    while j > 0 and "event" in records[j] and records[j]["event"] not in PROGRESS_EVENTS:
        j -= 1
    return j


def stalls_by_window(records: list[dict]) -> tuple[float, float]:
    """The checkpoint and snapshot seconds, computed per step record: the window after it (to the
    next step's start; to the fault's start when one opens before that — a failure's at the last
    progress before it —; empty before a grow, whose recovery starts at that step; to ``done`` after
    the last step) holds its checkpoint stall, then its snapshot stall (the first events naming its
    step after it), as far as the window reaches; after the last step the whole window is the final
    saves' wait."""
    times = [r["time"] for r in records]
    index = [i for i, r in enumerate(records) if "event" not in r]

    def stall_after(i: int, kind: str) -> float:
        for r in records[i + 1:]:
            if "event" not in r and r["step"] == records[i]["step"]:
                return 0.0  # re-run before its event came
            if r.get("event") == kind and r["step"] == records[i]["step"]:
                return r["stall_s"]
        return 0.0

    checkpoint = snapshot = 0.0
    for n, i in enumerate(index):
        j = index[n + 1] if n + 1 < len(index) else len(records)
        end = None
        for k in range(i + 1, j):
            kind = records[k].get("event")
            if kind == "failure":
                end = times[last_progress(records, k)]  # the failed step's time is the recovery's
            elif kind == "preemption" and records[k].get("action") == "evacuate":
                end = times[k]
            elif kind == "evict":
                b = k - 1  # its save is part of it
                while records[b].get("event") == "checkpoint" and records[b]["step"] == records[k]["step"]:
                    b -= 1
                end = times[b]
            if end is not None:
                break
        if end is None:
            if j == len(records):
                end = times[-1]
            elif records[j]["generation"] != records[i]["generation"]:
                end = times[i]
            else:
                end = times[j] - records[j]["step_time_s"]
        window = max(0.0, end - times[i])
        ckpt = min(window, stall_after(i, "checkpoint"))
        snap = min(window - ckpt, stall_after(i, "snapshot"))
        checkpoint += ckpt + (window - ckpt - snap if j == len(records) else 0.0)
        snapshot += snap
    return checkpoint, snapshot


def recoveries_by_kind(records: list[dict]) -> dict[str, float]:
    """Recovery seconds by kind, recomputed from the records: each recovery ends where the first step
    of a new generation began; it began at the last progress before the first fault record since the
    previous step (an eviction: before its save; a preemption: at the notice), or, with no fault
    record, after the last step or eval record (a grow)."""
    expected: dict[str, float] = {}
    prev = None
    for i, r in enumerate(records):
        if "event" in r:
            continue
        if prev is not None and r["generation"] != records[prev]["generation"]:
            between = records[prev + 1:i]
            opening = [j for j in range(prev + 1, i) if records[j].get("event") in ("failure", "evict")
                       or (records[j].get("event") == "preemption" and records[j].get("action") == "evacuate")]
            if opening:
                j = opening[0]
                fault = records[j]
                before = j - 1  # an eviction's save (checkpoint records of its step) is part of it
                while fault["event"] == "evict" and records[before].get("event") == "checkpoint" \
                        and records[before]["step"] == fault["step"]:
                    before -= 1
                if fault["event"] == "failure":
                    before = last_progress(records, j)
                start = fault["time"] if fault["event"] == "preemption" else records[before]["time"]
                kind = {"evict": "eviction", "preemption": "preemption"}.get(fault["event"]) or failure_kind(fault, set())
            else:
                begin = max([prev] + [j for j in range(prev + 1, i) if records[j].get("event") == "eval"])
                start, kind = records[begin]["time"], "grow"
                assert any(e.get("event") == "grow" for e in records[i:i + 3]), between
            expected[kind] = expected.get(kind, 0.0) + (r["time"] - r["step_time_s"]) - start
        prev = i
    return expected


def test_recorded_chaos_run_against_independent_figures() -> None:
    records = _recorded()
    ledger = account(records)
    times = [r["time"] for r in records]
    launch = records[0]
    assert launch["event"] == "launch"
    wall = max(times) - launch["time"]
    # Every second is somewhere, and only once: the buckets add up to the wall time (the issue: 1%).
    assert sum(ledger.seconds.values()) == pytest.approx(wall, rel=0.01)
    assert ledger.wall_s == pytest.approx(wall, rel=1e-9)

    steps = [r for r in records if "event" not in r]
    last = {}
    for r in steps:
        last[r["step"]] = r
    assert ledger.seconds["useful"] == pytest.approx(sum(r["step_time_s"] for r in last.values()), rel=1e-9)
    assert ledger.steps_rerun == len(steps) - len(last) > 0
    lost = sum(r["step_time_s"] for r in steps if last[r["step"]] is not r)
    assert ledger.seconds["rerun"] == pytest.approx(lost, rel=1e-9)
    assert ledger.restarts == sum(r.get("event") == "failure" for r in records)
    assert ledger.generations == max(r["generation"] for r in steps)
    first = steps[0]
    assert ledger.seconds["startup"] == pytest.approx(first["time"] - first["step_time_s"] - launch["time"])
    checkpoint, snapshot = stalls_by_window(records)
    # abs: an event written while the next step ran (the gap before it belongs to that step: the
    # ``carry`` in goodput.py) moves the few microseconds after the step began to overhead
    assert ledger.seconds["checkpoint"] == pytest.approx(checkpoint, abs=5e-4)
    assert ledger.seconds["snapshot"] == pytest.approx(snapshot, abs=5e-4)
    assert checkpoint > 1.0 and snapshot > 1.0  # this run has both, the final save's wait among them
    assert ledger.seconds["evaluation"] == ledger.seconds["down"] == 0.0  # no eval, one process

    expected = recoveries_by_kind(records)
    kinds = {k: v for k, v in ledger.recovery_by_kind.items() if v}
    assert kinds.keys() == expected.keys() and {"failure", "hang", "preemption", "eviction", "grow"} <= set(kinds)
    for kind, seconds in expected.items():
        assert kinds[kind] == pytest.approx(seconds, abs=1e-3), kind  # summed in another order
    # The driver's own recovery_s (from the recovery's start to its first step done) is inside ours
    # plus that first step: ours starts earlier, at the last progress before the fault was found.
    for episode in ledger.recoveries:
        event = next((e for e in records if e.get("event") in ("rebuild", "grow")
                      and e["generation"] == episode.generation), None)
        if event is not None and "recovery_s" in event:
            first_step = next(r for r in steps if r["generation"] == episode.generation)
            assert event["recovery_s"] <= episode.seconds + first_step["step_time_s"] + 0.05


def test_a_failure_found_by_the_timeout_is_a_hang_and_a_drained_rank_a_preemption() -> None:
    assert failure_kind({"reason": "no progress within elastic.step_timeout_s", "ranks": [0]}, set()) == "hang"
    assert failure_kind({"reason": "ActorDiedError", "ranks": [3]}, set()) == "failure"
    assert failure_kind({"reason": "ActorDiedError", "ranks": [3]}, {3, 4}) == "preemption"
