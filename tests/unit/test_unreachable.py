"""A join the network breaks is the cluster's configuration, told in one line, never a shrink (issue 35).

Scripted groups (no Ray): ranks whose join fails ``PeerUnreachable`` / ``StoreUnreachable``
(workers/reach.py) while every member is alive and the others stay inside their join (still dialling
a peer: a kick has no connection of theirs to shut). Before, those were killed as "did not return
after the kick" and the run rebuilt onto fewer hosts and exited 0; now nobody is killed and the run
stops with the line (exit 2). And the rank side: the lines themselves."""

from __future__ import annotations

import socket

import pytest

from meshspeak.messages import CallOutcome, WorkerStatus
from meshspeak.rank_calls import RankCalls
from meshspeak.rank_errors import PEER_UNREACHABLE, STORE_UNREACHABLE, RankError, kind_of, unreachable
from orchestrator.errors import ClusterNetworkError
from orchestrator.recovery import settle as recovery
from orchestrator.recovery.failure_policy import FailurePolicy, Phase, Raise, diagnose

PEER_LINE = ("PeerUnreachable: a rank on 198.18.0.3 could not connect to a peer's gloo listener at "
             "127.0.1.1:5543 (Connection refused): the peer advertised the loopback address 127.0.1.1")


class StuckJoiners:
    """Members alive; ``stuck`` ones never return from the join (kicked or not); ``late`` ones return
    at the first collect after a kick with ``late_error``."""

    def __init__(self, members: list[int], stuck: set[int], late: dict[int, str] | None = None) -> None:
        self.live = set(members)
        self.node_ids: dict[int, str] = {}  # no node known: no spare is beside a lost member
        self.stuck, self.late = stuck, dict(late or {})
        self.kicked = False
        self.killed: list[int] = []

    @property
    def live_ids(self) -> list[int]:
        return sorted(self.live)

    def exited(self, actor_ids) -> set[int]:
        return set()

    def kill_now(self, actor_ids) -> None:
        self.killed += sorted(actor_ids)
        self.live -= set(actor_ids)

    def call(self, actor_ids, method, args=(), *, timeout_s: float) -> CallOutcome:
        assert method is RankCalls.kick
        self.kicked = True
        return CallOutcome(results={actor: 0 for actor in actor_ids})

    def submit(self, actor_ids, method):  # a liveness probe (hang_watch.probe): every member answers
        assert method is RankCalls.status
        return {("status", a): a for a in actor_ids}

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        out = CallOutcome()
        for ref, actor in refs.items():
            if isinstance(ref, tuple):  # a probe's status call
                out.results[actor] = WorkerStatus(world_rank=0, pid=1, generation=1, busy=True, step=0, error=None)
            elif actor in self.late and self.kicked:
                out.failed[actor] = self.late[actor]
            else:
                out.pending.append(actor)
                out.pending_refs[ref] = actor
        return out


def join_outcome(failed: dict[int, str], pending: list[int]) -> CallOutcome:
    out = CallOutcome(failed=dict(failed))
    out.pending = list(pending)
    out.pending_refs = {f"ref{a}": a for a in pending}
    return out


def decide(found, members) -> object:
    failure = diagnose(Phase.JOINING, step=1, generation=1, members=members, found=found, step_timeout_s=120)
    return failure, FailurePolicy(max_restarts=3).decide(failure)


def test_a_peer_nobody_can_connect_to_stops_the_run_with_its_line_and_kills_nobody():
    group = StuckJoiners([0, 1, 2, 3], stuck={1, 2, 3})
    found = recovery.free_broken_call(group, join_outcome({0: PEER_LINE}, [1, 2, 3]), [0, 1, 2, 3], listeners={},
                            wait_s=65, hang_reason="hung")
    assert found.lost == set() and group.killed == []  # before: 1, 2, 3 killed as "did not return"
    assert found.unreachable == PEER_LINE.removeprefix("PeerUnreachable: ")
    failure, decision = decide(found, {r: r for r in range(4)})
    assert isinstance(decision, Raise) and isinstance(decision.error, ClusterNetworkError)
    assert decision.error.exit_code == 2
    assert str(decision.error) == f"generation 1 cannot form: {found.unreachable}"
    assert "\n" not in str(decision.error)


def test_a_join_that_says_so_only_after_the_kick_is_no_shrink_either():
    store_line = f"{STORE_UNREACHABLE}: a rank on 198.18.0.4 cannot reach the rendezvous store at 198.18.0.1:41234"
    group = StuckJoiners([0, 1, 2, 3], stuck={2, 3}, late={1: store_line})
    found = recovery.free_broken_call(group, join_outcome({0: "RuntimeError: Connection reset by peer"}, [1, 2, 3]),
                            [0, 1, 2, 3], listeners={}, wait_s=3, hang_reason="hung")
    assert group.killed == [] and found.unreachable == store_line.removeprefix(f"{STORE_UNREACHABLE}: ")
    _, decision = decide(found, {r: r for r in range(4)})
    assert isinstance(decision.error, ClusterNetworkError)


def test_with_a_member_dead_connect_errors_are_the_usual_failure():
    """A peer that died mid-join refuses its peers' connections too: that is a loss to rebuild from."""
    group = StuckJoiners([0, 1, 2, 3], stuck=set())
    outcome = join_outcome({0: PEER_LINE}, [])
    outcome.dead = {3: "ActorDiedError"}
    found = recovery.free_broken_call(group, outcome, [0, 1, 2, 3], listeners={}, wait_s=3, hang_reason="hung")
    assert found.lost == {3} and found.unreachable == ""
    _, decision = decide(found, {r: r for r in range(4)})
    assert not isinstance(decision, Raise)


def test_the_kinds_survive_the_trip_to_the_driver_as_their_line():
    assert unreachable(PEER_LINE) and unreachable(f"{STORE_UNREACHABLE}: x")
    assert not unreachable("DistNetworkError: Connection reset by peer")
    err = RankError(PEER_UNREACHABLE, "a rank on 10.0.0.2 could not connect")
    assert kind_of(err) == PEER_UNREACHABLE


def test_a_store_nobody_listens_on_is_one_line_naming_the_address_and_port():
    from workers.reach import check_store

    with socket.socket() as s:  # a port nothing listens on (closed again at once)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RankError) as info:
        check_store("127.0.0.1", port, "a rank on 127.0.0.1", reach_s=1.0)
    err = info.value
    assert err.kind == STORE_UNREACHABLE and "\n" not in str(err)
    assert f"the rendezvous store at 127.0.0.1:{port} (Connection refused" in str(err)
    assert f"open TCP port {port} on 127.0.0.1" in str(err)


def test_gloo_connect_errors_become_the_peer_line_and_kick_errors_do_not():
    from workers.reach import peer_unreachable

    refused = RuntimeError("Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] "
                           "connect remote=[127.0.1.1]:5543 Connection refused")
    err = peer_unreachable(refused, "a rank on 198.18.0.3", "198.18.0.3")
    assert err is not None and err.kind == PEER_UNREACHABLE
    assert "127.0.1.1:5543" in str(err) and "--node-ip-address" in str(err) and "\n" not in str(err)
    kicked = RuntimeError("Gloo connectFullMesh failed with [pair.cc:598] Connection closed by peer [10.0.0.2]:4000")
    assert peer_unreachable(kicked, "a rank on 10.0.0.3", "10.0.0.3") is None
    assert peer_unreachable(RuntimeError("Connection refused"), "x", None) is None  # not a gloo mesh connect
