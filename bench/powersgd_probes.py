"""Rank-side probe for bench/powersgd_convergence.py: set PowerSGDState knobs the config does not expose.

``run_mesh(instrument=functools.partial(powersgd_knobs, knobs))`` runs on every rank after its
``RankRuntime`` is built (a picklable module-level function, as the pool's forkserver ranks need): it
finds the one ``PowerSGDState`` the FSDP units' all-reduce hooks share (workers/compression.py) and sets
the given attributes on it (e.g. ``warm_start``, ``min_compression_rate``, ``use_error_feedback``),
before the first step. For exploring torch's knobs only; a knob worth keeping becomes a config key.
"""

from __future__ import annotations


def powersgd_knobs(knobs: dict, runtime):
    from workers.compression import fsdp_units_of

    states = set()
    for stage in runtime.stages.values():
        for unit in fsdp_units_of(stage.module):
            hook = unit._get_fsdp_state()._fsdp_param_group._all_reduce_hook
            state = getattr(hook, "state", None)
            if state is not None:
                states.add(state)
    if len(states) != 1:
        raise RuntimeError(f"expected one PowerSGDState on the rank, found {len(states)}")
    set_knobs(states.pop(), knobs)
    return None


def set_knobs(state, knobs: dict) -> None:
    """Set ``knobs`` on a ``PowerSGDState`` (also bench/powersgd_ddp_oracle.py's, on torch's DDP)."""
    for name, value in knobs.items():
        if not hasattr(state, name):
            raise AttributeError(f"PowerSGDState has no {name!r}")
        setattr(state, name, value)
