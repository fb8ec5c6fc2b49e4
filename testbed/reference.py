"""The single-process reference every mesh, resize and resume is compared with, and the comparison.

``reference(overrides, steps)`` runs ``workers.reference.ReferenceTrainer`` (one process, the whole
model and batch) on steps 1..``steps`` of the job the overrides describe, once per process for each
(overrides that can change its math, steps, skipped steps); ``assert_matches_reference`` checks a run's
per-step losses and final parameters against it, within a :class:`Tolerance` (see there for why
each one is what it is). The mesh tests (``testbed.world.run_mesh``), the controller tests on Ray
actors, the end-to-end tests and the benchmarks all use these two.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.config.load import load_config

__all__ = ["CONTROLLER_FP32", "MESH_FP32", "MESH_FP64", "TEST_LR", "Reference", "Tolerance",
           "assert_matches_reference", "assert_params_match", "reference", "reference_key"]

# The Ray tests train at lr 1e-3, not the default 3e-3, for margin under CONTROLLER_FP32 (see there).
TEST_LR = "train.lr=1e-3"


@dataclass(frozen=True)
class Reference:
    losses: tuple[float | None, ...]  # steps 1..steps; None for a skipped step
    params: dict[str, np.ndarray]  # read-only arrays: the object is shared by every caller


@dataclass(frozen=True)
class Tolerance:
    """How close a run must come to the reference: every step's loss within ``loss_rtol`` relative,
    every parameter element within ``param_atol + param_rtol * |reference|``."""

    loss_rtol: float
    param_atol: float
    param_rtol: float


# The mesh tests (run_mesh: the SMALL model or a family's tiny one, fp32, a few to 10 steps at the
# default lr): 1e-5 relative per loss and 1e-5 absolute per parameter element, which every layout,
# schedule and ZeRO level holds; a misplaced or stale shard is off by ~1e-2 on most elements.
MESH_FP32 = Tolerance(loss_rtol=1e-5, param_atol=1e-5, param_rtol=0.0)
# Runs through the controller on Ray actors (tests/ray, tests/e2e): every element within 1e-5 absolute
# + relative, as that acceptance asked. They train at TEST_LR (lr 1e-3), not the default 3e-3, for
# margin: AdamW turns summation-order noise in a near-zero gradient into a full step of ~lr for that
# element, so the fp32 reference itself ends 8e-6 away from an fp64 run of the same 10 steps at lr
# 3e-3, and 2.7e-6 at lr 1e-3 (measured on this stack). TP and DP change the summation order, so at
# 3e-3 a correct mesh lands ~1.2e-5 away on a few elements of 16k.
CONTROLLER_FP32 = Tolerance(loss_rtol=1e-5, param_atol=1e-5, param_rtol=1e-5)
# train.dtype = "float64" end to end (weights, optimizer state, reductions): all that is left is the
# reductions' summation order, so long fault runs can be held to 1e-9 (tests/distributed/test_float64.py).
MESH_FP64 = Tolerance(loss_rtol=1e-9, param_atol=1e-9, param_rtol=0.0)

# The sections the reference reads (ReferenceTrainer's model, train and data); checkpoint.init_from is
# its initial weights. Everything else (mesh, pipeline, elastic, checkpoint.dir, metrics, eval...)
# must not change the math, which is what the tests check, so it stays out of the cache key.
_MATH_SECTIONS = ("model", "train", "data")
_MATH_KEYS = ("checkpoint.init_from",)


def reference_key(overrides: Iterable[str]) -> tuple[str, ...]:
    """The overrides that can change the single-process math (the cache key), in their order."""
    return tuple(o for o in overrides if o.split(".", 1)[0].strip() in _MATH_SECTIONS
                 or o.split("=", 1)[0].strip() in _MATH_KEYS)


def reference(overrides: Iterable[str] = (), steps: int = 10, skip: Iterable[int] = ()) -> Reference:
    """The single-process ``ReferenceTrainer`` on steps 1..``steps`` of the job ``overrides`` describe,
    cached per (:func:`reference_key`, steps, skip). A step in ``skip`` (one the mesh skipped as bad)
    trains nothing and has no loss (None)."""
    return _reference(reference_key(overrides), steps, frozenset(skip))


@functools.lru_cache(maxsize=None)
def _reference(overrides: tuple[str, ...], steps: int, skip: frozenset[int]) -> Reference:
    import torch

    from meshdata.masks import mask_eos_for
    from workers.reference import ReferenceTrainer

    cfg = load_config(None, [*overrides, "mesh.dp=1", "mesh.pp=1", "mesh.tp=1"])
    # One intra-op thread, like the ranks: on 2 busy cores OpenMP's spinning threads make a step
    # of the tiny model 10-50x slower (measured 45 ms vs 0.4-3.5 s at load ~10).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = ReferenceTrainer(cfg.model, cfg.train, cfg.data.mix or cfg.data.path,
                                   init_from=cfg.checkpoint.init_from, mask_eos_id=mask_eos_for(cfg.data))
        losses = tuple(trainer.run(1, steps, skip=set(skip)))
        params = trainer.params()
    finally:
        torch.set_num_threads(threads)
    for value in params.values():
        value.setflags(write=False)
    return Reference(losses=losses, params=params)


def assert_matches_reference(losses: Sequence[float] | Mapping[int, float], params: Mapping[str, np.ndarray] | None,
                             ref: Reference, tol: Tolerance = MESH_FP32) -> None:
    """A run's losses (a list from step 1, or step -> loss) and final parameters (None: losses only)
    equal ``ref`` within ``tol``: the same steps, the same parameter names and shapes."""
    got = [losses[s] for s in range(1, len(ref.losses) + 1)] if isinstance(losses, Mapping) else list(losses)
    np.testing.assert_allclose(got, ref.losses, rtol=tol.loss_rtol, atol=0, err_msg="per-step loss vs reference")
    if params is not None:
        assert_params_match(params, ref.params, tol)


def assert_params_match(params: Mapping[str, np.ndarray], ref_params: Mapping[str, np.ndarray],
                        tol: Tolerance = MESH_FP32) -> None:
    """The same parameter names and shapes as the reference, every element within ``tol``."""
    assert set(params) == set(ref_params), (
        f"missing from the run: {sorted(set(ref_params) - set(params))}; "
        f"extra in the run: {sorted(set(params) - set(ref_params))}"
    )
    for name, want in sorted(ref_params.items()):
        got = params[name]
        assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
        if want.size == 0:
            continue
        diff = np.abs(got - want)
        excess = diff - (tol.param_atol + tol.param_rtol * np.abs(want))
        rel_l2 = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
        assert excess.max() <= 0, (  # NaN fails here too
            f"{name}: {int((~(excess <= 0)).sum())}/{want.size} elements off by more than {tol.param_atol} "
            f"+ {tol.param_rtol} x |reference| (largest {float(diff.max()):.3g}; relative L2 of the "
            f"tensor {rel_l2:.3g})"
        )
