"""A new generation is told a load follows exactly when one comes (#37 item 4), on the fake group.

Seen in bench/torchft_compare.py at load ~45: a live but slow rank was declared hung by a liveness
probe and killed; the next generation's members were told a load follows (the driver's newest
complete snapshot set had a live copy of every shard), but the restore asked the live actors what
they held with a fixed 10 s wait, read the set as lost, fell back to storage with nothing committed
and loaded nothing: the generation's first step failed ('parameters were left uninitialised for a
checkpoint or snapshot load that never came'), and the generation after it started over from step
0 although every snapshot was still held. The fake ranks refuse a step until the load announced at
their join came, as RankRuntime does (testbed/fake_rank.py).
"""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from testbed.controller_run import make  # noqa: F401  (the fixture)
from testbed.fake_rank import UNINITIALISED

NO_CHECKPOINTS = ("train.steps=8", "checkpoint.every=0", "checkpoint.memory_every=1")


def run_to_end(r) -> None:
    for _ in range(60):
        if r.c.advance() in (State.FINISHED, State.ERRORED):
            return
    raise AssertionError("the run did not end")


def joins_and_loads(r) -> list[tuple[int, bool, bool]]:
    """Per generation: (number, told a load follows, a load came)."""
    told: dict[int, bool] = {}
    for _, (join, spec, _) in r.group.calls(RankCalls.join_generation):
        told.setdefault(join.generation, spec.load_follows)
    loaded = {rank.generation for rank in [*r.group.ranks.values(), *r.group.gone.values()]
              if rank.snapshots_loaded or rank.loaded}
    return [(g, told[g], g in loaded) for g in sorted(told)]


def test_slow_inventory_after_a_hang_kill_restores_the_snapshots(make):
    """A rank killed as hung (the probe's verdict), then every live actor slower to say what it holds
    than the driver's first wait: the actors, alive, are waited for and the snapshots restored."""
    r = make(*NO_CHECKPOINTS)
    r.group.fail(RankCalls.train_step, 1, "hang", at=4)
    r.steps(3)  # start, steps 1-2
    r.group.collects_pending[RankCalls.snapshot_inventory] = 1  # the next poll finds none answered yet
    run_to_end(r)
    assert r.c.state.kind == State.FINISHED, r.c.error
    failure, = r.events("failure")
    assert failure["ranks"] == [1]
    rebuild, = r.events("rebuild")
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("snapshot", 3)
    assert joins_and_loads(r) == [(1, False, False), (2, True, True)]
    assert not any(UNINITIALISED in (f.get("reason") or "") for f in r.events("failure"))


def test_a_set_lost_with_a_silent_holder_starts_over_without_a_load_announced(make):
    """Rank 1 dies and its holder (actor 2) stops answering while the actors are asked what they hold:
    rank 1's shard has no live copy, nothing was committed, so the generation starts from its random
    init, and its members are told no load follows (each later generation's members likewise)."""
    r = make(*NO_CHECKPOINTS)
    r.group.fail(RankCalls.train_step, 1, "die", at=4)
    r.steps(3)
    r.group.fail(RankCalls.snapshot_inventory, 2, "hang")
    run_to_end(r)
    assert r.c.state.kind == State.FINISHED, r.c.error
    assert 2 in r.group.killed
    rebuilds = r.events("rebuild")
    assert [(e["restored_from"], e["resumed_from_step"]) for e in rebuilds][-1] == ("storage", 0)
    assert all(told == loaded for _, told, loaded in joins_and_loads(r))
    assert not any(UNINITIALISED in (f.get("reason") or "") for f in r.events("failure"))
    assert sorted(r.c.losses) == list(range(1, 9))
