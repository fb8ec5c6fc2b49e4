"""``elastic.rebalance`` in the controller, on a fake worker group (no process): each step is sent with
the split the driver decided and each rank with its replica's schedule for its own count; a replica
measured 2x slower gets about half the microbatches after ``min_samples`` measured steps (a
generation's first step is not measured), with one
``rebalance`` event; a resize starts the new generation even and rebalances it from the history of
the actors still there; without the key the calls are what they were.

The fake rank (``testbed/fake_group.py``) reports ``forward_s`` scaled by its replica's share, as a
rank of fixed speed would; what the ranks do with a split is tests/distributed/test_rebalance.py's.
"""

from __future__ import annotations

from meshspeak.rebalance import MIN_SAMPLES, split_by_speed
from meshspeak.schedule import make_schedule
from orchestrator.control.controller import State
from testbed.controller_run import make  # noqa: F401  (the fixture)

BATCH = ("train.global_batch_size=24", "train.micro_batch_size=1", "checkpoint.every=100")


def _sent(r, step: int) -> dict[int, tuple]:
    """Actor -> the train_step arguments of ``step``."""
    return {actor: args for actor, args in r.group.calls("train_step") if args[0] == step}


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
    assert r.c.step() == State.FINISHED and sorted(r.c.losses) == list(range(1, 11))
    event, = r.events("rebalance")
    # Step 1 (the generation's first, paying its set-ups) is not measured; steps 2..5 are.
    first = MIN_SAMPLES + 2
    expected = split_by_speed(24, [0.4 / 12, 0.8 / 12], r.c.rebalance.policy.rules)
    # (count + 1 microbatch of pipeline fill) x seconds: 18 x 1 vs 8 x 2 beats the proportional (16, 8).
    assert event["step"] == first and tuple(event["microbatches"]) == expected == (17, 7)
    assert event["speeds"] == [30.0, 15.0]  # microbatches per second: 12 / 0.4 and 12 / 0.8
    for step in range(1, 11):
        split = (12, 12) if step < first else expected
        for rank, actor in members.items():
            coords = shape.coords(rank)
            args = _sent(r, step)[actor]
            assert args[2] == split
            assert args[1] == make_schedule("1f1b", 2, split[coords.dp])[coords.pp]


def test_a_resize_starts_even_and_rebalances_from_the_actors_history(make):
    r = make("train.steps=12", "elastic.rebalance=true", "mesh.dp=4", *BATCH)
    r.steps(1)
    slow, healthy = r.c.generation.members[0], r.c.generation.members[3]
    r.group.ranks[slow].forward_s = 0.8
    r.c.resize_requests[8] = 2
    r.steps(7)  # steps 1..7 at dp=4, rebalanced once
    event, = r.events("rebalance")
    assert tuple(event["microbatches"]) == (3, 7, 7, 7) and _sent(r, 7)[slow][2] == (3, 7, 7, 7)
    r.steps(1)  # the resize: generation 2 at dp=2 keeps world ranks 0 and 1 (the slow actor among them)
    gen = r.c.generation
    assert gen.number == 2 and gen.shape.dp == 2 and gen.members[0] == slow and healthy not in gen.members.values()
    r.steps(5)
    assert r.c.step() == State.FINISHED and sorted(r.c.losses) == list(range(1, 13))
    # Even at the formation; the slow actor's history came along, so step 8 is already rebalanced.
    second, = r.events("rebalance")[1:]
    assert second["step"] == 8 and tuple(second["microbatches"]) == (8, 16)
    assert all(args[2] == (8, 16) for step in range(8, 13) for args in _sent(r, step).values())


def test_off_sends_the_plans_lists_without_a_split(make):
    r = make("train.steps=5", "mesh.dp=2", *BATCH)
    r.steps(1)
    r.group.ranks[r.c.generation.members[1]].forward_s = 4.0
    r.steps(5)
    assert not r.events("rebalance")
    assert all(len(args) == 2 and args[1] == make_schedule("1f1b", 1, 12)[0]
               for _, args in r.group.calls("train_step"))
