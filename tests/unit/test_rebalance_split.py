"""meshspeak/rebalance.py: the split by measured speed and its hysteresis (pure; no process).

* ``split_by_speed`` reaches the smallest predicted step time (checked against every split by brute
  force), keeps the even split for equal speeds, respects the quanta and minimum, and counts a
  pipeline's fill;
* ``replica_span`` cuts the step's microbatches contiguously in dp order;
* ``SplitPolicy``: no decision before ``min_samples`` measurements; measurements wobbling around
  equal speeds never move a microbatch; a real 2x slowdown moves them once and the split then stays
  (also under +-15% jitter); a recovery moves them back; a one-step spike does nothing; a gain below
  the noise-aware threshold moves nothing; after a change it waits ``settle`` steps; a new
  generation restarts even and keeps the history of actors still present.
"""

from __future__ import annotations

import itertools
import random

import pytest

from meshspeak.rebalance import (
    SplitPolicy,
    SplitRules,
    even_split,
    predicted_step_s,
    replica_span,
    split_by_speed,
    split_rules,
)


def _all_splits(total: int, dp: int, q: int):
    for counts in itertools.product(range(q, total + 1, q), repeat=dp):
        if sum(counts) == total:
            yield counts


@pytest.mark.parametrize("fill", [0.0, 1.0, 3.0])
def test_greedy_split_is_optimal_against_brute_force(fill):
    rng = random.Random(7)
    for _ in range(60):
        dp = rng.randint(2, 4)
        q = rng.choice([1, 1, 2])
        total = q * rng.randint(dp, 12 // q + dp)
        seconds = [rng.uniform(0.1, 1.0) for _ in range(dp)]
        rules = SplitRules(quantum=q, fill=fill)
        got = split_by_speed(total, seconds, rules)
        assert sum(got) == total and all(c >= q and c % q == 0 for c in got)
        best = min(predicted_step_s(s, seconds, rules) for s in _all_splits(total, dp, q))
        assert predicted_step_s(got, seconds, rules) == pytest.approx(best)


def test_equal_speeds_give_the_even_split_and_a_2x_slow_replica_half_the_work():
    assert split_by_speed(24, [0.1] * 4) == even_split(24, 4) == (6, 6, 6, 6)
    # Capacity 3.5 replicas' worth: 24 / 3.5 = 6.86 per healthy replica; the slow one gets about half.
    split = split_by_speed(24, [0.1, 0.1, 0.1, 0.2])
    assert sum(split) == 24 and split[3] == 3 and sorted(split[:3]) == [7, 7, 7]
    assert predicted_step_s(split, [0.1, 0.1, 0.1, 0.2]) == pytest.approx(0.7)


def test_quanta_minimum_and_unmeasured_replicas():
    # interleaved 1F1B at pp=2: counts in pairs, at least one pair, even however slow a replica is.
    rules = split_rules(pp=2, virtual_stages=2, schedule="interleaved_1f1b")
    assert rules == SplitRules(quantum=2, fill=0.5)
    assert split_by_speed(8, [0.1, 100.0], rules) == (6, 2)
    assert split_by_speed(8, [0.1, 100.0]) == (7, 1)  # plain: one microbatch at least
    assert split_rules(pp=4, virtual_stages=1, schedule="1f1b") == SplitRules(quantum=1, fill=3.0)
    assert split_rules(pp=4, virtual_stages=1, schedule="zb-h1") == SplitRules(quantum=1, fill=1.0)
    assert split_rules(pp=4, virtual_stages=2, schedule="zbv") == SplitRules(quantum=1, fill=0.5)
    assert split_by_speed(6, [0.0, 0.0, 0.0]) == (2, 2, 2)  # nothing measured: even
    # A 0 counts as the fastest measured one.
    assert split_by_speed(6, [0.0, 0.1, 0.2]) == split_by_speed(6, [0.1, 0.1, 0.2]) == (3, 2, 1)
    with pytest.raises(ValueError):
        split_by_speed(7, [0.1, 0.1], SplitRules(quantum=2))
    with pytest.raises(ValueError):
        split_by_speed(3, [0.1] * 4)


def test_pipeline_fill_shifts_work_to_the_fast_replica_less():
    # A replica's step is (count + fill) microbatch times: with fill the slow replica's fixed cost
    # counts too, so it gets fewer microbatches than the plain proportional share.
    seconds = [0.1, 0.2]
    assert split_by_speed(12, seconds) == (8, 4)
    assert split_by_speed(12, seconds, SplitRules(fill=3.0)) == (9, 3)


def test_replica_span_cuts_contiguously():
    split = (3, 1, 2)
    assert [replica_span(split, r) for r in range(3)] == [(0, 3), (3, 1), (4, 2)]
    with pytest.raises(ValueError):
        replica_span(split, 3)
    with pytest.raises(ValueError):
        replica_span((4, 0), 0)


def _policy(dp: int = 4, total: int = 24, **kwargs) -> SplitPolicy:
    policy = SplitPolicy(**kwargs)
    policy.begin([[("a", r)] for r in range(dp)], total, SplitRules())
    return policy


def _observe(policy: SplitPolicy, seconds: list[float]) -> None:
    policy.observe({("a", r): s for r, s in enumerate(seconds)})


def test_no_decision_before_min_samples_then_one_change_that_stays():
    policy = _policy()
    slow = [0.1, 0.1, 0.1, 0.2]
    decisions = []
    for _ in range(12):
        decisions.append(policy.decide())
        _observe(policy, slow)
    changed = [(i, d) for i, d in enumerate(decisions) if d is not None]
    assert changed == [(4, (7, 7, 7, 3))]  # after min_samples = 4 measured steps, once
    assert policy.split == (7, 7, 7, 3)


def test_wobble_around_equal_speeds_never_moves_a_microbatch():
    rng = random.Random(1)
    policy = _policy()
    for _ in range(200):
        _observe(policy, [0.1 * rng.uniform(0.9, 1.1) for _ in range(4)])
        assert policy.decide() is None
    assert policy.split == (6, 6, 6, 6)


def test_noisy_slow_replica_does_not_oscillate():
    rng = random.Random(2)
    policy = _policy()
    changes = []
    for step in range(200):
        _observe(policy, [0.1 * rng.uniform(0.85, 1.15) for _ in range(3)] + [0.2 * rng.uniform(0.85, 1.15)])
        if policy.decide() is not None:
            changes.append(step)
    # A first move on 4 noisy samples, at most one correction, then nothing for good.
    assert 1 <= len(changes) <= 2 and changes[-1] < 20 and policy.split[3] in (3, 4), changes


def test_recovery_moves_the_microbatches_back_and_a_spike_does_nothing():
    policy = _policy()
    for _ in range(4):
        _observe(policy, [0.1, 0.1, 0.1, 0.2])
    assert policy.decide() == (7, 7, 7, 3)
    back = []
    for i in range(12):
        _observe(policy, [0.1, 0.1, 0.1, 0.1])
        if policy.decide() is not None:
            back.append(i)
    # Back once the median of the last 8 turned: 5 fast steps after the 4 slow ones.
    assert policy.split == (6, 6, 6, 6) and back == [4]
    for spike in ([0.1, 0.1, 0.1, 0.5], [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]):
        _observe(policy, spike)
        assert policy.decide() is None


def test_small_gains_are_not_worth_a_change_and_settle_holds_the_next_one():
    policy = _policy(total=8, dp=2)
    for _ in range(4):
        _observe(policy, [0.1, 0.11])  # 10% slower: the best split (4, 4) anyway
    assert policy.decide() is None
    policy = _policy(total=8, dp=2, settle=3, window=4, noise_z=0)
    for _ in range(4):
        _observe(policy, [0.1, 0.3])
    assert policy.decide() == (6, 2)
    eager = _policy(total=8, dp=2, settle=0, window=4, noise_z=0)
    for _ in range(4):
        _observe(eager, [0.1, 0.3])
    assert eager.decide() == (6, 2)
    for both in (policy, eager):  # the other way round now
        for _ in range(2):
            _observe(both, [0.3, 0.1])
    # Medians now equal: without settling it goes back to (4, 4) at once; settling holds 3 steps.
    assert eager.decide() == (4, 4) and policy.decide() is None
    _observe(policy, [0.3, 0.1])
    assert policy.decide() == (2, 6)


def test_a_new_generation_starts_even_and_keeps_the_history_of_actors_still_there():
    policy = SplitPolicy()
    policy.begin([[("a0", 0)], [("a1", 0)], [("a2", 0)], [("a3", 0)]], 24, SplitRules())
    for _ in range(4):
        policy.observe({("a0", 0): 0.1, ("a1", 0): 0.1, ("a2", 0): 0.1, ("a3", 0): 0.2})
    assert policy.decide() == (7, 7, 7, 3)
    # A shrink to dp=2 keeps a0 and the slow a3: even at first, rebalanced at the first decision.
    policy.begin([[("a0", 0)], [("a3", 0)]], 24, SplitRules())
    assert policy.split == (12, 12) and set(policy.history) == {("a0", 0), ("a3", 0)}
    assert policy.decide() == (16, 8)
    # A newcomer has no history: nothing is decided until it has min_samples measurements.
    policy.begin([[("a0", 0)], [("b", 0)]], 24, SplitRules())
    assert policy.decide() is None


def test_a_replica_is_as_slow_as_its_slowest_rank():
    policy = SplitPolicy()
    # Two replicas of two pipeline ranks each; replica 1's pp rank 1 is the slow one.
    policy.begin([[("a", 0), ("b", 1)], [("c", 0), ("d", 1)]], 12, split_rules(2, 1, "1f1b"))
    for _ in range(4):
        policy.observe({("a", 0): 0.1, ("b", 1): 0.1, ("c", 0): 0.1, ("d", 1): 0.2})
    assert policy.replica_seconds() == [0.1, 0.2]
    assert policy.decide() == split_by_speed(12, [0.1, 0.2], SplitRules(fill=1.0))
