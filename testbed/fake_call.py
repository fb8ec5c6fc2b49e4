"""FakeCall: one scripted call on one fake actor, and its ref (``testbed/fake_group.py`` submits them,
``testbed/fake_rank.py`` holds the one of a snapshot push it made). Its own module so that the group
and the rank both name it without importing each other."""

from __future__ import annotations

from typing import Any

from meshspeak.rank_calls import RankCall


class FakeCall:
    """One call on one actor; also its ref (hashed by identity), as WorkerGroup's refs are."""

    def __init__(self, actor: int, method: RankCall, args: tuple) -> None:
        self.actor, self.method, self.args = actor, method, args
        self.state = "done"  # done | later (done, but a poll says not yet) | dead | failed | blocked | hung
        self.value: Any = None
        self.error = ""
