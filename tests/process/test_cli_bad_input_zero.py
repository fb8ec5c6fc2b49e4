"""Bad data-parallel strategy input through the real CLI: exit 2, one line naming the key and the fix."""

from __future__ import annotations

import pytest

from testbed.command_line import assert_bad_input, run_cli

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["mesh.zero=4"], ["mesh.zero=4 is not allowed", "0, 1, 2, 3"]),
        (["mesh.dp=4", "mesh.tp=1", "mesh.dp_replicate=3"], ["mesh.dp_replicate=3", "divide mesh.dp=4"]),
        (["mesh.zero=0", "mesh.dp_replicate=2"], ["mesh.dp_replicate", "mesh.zero >= 1"]),
        (['train.grad_reduce="float16"'], ["train.grad_reduce"]),
        (['train.grad_compression="powersgd"', "mesh.zero=3"], ["train.grad_compression", "needs mesh.zero=0"]),
        (['train.grad_compression="topk"'], ["train.grad_compression", "none", "powersgd", "int8", "int4"]),
        (['train.optimizer="onebit_adam"'], ["train.optimizer", "needs mesh.zero=0"]),
        (['train.grad_compression="int4"', "mesh.dp=4", "mesh.tp=1", "mesh.dp_replicate=2"],
         ["train.grad_compression='int4'", "mesh.dp_replicate=1"]),
        (['train.grad_compression="int4"', "train.powersgd_rank=4"],
         ["train.powersgd_rank is PowerSGD's", 'train.grad_compression="int4"', "do not combine"]),
        (["mesh.zero=0", "train.powersgd_rank=0"], ["train.powersgd_rank"]),
        (["mesh.zero=0", "train.powersgd_plain_steps=1"], ["train.powersgd_plain_steps", ">= 2"]),
    ],
)
def test_train_rejects_bad_strategy(overrides, needles):
    args = ["train"]
    for o in overrides:
        args += ["--set", o]
    assert_bad_input(run_cli(*args), *needles)


def test_plan_memory_gib():
    assert_bad_input(run_cli("plan", "--memory-gib", "0"), "--memory-gib")
    proc = run_cli("plan", "--set", "mesh.tp=1", "--memory-gib", "64")
    assert proc.returncode == 0, proc.stderr
    assert "strategy    mesh.zero=0 mesh.dp_replicate=1: cheapest that fits" in proc.stdout
