"""The pure analysis behind bench/pipeline_bubble.py: hand-off latencies (no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from pipeline_analysis import _handoff_latencies, _parse, _quantiles_ms  # noqa: E402

from meshspeak.schedule import Action, Op  # noqa: E402


def test_handoff_latencies_split_waiting_and_late_receives():
    send_f, recv_f = Action(0, Op.SEND_F, 0), Action(1, Op.RECV_F, 0)
    send_b, recv_b = Action(1, Op.SEND_B, 0), Action(0, Op.RECV_B, 0)
    spans = {
        send_f: (10.0, 10.001), recv_f: (9.0, 10.004),  # receiver waited: 4 ms after the send
        send_b: (20.0, 20.001), recv_b: (21.0, 21.002),  # send came first: the receive took 2 ms
    }
    waiting, late = _handoff_latencies(spans)
    assert waiting == [pytest.approx(0.004)] and late == [pytest.approx(0.002)]
    assert _quantiles_ms(waiting)["median"] == pytest.approx(4.0)
    assert _quantiles_ms([]) == {"n": 0}


def test_parse_reads_action_text_back():
    for action in (Action(2, Op.FORWARD, 0), Action(1, Op.SEND_F, 13), Action(11, Op.RECV_B, 7)):
        assert _parse(str(action)) == action
