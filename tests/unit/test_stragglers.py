"""StragglerWatch: a rank slower than straggler_factor x its peers' median for straggler_steps steps."""

from orchestrator.recovery.stragglers import Straggler, StragglerWatch


def step(watch, times, groups=None):
    return watch.observe({a: ((groups or {}).get(a, 0), t) for a, t in times.items()})


def test_reported_after_the_streak_and_once():
    w = StragglerWatch(factor=2.0, steps=3)
    slow = {0: 1.0, 1: 1.1, 2: 0.9, 3: 3.0}
    assert step(w, slow) == [] and step(w, slow) == []
    assert step(w, slow) == [Straggler(3, 3.0 / 1.0)]
    assert step(w, slow) == []  # reported once per streak


def test_a_normal_step_resets_the_streak():
    w = StragglerWatch(factor=2.0, steps=2)
    assert step(w, {0: 1.0, 1: 2.5}) == []
    assert step(w, {0: 1.0, 1: 1.5}) == []  # back to normal
    assert step(w, {0: 1.0, 1: 2.5}) == []
    assert [s.actor for s in step(w, {0: 1.0, 1: 2.5})] == [1]


def test_exactly_the_factor_is_not_slow_and_fast_ranks_are_never_reported():
    w = StragglerWatch(factor=2.0, steps=1)
    assert step(w, {0: 1.0, 1: 2.0}) == []
    assert step(w, {0: 0.1, 1: 1.0, 2: 1.0}) == []


def test_peers_are_ranks_at_the_same_pipeline_position():
    # The last stage (pp 1) does 3x the work of pp 0 by design: not a straggler against its own peers.
    w = StragglerWatch(factor=2.0, steps=1)
    groups = {0: 0, 1: 0, 2: 1, 3: 1}
    assert step(w, {0: 1.0, 1: 1.0, 2: 3.0, 3: 3.1}, groups) == []
    assert [s.actor for s in step(w, {0: 1.0, 1: 1.0, 2: 3.0, 3: 9.0}, groups)] == [3]


def test_a_lone_rank_is_scored_against_everybody_and_forget_drops_streaks():
    w = StragglerWatch(factor=2.0, steps=2)
    assert step(w, {0: 1.0, 1: 5.0}, {0: 0, 1: 1}) == []
    w.forget({0})
    assert w.streak == {0: 0}
    assert step(w, {0: 1.0}) == []  # no peers: no score


def test_a_few_milliseconds_slower_is_not_a_straggler_however_large_the_factor():
    from orchestrator.recovery.stragglers import MIN_EXCESS_S, StragglerWatch

    watch = StragglerWatch(factor=2.0, steps=1)
    assert watch.observe({0: (0, 0.010), 1: (0, 0.012), 2: (0, 0.045)}) == []  # 4.5x, 35 ms more
    found, = watch.observe({0: (0, 0.010), 1: (0, 0.012), 2: (0, 0.012 + MIN_EXCESS_S + 0.01)})
    assert found.actor == 2
