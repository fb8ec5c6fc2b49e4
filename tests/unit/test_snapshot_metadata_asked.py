"""A restore's reads are asked for as the rank joins (``GenerationOrders.restore``): the old ranks'
metadata this actor neither holds nor provides is asked once, at the join, and the load reads those
answers instead of asking again (workers/snapshot_push.py ``ask_metadata``, ``fetch_metadata``); in a
mesh of the old size, the whole shard the rank loads in place is asked for too and kept before the
load (``ask_ahead``, ``keep_asked``). The whole path with real ranks: tests/ray/test_snapshots.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers import snapshot_push

KEY = (1, 0, 4)


class _Ref:
    def __init__(self, value) -> None:
        self.value = value


class _Provider:
    """An actor handle: ``snapshot_meta.remote(key, owner)`` answers with a reference, counted, and
    ``give_snapshot.remote(key, owner)`` with the whole snapshot (``None``: the call failed)."""

    def __init__(self, asked: list, given: list | None = None, fails: bool = False) -> None:
        self.snapshot_meta = SimpleNamespace(remote=lambda key, owner: asked.append(owner) or _Ref(f"meta-{owner}"))
        given = [] if given is None else given
        self.give_snapshot = SimpleNamespace(
            remote=lambda key, owner: given.append(owner) or _Ref(None if fails else f"snap-{owner}"))


class _Store:
    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.kept: dict[int, object] = {}

    def keep(self, key, owner, snap) -> int:
        assert tuple(key) == KEY
        self.kept[owner] = snap
        self.held.add(owner)
        return 100

    def holds(self, key, owner) -> bool:
        return tuple(key) == KEY and owner in self.held

    def find(self, key, owner):
        assert self.holds(key, owner)
        return SimpleNamespace(metadata=f"own-{owner}")


def _get(ref, timeout):
    if ref.value is None:
        raise RuntimeError("ActorDiedError: the provider died")
    return ref.value


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(snapshot_push, "ray", SimpleNamespace(get=_get))


def test_the_join_asks_for_what_is_not_here_and_the_load_asks_for_nothing_more(fake_ray):
    requests: list[int] = []
    me = 7
    # Old ranks 0 and 3 are in this actor's store (its own and the one it backed up); 1 and 2 are not.
    providers = {0: (me, None), 1: (8, _Provider(requests)), 2: (9, _Provider(requests)), 3: (8, _Provider(requests))}
    store = _Store(held={0, 3})
    asked = snapshot_push.ask_metadata(store, KEY, providers, me)
    assert sorted(asked) == [1, 2] and sorted(requests) == [1, 2]
    got = snapshot_push.fetch_metadata(store, KEY, providers, me, [1, 2], asked)
    assert got == ["meta-1", "meta-2"] and sorted(requests) == [1, 2]  # no second request
    # Without answers asked ahead, the load asks itself (the path of a load no join announced).
    assert snapshot_push.fetch_metadata(store, KEY, providers, me, [2, 1]) == ["meta-2", "meta-1"]
    assert sorted(requests) == [1, 1, 2, 2]
    assert snapshot_push.fetch_metadata(store, KEY, providers, me, [0]) == ["own-0"]


def _source(world: int, providers: dict):
    from meshspeak.messages import RestoreSource

    return RestoreSource(key=KEY, world=world, providers=tuple((r, a, h) for r, (a, h) in sorted(providers.items())))


def test_a_mesh_of_the_old_size_asks_for_the_shard_it_loads_in_place_and_keeps_it_before_the_load(fake_ray):
    """A promoted spare (new rank 1, old rank 1 died, its copy on actor 9): the whole of old rank 1's
    snapshot is asked for at the join, its metadata is not, and it is in this actor's store before the
    load, which then copies it in place without a fetch."""
    metas, given = [], []
    me = 7
    providers = {0: (8, _Provider(metas, given)), 1: (9, _Provider(metas, given)), 2: (10, _Provider(metas, given))}
    store = _Store(held=set())
    asked = snapshot_push.ask_ahead(store, _source(3, providers), new_rank=1, new_world=3, me=me)
    assert given == [1] and sorted(metas) == [0, 2] and asked.shard[0] == 1
    assert snapshot_push.keep_asked(store, asked) == 100 and store.kept == {1: "snap-1"} and store.holds(KEY, 1)


def test_no_shard_is_asked_for_when_the_size_changed_or_a_copy_is_here(fake_ray):
    metas, given = [], []
    providers = {0: (8, _Provider(metas, given)), 1: (9, _Provider(metas, given)), 2: (10, _Provider(metas, given))}
    resized = snapshot_push.ask_ahead(_Store(held=set()), _source(3, providers), new_rank=1, new_world=2, me=7)
    assert given == [] and resized.shard is None and sorted(resized.metadata) == [0, 1, 2]
    here = snapshot_push.ask_ahead(_Store(held={1}), _source(3, providers), new_rank=1, new_world=3, me=7)
    assert given == [] and here.shard is None and sorted(here.metadata) == [0, 2]
    mine = snapshot_push.ask_ahead(_Store(held=set()), _source(3, providers), new_rank=1, new_world=3, me=9)
    assert given == [] and mine.shard is None  # this actor provides it itself
    assert snapshot_push.keep_asked(_Store(held=set()), resized) == 0


def test_a_shard_that_did_not_come_leaves_the_load_to_read_it(fake_ray, caplog):
    """The provider died before it gave the shard: nothing is kept, one warning; the load's own reads
    then go to the providers (and its error names what is missing)."""
    providers = {0: (8, _Provider([])), 1: (9, _Provider([], fails=True))}
    store = _Store(held=set())
    asked = snapshot_push.ask_ahead(store, _source(2, providers), new_rank=1, new_world=2, me=7)
    assert snapshot_push.keep_asked(store, asked) == 0 and store.kept == {}
    assert "old rank 1 asked for ahead did not come" in caplog.text
