"""orchestrator.metrics.check_outputs: unwritable metrics outputs are bad input, found before Ray starts."""

from __future__ import annotations

import pytest

from meshspeak.sections import MetricsConfig
from orchestrator.errors import UserInputError
from orchestrator.metrics import check_outputs


def test_writable_outputs_pass_and_get_their_directories(tmp_path):
    cfg = MetricsConfig(path=str(tmp_path / "a" / "m.jsonl"), timeline=str(tmp_path / "b" / "t.json"),
                        tensorboard_dir=str(tmp_path / "tb"))
    check_outputs(cfg)
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir() and (tmp_path / "tb").is_dir()
    # Nothing else is written: no metrics file, no timeline, no probe left behind.
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_an_existing_metrics_file_is_left_as_it_is(tmp_path):
    log = tmp_path / "m.jsonl"
    log.write_text('{"step": 1}\n')
    check_outputs(MetricsConfig(path=str(log)))
    assert log.read_text() == '{"step": 1}\n'


def test_empty_keys_are_not_checked():
    check_outputs(MetricsConfig(path="", timeline="", tensorboard_dir=""))


@pytest.mark.parametrize("key", ["path", "timeline", "tensorboard_dir"])
def test_a_file_in_the_way_names_the_key_and_the_fix(tmp_path, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("x\n")
    fields = {"path": "", key: str(blocker / "sub" / "out")}
    with pytest.raises(UserInputError) as info:
        check_outputs(MetricsConfig(**fields))
    message = info.value.message
    assert info.value.exit_code == 2 and "\n" not in message
    assert f"metrics.{key}=" in message and str(blocker) in message and f"set metrics.{key} to" in message


def test_metrics_path_on_a_directory(tmp_path):
    with pytest.raises(UserInputError, match=r"metrics.path=.* is a directory; set metrics.path to"):
        check_outputs(MetricsConfig(path=str(tmp_path)))
