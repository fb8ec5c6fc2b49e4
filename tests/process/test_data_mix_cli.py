"""data.mix / eval.mix bad input through the real CLI: exit 2, one line naming the key and the fix, and
nothing written (no metrics file, no checkpoint directory) — checked before Ray or any actor starts."""

from __future__ import annotations

import pytest

from testbed.command_line import assert_bad_input, run_cli

pytestmark = pytest.mark.timeout(120)


def _source(path: str, weight: str | None) -> str:
    return f'{{path = "{path}"' + ("" if weight is None else f", weight = {weight}") + "}"


def _mix(*entries: tuple[str, str | None]) -> str:
    return "[" + ", ".join(_source(p, w) for p, w in entries) + "]"


BUILTIN = ("builtin", "1")


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["data.mix=" + _mix(("builtin", "0"))], ["data.mix[0].weight must be > 0"]),
        (["data.mix=" + _mix(BUILTIN, ("MISSING", "-0.5"))], ["data.mix[1].weight must be > 0"]),
        (["data.mix=" + _mix(BUILTIN, ("MISSING", "1"))], ["data.mix[1].path", "does not exist"]),
        (["data.mix=" + _mix(BUILTIN), "data.path=MISSING"], ["data.mix and data.path", "remove data.path"]),
        (["eval.mix=" + _mix(BUILTIN, ("MISSING", "1"))], ["eval.mix[1].path", "does not exist"]),
        (["data.mix=" + _mix(("builtin", None))], ["data.mix[0].weight", "expected a number"]),
    ],
)
def test_bad_mixtures_are_one_line_and_exit_2_with_nothing_written(tmp_path, overrides, needles):
    args = ["train"]
    for o in [*overrides, f"metrics.path={tmp_path / 'm.jsonl'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]:
        args += ["--set", o.replace("MISSING", str(tmp_path / "missing"))]
    assert_bad_input(run_cli(*args, cwd=tmp_path), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
