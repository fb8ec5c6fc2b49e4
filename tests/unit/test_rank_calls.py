"""The typed table of rank calls (meshspeak/rank_calls.py) is what the actors implement: the real
``RankActor`` and the fake rank answer every entry with the same parameters, and the worker groups
refuse a call named any other way (a bare method-name string included)."""

from __future__ import annotations

import inspect

import pytest

from meshspeak.rank_calls import CALLS, RankCalls, call_name
from testbed.fake_group import FakeRank, FakeWorkerGroup

# ray.remote(cls) adds this keyword-only parameter to the class's methods in place (ray/util/tracing/
# tracing_helper.py), so once any test in this process has made the actor class remote it is there.
RAY_TRACE = "_ray_trace_ctx"


def parameters(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """Names, kinds and defaults (annotations differ in spelling between the sides)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != RAY_TRACE]


def mismatches(cls) -> list[str]:
    out = []
    for name in sorted(CALLS):
        impl = getattr(cls, name, None)
        if impl is None:
            out.append(f"{cls.__name__} lacks {name}")
        elif parameters(impl) != parameters(getattr(RankCalls, name)):
            out.append(f"{cls.__name__}.{name}{inspect.signature(impl)} != RankCalls.{name}"
                       f"{inspect.signature(getattr(RankCalls, name))}")
    return out


def test_the_table_lists_the_calls_the_driver_makes():
    assert {"train_step", "join_generation", "kick", "status", "save_checkpoint", "load_snapshot"} <= CALLS


def test_the_rank_actor_implements_every_call_with_the_same_parameters():
    from workers.actor import RankActor

    assert mismatches(RankActor) == []


def test_training_thread_methods_keep_their_signature():
    """``training`` (workers/rank_methods.py) sets ``__signature__`` (never ``__wrapped__``: Ray would then ignore the concurrency
    group), so the wrapped method shows its own parameters."""
    from workers.actor import RankActor

    assert not hasattr(RankActor.train_step, "__wrapped__")
    names = [p for p in inspect.signature(RankActor.train_step).parameters if p != RAY_TRACE]
    assert names[1:] == ["step", "keep", "after", "split"]


def test_the_fake_rank_implements_every_call_with_the_same_parameters():
    assert mismatches(FakeRank) == []


def test_a_call_not_named_through_the_table_is_refused():
    group = FakeWorkerGroup(2)
    with pytest.raises(TypeError, match="RankCalls"):
        group.submit([0, 1], "train_step", (1,))
    with pytest.raises(TypeError, match="RankCalls"):
        group.submit([0, 1], FakeRank.train_step, (1,))
    assert call_name(RankCalls.status) == "status"
    assert group.call([0, 1], RankCalls.status, timeout_s=1).ok


def test_the_check_fires_on_a_drifted_signature():
    class Drifted(FakeRank):
        def train_step(self, step: int) -> None:  # lost its actions
            pass

    assert mismatches(Drifted) == ["Drifted.train_step(self, step: 'int') -> 'None' != RankCalls.train_step"
                                   "(self, step: 'int', keep: 'tuple' = (), after: 'int | None' = None, "
                                   "split: 'SplitOrders | None' = None) -> 'StepResult'"]
