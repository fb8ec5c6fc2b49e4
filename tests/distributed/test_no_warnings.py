"""A default job's steps warn about nothing: no two-step grad-norm reductions over dp x tp (DTensor's
"sequential all_reduce" notice), no FSDP2 "returned a view tensor" (docs/design.md, "Warnings").

The shared rank pool silences exactly those two (testbed/rank_pool.py); the ``instrument``
here lifts that for one run and records every warning and every WARNING log record of the steps.
"""

from __future__ import annotations

import pytest

from testbed.mesh_cases import SMALL
from testbed.world import run_mesh, shutdown_pool


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def record_warnings(runtime):
    import logging
    import warnings

    from testbed.rank_pool import _QUIET_LOGGERS

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(f"{record.name}: {record.getMessage()}")

    saved_filters, saved_show = warnings.filters[:], warnings.showwarning
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    warnings.resetwarnings()
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *a, **k: seen.append(f"{category.__name__}: {message}")
    handler = Keep(logging.WARNING)
    # torch's loggers may not propagate to the root: hold the known ones directly too
    roots = [logging.getLogger(), *(logging.getLogger(name) for name in _QUIET_LOGGERS)]
    for root in roots:
        root.addHandler(handler)

    def finish():
        for root in roots:
            root.removeHandler(handler)
        warnings.filters[:] = saved_filters
        warnings.showwarning = saved_show
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        return seen

    return finish


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("shape", "extra"), [((2, 1, 2), ()), ((2, 2, 2), ()),
                                              ((1, 2, 2), ('train.dtype="bfloat16"',)),
                                              ((2, 1, 1), ("mesh.zero=0",))],
                         ids=["dp2-tp2", "dp2-pp2-tp2", "pp2-tp2-bf16", "dp2-zero0-ddp"])
def test_default_steps_print_no_warnings(shape, extra):
    """FSDP2 + SP + PP ((2, 2, 2); (1, 2, 2) in bf16, which always goes through FSDP2) is where
    docs/design.md ("Warnings") saw FSDP2's "returned a view tensor": no stage output is a view now."""
    run = run_mesh(*shape, (*SMALL, *extra), 2, collect_params=False, instrument=record_warnings)
    assert all(seen == [] for seen in run.extras.values()), run.extras
