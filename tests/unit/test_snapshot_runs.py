"""An actor asked for its snapshots by another run's restore forgets the last run's
(``RankActor._enter_run``, ``SnapshotStore.forget_all``): their keys (generation, life, step) restart
with every run, so a new run's restore could take one for a copy of its own. The end-to-end check is
tests/ray/test_train_equivalence.py (a second run on the same four actors finds none)."""

from __future__ import annotations

from types import SimpleNamespace

from workers.actor import RankActor
from workers.snapshots import SnapshotStore


class FakeSnapshot:
    nbytes = 8
    rank = 0  # the owner's world rank (an own snapshot's)

    def copy(self, reuse=None):
        return self


def _store_with_snapshots() -> SnapshotStore:
    store = SnapshotStore()
    store.put_own((1, 0, 2), FakeSnapshot(), 0)
    store.keep((1, 0, 2), 1, FakeSnapshot())
    store.retain((1, 0, 2))
    return store


def test_forget_all_drops_own_and_held_copies_and_the_kept_key():
    store = _store_with_snapshots()
    assert store.holds((1, 0, 2), 1) and store.own
    assert store.forget_all() == 2
    assert not store.own and not store.held and store.keep_key is None
    assert not store.holds((1, 0, 2), 1) and store.nbytes() == 0


def test_another_run_forgets_the_last_runs_snapshots_and_the_same_run_keeps_them():
    actor = SimpleNamespace(run_id=None, snapshots=_store_with_snapshots())
    RankActor._enter_run(actor, "run-a")  # the first run that asks: nothing of an earlier one to drop
    assert actor.run_id == "run-a" and actor.snapshots.own
    RankActor._enter_run(actor, "run-a")  # a rebuild of the same run: its snapshots are what it restores
    assert actor.snapshots.own and actor.snapshots.held
    RankActor._enter_run(actor, "run-b")
    assert actor.run_id == "run-b" and not actor.snapshots.own and not actor.snapshots.held


def test_an_inventory_asked_for_another_run_answers_none_and_drops_the_last_runs():
    # An actor reused by a new controller, asked by that run's restore (the run id in the poll): none of
    # the last run's snapshots may count as a copy of the new run's.
    actor = SimpleNamespace(run_id="run-a", snapshots=_store_with_snapshots())
    actor._enter_run = lambda run_id: RankActor._enter_run(actor, run_id)
    assert RankActor.snapshot_inventory(actor, "run-a").own  # its own run's: answered
    assert RankActor.snapshot_inventory(actor).held  # no run named: everything it holds
    inventory = RankActor.snapshot_inventory(actor, "run-b")
    assert not inventory.own and not inventory.held and actor.run_id == "run-b"
    assert not actor.snapshots.own and not actor.snapshots.held
