"""The config schema: one declaration per key gives loading, validation, errors and the README table."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from meshspeak.schema import ConfigError, check_values, coerce, doc_table, dump_toml, iter_keys, key, spec_of
from meshspeak.sections import ALL_KEYS, SECTIONS, config_doc, config_to_dict
from orchestrator.config.load import load_config

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_section_field_is_declared_with_key() -> None:
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert spec_of(f).doc.strip(), f"{cls.__name__}.{f.name} has no doc"


def test_readme_key_table_is_the_generated_one() -> None:
    text = README.read_text()
    m = re.search(r"<!-- config-keys:begin[^\n]*-->\n(.*?)<!-- config-keys:end -->", text, re.S)
    assert m, "README lost its generated config-keys section"
    assert m.group(1) == config_doc(), "README's key table is stale: paste `elastimesh config --doc` into it"


def test_doc_table_has_one_row_per_key_in_order() -> None:
    rows = [line for line in config_doc().splitlines()[2:]]
    assert [re.match(r"\| `([^`]+)`", r).group(1) for r in rows] == ALL_KEYS


# A section as a new issue would add it: one declaration per key, nothing else.
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _NewSection:
    spares: int = key(0, "warm actors kept ready", ge=0)
    factor: float = key(1.5, "slower than this times the median", gt=1)
    mode: str = key("off", "what to do", choices=("off", "report", "evict"))
    ratio: float = key(0.5, "a fraction", ge=0, lt=1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    new: _NewSection = dataclasses.field(default_factory=_NewSection)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"spares": -1}, "new.spares must be >= 0, got -1"),
        ({"factor": 1.0}, "new.factor must be > 1, got 1.0"),
        ({"mode": "kill"}, 'new.mode="kill" is not allowed: use one of "off", "report", "evict"'),
        ({"ratio": 1.0}, "new.ratio must be in [0, 1), got 1.0"),
    ],
)
def test_a_new_key_is_validated_from_its_declaration(changes: dict, message: str) -> None:
    sections = {"new": _NewSection}
    check_values(_Job(), sections)  # the defaults pass
    with pytest.raises(ConfigError) as info:
        check_values(_Job(new=_NewSection(**changes)), sections)
    assert str(info.value) == message and info.value.key == f"new.{next(iter(changes))}"


def test_a_new_key_is_coerced_and_documented_from_its_declaration() -> None:
    fields = {name: f for _, name, f in iter_keys({"new": _NewSection})}
    assert coerce("new.factor", fields["factor"], 2) == 2.0
    with pytest.raises(ConfigError, match="new.spares: expected an integer, got 'x'"):
        coerce("new.spares", fields["spares"], "x")
    table = doc_table({"new": _NewSection})
    assert "| `new.factor` | float | `1.5` | > 1 | slower than this times the median |" in table
    assert '| `new.mode` | string | `"off"` | "off", "report", "evict" | what to do |' in table


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    cfg = load_config(None, ["mesh.dp=1", "mesh.pp=2", "mesh.tp=1", "pipeline.layers=[1,3]",
                             'data.path=/a "quoted" \\ path', "train.lr=1e-4"])
    text = dump_toml(config_to_dict(cfg))
    assert tomllib.loads(text)["pipeline"]["layers"] == [1, 3]
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert load_config(path) == cfg


def test_star_import_works() -> None:
    namespace: dict = {}
    exec("from orchestrator.config import *", namespace)
    assert "load_config" in namespace and "JobConfig" in namespace


def test_cli_config_prints_doc_and_resolved_toml(capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli import main

    assert main(["config", "--doc"]) == 0
    assert capsys.readouterr().out == config_doc()
    assert main(["config", "--set", "mesh.dp=1"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["mesh"]["dp"] == 1
    assert main(["config", "--set", "mesh.dp=0"]) == 2
    assert capsys.readouterr().err.strip() == "elastimesh: error: mesh.dp must be >= 1, got 0"
