"""A restore's metadata reads are asked for as the rank joins (``GenerationOrders.restore``): the old
ranks this actor neither holds nor provides are asked once, at the join, and the load reads those
answers instead of asking again (workers/snapshot_push.py ``ask_metadata``, ``fetch_metadata``).
The whole path with real ranks: tests/ray/test_snapshots.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers import snapshot_push

KEY = (1, 0, 4)


class _Ref:
    def __init__(self, value) -> None:
        self.value = value


class _Provider:
    """An actor handle: ``snapshot_meta.remote(key, owner)`` answers with a reference, counted."""

    def __init__(self, asked: list) -> None:
        self.snapshot_meta = SimpleNamespace(remote=lambda key, owner: asked.append(owner) or _Ref(f"meta-{owner}"))


class _Store:
    def __init__(self, held: set[int]) -> None:
        self.held = held

    def holds(self, key, owner) -> bool:
        return tuple(key) == KEY and owner in self.held

    def find(self, key, owner):
        assert self.holds(key, owner)
        return SimpleNamespace(metadata=f"own-{owner}")


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(snapshot_push, "ray", SimpleNamespace(get=lambda ref, timeout: ref.value))


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
