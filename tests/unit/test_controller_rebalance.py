"""``elastic.rebalance`` in the controller, on a fake worker group (no process): each step trains the
split the driver decided and each rank its replica's schedule for its own count (sent as
``SplitOrders`` with the first step of a new split only, kept by the rank until its next one or the
end of its generation); a replica
measured 2x slower gets about half the microbatches after ``min_samples`` measured steps (a
generation's first step is not measured), with one
``rebalance`` event; a resize starts the new generation even and rebalances it from the history of
the actors still there; without the key the calls are what they were.

The fake rank (``testbed/fake_group.py``) reports ``forward_s`` scaled by its replica's share, as a
rank of fixed speed would; what the ranks do with a split is tests/distributed/test_rebalance.py's.
"""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from meshspeak.rebalance import MIN_SAMPLES, split_by_speed
from meshspeak.schedule import make_schedule
from orchestrator.control.controller import State
from testbed.controller_run import make  # noqa: F401  (the fixture)

BATCH = ("train.global_batch_size=24", "train.micro_batch_size=1", "checkpoint.every=100")


def _trained(r) -> dict[int, dict[int, tuple]]:
    """Step -> actor -> (split or None for the even one, action list) that the rank trained, replaying
    the calls as a rank keeps them: ``GenerationOrders`` at a join, ``SplitOrders`` until replaced."""
    held: dict[int, tuple] = {}
    out: dict[int, dict[int, tuple]] = {}
    for method, actor, args in r.group.log:
        if method is RankCalls.join_generation:
            held[actor] = (None, tuple(args[2].actions))
        elif method is RankCalls.train_step:
            if len(args) > 3 and args[3] is not None:
                held[actor] = (args[3].split, args[3].actions)
            out.setdefault(args[0], {})[actor] = held[actor]
    return out


def _sent_splits(r) -> list:
    return [args[3] for _, args in r.group.calls(RankCalls.train_step) if len(args) > 3]


def test_a_slow_replica_gets_fewer_microbatches_and_each_rank_its_replicas_schedule(make):
    r = make("train.steps=10", "elastic.rebalance=true", "mesh.pp=2", "mesh.dp=2", *BATCH)
    r.steps(1)
    members = r.c.generation.members
    shape = r.c.generation.shape
    slow_replica = 1
    for rank, actor in members.items():
        if shape.coords(rank).dp == slow_replica:
            r.group.ranks[actor].forward_s = 0.8  # 2x the others' 0.4 at the even share
    r.steps(10)
    assert r.c.advance() == State.FINISHED and sorted(r.c.losses) == list(range(1, 11))
    event, = r.events("rebalance")
    # Step 1 (the generation's first, paying its set-ups) is not measured; steps 2..5 are.
    first = MIN_SAMPLES + 2
    expected = split_by_speed(24, [0.4 / 12, 0.8 / 12], r.c.context.rebalance.policy.rules)
    # (count + 1 microbatch of pipeline fill) x seconds: 18 x 1 vs 8 x 2 beats the proportional (16, 8).
    assert event["step"] == first and tuple(event["microbatches"]) == expected == (17, 7)
    assert event["speeds"] == [30.0, 15.0]  # microbatches per second: 12 / 0.4 and 12 / 0.8
    trained = _trained(r)
    for step in range(1, 11):
        split = None if step < first else expected
        for rank, actor in members.items():
            coords = shape.coords(rank)
            got_split, actions = trained[step][actor]
            assert got_split == split
            count = 12 if split is None else split[coords.dp]
            assert list(actions) == make_schedule("1f1b", 2, count)[coords.pp]
    # The split travels once, with its first step, to every member.
    assert len(_sent_splits(r)) == len(members)


def test_a_resize_starts_even_and_rebalances_from_the_actors_history(make):
    r = make("train.steps=12", "elastic.rebalance=true", "mesh.dp=4", *BATCH)
    r.steps(1)
    slow, healthy = r.c.generation.members[0], r.c.generation.members[3]
    r.group.ranks[slow].forward_s = 0.8
    r.c.resize_requests[8] = 2
    r.steps(7)  # steps 1..7 at dp=4, rebalanced once
    event, = r.events("rebalance")
    assert tuple(event["microbatches"]) == (3, 7, 7, 7) and _trained(r)[7][slow][0] == (3, 7, 7, 7)
    assert r.c.advance() == State.FORMING  # the step-8 boundary decides the resize
    r.steps(1)  # generation 2 forms at dp=2, keeping world ranks 0 and 1 (the slow actor among them)
    gen = r.c.generation
    assert gen.number == 2 and gen.shape.dp == 2 and gen.members[0] == slow and healthy not in gen.members.values()
    r.steps(5)
    assert r.c.advance() == State.FINISHED and sorted(r.c.losses) == list(range(1, 13))
    # Even at the formation; the slow actor's history came along, so step 8 is already rebalanced.
    second, = r.events("rebalance")[1:]
    assert second["step"] == 8 and tuple(second["microbatches"]) == (8, 16)
    trained = _trained(r)
    assert all(split == (8, 16) for step in range(8, 13) for split, _ in trained[step].values())


def test_off_sends_the_plans_lists_without_a_split(make):
    r = make("train.steps=5", "mesh.dp=2", *BATCH)
    r.steps(1)
    r.group.ranks[r.c.generation.members[1]].forward_s = 4.0
    r.steps(5)
    assert not r.events("rebalance")
    assert not _sent_splits(r)
    assert all(split is None and list(actions) == make_schedule("1f1b", 1, 12)[0]
               for at_step in _trained(r).values() for split, actions in at_step.values())


def test_with_steps_in_flight_every_member_trains_each_step_with_the_same_split(make):
    # Window 2 (the default): a step goes out before the one ahead of it is read, so the decision at
    # its boundary uses one measurement less; whatever was decided, all members train the same split.
    r = make("train.steps=12", "elastic.rebalance=true", "mesh.dp=2", *BATCH, window=2)
    r.steps(1)
    members = r.c.generation.members
    r.group.ranks[members[1]].forward_s = 0.8
    while r.c.advance() != State.FINISHED:
        pass
    assert sorted(r.c.losses) == list(range(1, 13))
    event, = r.events("rebalance")
    assert tuple(event["microbatches"]) == (16, 8) and MIN_SAMPLES + 2 <= event["step"] <= MIN_SAMPLES + 3
    trained = _trained(r)
    for step in range(1, 13):
        assert len({split for split, _ in trained[step].values()}) == 1
        assert trained[step][members[0]][0] == (None if step < event["step"] else (16, 8))
