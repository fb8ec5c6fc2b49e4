"""The figures of bench/checkpoint_stall.py, from what its ranks measured (pure; no processes).

Per repetition a figure is the slowest rank's: the training step waits for every rank.
"""

from __future__ import annotations

import statistics

GOAL = 0.02  # async stall / sync save


def _slowest_of(per_rank) -> list[float]:
    """Per repetition, the slowest rank's figure: the training step waits for every rank."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def _slowest(ranks: list[dict], key: str) -> list[float]:
    return _slowest_of(r[key] for r in ranks)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _async_summary(ranks: list[dict], mode: str, sync_median: float) -> dict:
    def slowest(key: str) -> list[float]:
        return _slowest_of(r[mode][key] for r in ranks)

    stall, idle, during = slowest("stall_s"), slowest("step_idle_s"), slowest("step_during_write_s")
    caches = [r[mode]["stager_cache"] for r in ranks]
    steady = _median(stall[1:])
    return {
        "stall_s": stall,
        "stall_first_s": stall[0],
        "stall_steady_median_s": steady,
        "stall_ratio": steady / sync_median,
        "call_median_s": _median(slowest("call_s")[1:]),
        "fence_wait_median_s": _median(slowest("fence_s")[1:]),
        "staging_median_s": _median(slowest("staging_s")[1:]),
        "write_median_s": _median(slowest("write_s")),
        "waited_for_previous_max_s": max(slowest("waited_s")),
        # Each save is timed alone: the previous one's write was waited for before it started.
        "saves_started_with_none_in_flight": not any(any(r[mode]["in_flight_at_save"]) for r in ranks),
        # Same staging buffers (address, size) after every save: allocated once, then reused.
        "staging_buffers_reused": all(c and all(x == c[0] for x in c) for c in caches),
        "staging_buffer_bytes_per_rank": [sum(n for _, n in c[-1]) for c in caches],
        # [model, optimizer] per save and rank: True once checkpoints.state verified its shortcut.
        "state_dict_shortcut_steady": all(all(all(f) for f in r[mode]["state_dict_shortcut"][1:]) for r in ranks),
        "step_idle_median_s": _median(idle),
        "step_during_write_median_s": _median(during),
        "step_slowdown_during_write": _median(during) / _median(idle),
    }


def summarize(ranks: list[dict]) -> dict:
    """The figures of the run from every rank's raw timings (slowest rank per repeat, then medians)."""
    sync = _slowest(ranks, "sync_s")
    modes = {mode: _async_summary(ranks, mode, _median(sync)) for mode in ("async_staged", "async_background")}
    state_bytes = sum(r["local_state_bytes"] for r in ranks)
    loads: dict = {}
    saved = ranks[0]["saved_checksum"]
    for target, entry in ranks[0]["loads"].items():
        holders = [r for r in ranks if target in r["loads"]]  # dp1 ran on rank 0 alone
        if target == "dp2":
            same = _slowest_of(h["loads"][target]["load_s"] for h in holders)
            loads[target] = {"same_mesh_median_s": _median(same), "same_mesh_s": same}
            continue
        resh = _slowest_of(h["loads"][target]["resharded_from_dp2"]["load_s"] for h in holders)
        same = _slowest_of(h["loads"][target]["same_mesh"]["load_s"] for h in holders)
        checksum = entry["resharded_from_dp2"]["checksum"]
        loads[target] = {
            "resharded_from_dp2_median_s": _median(resh),
            "same_mesh_median_s": _median(same),
            "ratio_resharded_vs_same": _median(resh) / _median(same),
            "resharded_s": resh,
            "same_mesh_s": same,
            "params_match_saved": checksum is not None and abs(checksum - saved) <= 1e-6 * abs(saved),
        }
    headline = modes["async_background"]
    return {
        "state_bytes": state_bytes,
        "state_mb": state_bytes / 1e6,
        "sync_save_s": sync,
        "sync_save_median_s": _median(sync),
        "async_stall_steady_median_s": headline["stall_steady_median_s"],
        "async_stall_first_s": headline["stall_first_s"],
        "stall_ratio": headline["stall_ratio"],
        "async": modes,
        "loads": loads,
        "goal_met": headline["stall_ratio"] <= GOAL,
    }
