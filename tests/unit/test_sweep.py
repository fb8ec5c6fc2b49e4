"""`elastimesh tune` without Ray running: the SPACE parser, the per-trial and best configs, resume
checks, the profile range, and the CLI's one-line exit-2 answers to bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from meshspeak.profile import profile_range, profile_spec, worker_name
from meshspeak.schema import ConfigError, dump_toml
from meshspeak.sections import config_to_dict
from orchestrator import cli
from orchestrator.config.load import load_config
from orchestrator.sweep.space import FORMS, apply, parse_one, parse_search
from orchestrator.sweep.trial import StepReporter, trial_doc, trial_resources, trial_world
from orchestrator.sweep.tuner import SWEEP_FILE, best_row, best_toml, check_spaces, prepare, render_table

# --- SPACE ------------------------------------------------------------------------------------------


def test_every_space_form_parses():
    spaces = parse_search([
        "train.lr=loguniform(1e-4, 1e-2)", "train.beta2=uniform(0.9,0.99)", "train.warmup_steps=randint(0,4)",
        "pipeline.schedule=choice(1f1b, gpipe)", "train.activation_checkpointing=choice(true,false)",
        "pipeline.layers=choice([1,3],[2,2])", "mesh.zero=choice(2, 3)",
    ])
    assert [s.kind for s in spaces.values()] == ["loguniform", "uniform", "randint", "choice", "choice",
                                                 "choice", "choice"]
    assert spaces["train.lr"].values == (1e-4, 1e-2)
    assert spaces["train.warmup_steps"].values == (0, 4)
    assert spaces["train.warmup_steps"].probes() == [0, 3]  # Ray Tune's randint: upper bound excluded
    assert spaces["pipeline.schedule"].values == ("1f1b", "gpipe")
    assert spaces["train.activation_checkpointing"].values == (True, False)
    assert spaces["pipeline.layers"].values == ([1, 3], [2, 2])
    assert parse_one('data.path=choice(2024, "/x y")').values == ("2024", "/x y")  # a string key: words


def test_spaces_become_ray_tune_samplers_within_bounds():
    rng = np.random.RandomState(0)
    spaces = parse_search(["train.lr=loguniform(1e-4,1e-2)", "train.warmup_steps=randint(0,4)",
                           "pipeline.schedule=choice(1f1b,gpipe)"])
    lrs = spaces["train.lr"].to_tune().sample(size=200, random_state=rng)
    assert all(1e-4 <= v <= 1e-2 for v in lrs) and min(lrs) < 1e-3 < max(lrs)
    ints = set(spaces["train.warmup_steps"].to_tune().sample(size=200, random_state=rng))
    assert ints == {0, 1, 2, 3}
    assert set(spaces["pipeline.schedule"].to_tune().sample(size=50, random_state=rng)) == {"1f1b", "gpipe"}


@pytest.mark.parametrize("text,needle", [
    ("train.lrr=uniform(1,2)", "unknown key 'train.lrr': did you mean 'train.lr'?"),
    ("lr=uniform(1e-4,1e-2)", "did you mean 'train.lr'?"),
    ("train.lr=unif(1,2)", "unknown space 'unif'"),
    ("train.lr=uniform(1,2", "malformed SPACE"),
    ("train.lr", "expected KEY=SPACE"),
    ("train.lr=uniform(1e-3)", "uniform(a,b) takes two numbers"),
    ("train.lr=uniform(2e-3,1e-3)", "needs finite a < b"),
    ("train.lr=loguniform(0,1)", "loguniform(a,b) needs a > 0"),
    ("mesh.dp=uniform(1,4)", "takes integers: use randint(a,b) or choice(...)"),
    ("mesh.dp=randint(1.5,4)", "randint(a,b) takes two integers"),
    ("train.lr=choice()", "choice() needs at least one value"),
    ("train.lr=choice(1,[2)", "cannot read the values"),
])
def test_malformed_search_names_the_argument(text, needle):
    with pytest.raises(ConfigError) as err:
        parse_search([text])
    assert needle in err.value.message and f"--search {text!r}" in err.value.message
    assert "\n" not in err.value.message


def test_a_key_searched_twice_is_refused():
    with pytest.raises(ConfigError, match="searched twice"):
        parse_search(["train.lr=choice(1e-3)", "train.lr=uniform(1e-4,1e-3)"])


def test_every_value_of_a_space_must_fit_the_job():
    base = config_to_dict(load_config(None))
    check_spaces(base, parse_search(["train.lr=loguniform(1e-4,1e-2)", "mesh.dp=choice(1,2,4)"]))
    with pytest.raises(ConfigError, match=r"with mesh.dp=3: train.global_batch_size=8 is not divisible"):
        check_spaces(base, parse_search(["mesh.dp=choice(2,3)"]))
    with pytest.raises(ConfigError, match=r"with train.beta1=1.0: train.beta1 must be in \[0, 1\)"):
        check_spaces(base, parse_search(["train.beta1=uniform(0.5,1.0)"]))


# --- trial and best configs -------------------------------------------------------------------------


def test_trial_doc_is_the_job_with_the_values_and_the_trials_own_paths(tmp_path):
    base = config_to_dict(load_config(None, ["checkpoint.dir=s3://bucket/run/", "checkpoint.every=2",
                                            "metrics.tensorboard_dir=tb", "metrics.profile_steps=1:2"]))
    doc = trial_doc(base, {"train.lr": np.float64(2e-3), "mesh.dp": np.int64(1)}, str(tmp_path), "abc_00001")
    path = tmp_path / "job.toml"
    path.write_text(dump_toml(doc))
    cfg = load_config(path)  # what `elastimesh train` would run
    assert cfg.train.lr == 2e-3 and cfg.mesh.dp == 1
    assert cfg.metrics.path == str(tmp_path / "metrics.jsonl")
    assert cfg.metrics.tensorboard_dir == str(tmp_path / "tensorboard")
    assert cfg.metrics.profile_dir == str(tmp_path / "profiles") and cfg.metrics.timeline == ""
    assert cfg.checkpoint.dir == "s3://bucket/run/abc_00001"
    assert base["train"]["lr"] == 3e-3  # the sweep's own job is untouched


def test_trial_reserves_an_empty_head_bundle_and_one_bundle_per_rank():
    pytest.importorskip("ray")
    base = config_to_dict(load_config(None))  # dp=2, tp=2
    pgf = trial_resources({"mesh.dp": 1}, base=base, bundle={"CPU": 0.25})
    assert pgf.head_bundle_is_empty and pgf.bundles == [{"CPU": 0.25}] * 2
    assert trial_world(base, {}) == 4


def test_step_reporter_reports_each_step_once():
    seen = []
    reporter = StepReporter(seen.append)
    for step in (1, 2, 3, 2, 3, 4):  # a rebuild after step 3 re-ran steps 2 and 3
        reporter({"step": step, "loss": 10.0 - step, "lr": 1e-3, "dp": 1, "bubble": 0.0})
    assert [r["step"] for r in seen] == [1, 2, 3, 4]
    assert seen[0] == {"step": 1, "loss": 9.0, "lr": 1e-3, "dp": 1}


def _row(trial, lr, loss, outcome, step=4):
    return {"trial": trial, "values": {"train.lr": lr}, "step": step, "steps": 4, "loss": loss,
            "outcome": outcome, "status": "TERMINATED", "path": ""}


def test_best_is_the_completed_trial_with_the_lowest_loss_and_trains_as_toml(tmp_path):
    sweep = prepare(None, ["train.lr=choice(1e-2,1e-5)"], samples=4, directory=str(tmp_path / "sw"))
    rows = [_row("a", 1e-5, 5.5, "completed"), _row("b", 1e-2, 1.0, "stopped early at step 2", 2),
            _row("c", 1e-2, 4.0, "completed"), _row("d", 3e-3, float("nan"), "completed"),
            _row("e", 1e-3, None, "failed", None)]
    best = best_row(rows)
    assert best["trial"] == "c"
    text = best_toml(sweep, best)
    (tmp_path / "best.toml").write_text(text)
    assert load_config(tmp_path / "best.toml") == load_config(None, ["train.lr=1e-2"])
    assert best_row([_row("b", 1e-2, 1.0, "stopped early at step 2", 2)]) is None
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render_table(sweep, rows, best))
    out = console.export_text()
    assert "c (best)" in out and "stopped early at step 2" in out and "failed" in out


def test_a_different_sweep_in_the_same_dir_is_refused(tmp_path):
    sweep = prepare(None, ["train.lr=choice(1e-2,1e-5)"], samples=2, directory=str(tmp_path))
    (tmp_path / SWEEP_FILE).write_text(json.dumps(sweep.settings()))
    prepare(None, ["train.lr=choice(1e-2,1e-5)"], samples=2, directory=str(tmp_path))  # a resume
    with pytest.raises(ConfigError, match="holds a sweep started with other samples, search"):
        prepare(None, ["train.lr=choice(1e-2,1e-4)"], samples=3, directory=str(tmp_path))


# --- profiles ---------------------------------------------------------------------------------------


def test_profile_range():
    assert profile_range("", 10) is None
    assert profile_range("2:3", 10) == (2, 3) and profile_range(" 4:4 ", 4) == (4, 4)
    for text, needle in [("3", "not a step range"), ("a:b", "not a step range"), ("2:", "not a step range"),
                         ("0:2", "outside the run"), ("3:2", "outside the run"), ("2:11", "train.steps=10")]:
        with pytest.raises(ConfigError, match=needle) as err:
            profile_range(text, 10)
        assert err.value.key == "metrics.profile_steps"


def test_profile_spec_defaults_beside_the_metrics_file(tmp_path):
    cfg = load_config(None, [f"metrics.path={tmp_path}/run/m.jsonl", "metrics.profile_steps=2:3"])
    spec = profile_spec(cfg.metrics, cfg.train.steps)
    assert (spec.first, spec.last, spec.out_dir) == (2, 3, str(tmp_path / "run" / "profiles"))
    assert [spec.covers(s) for s in (1, 2, 3, 4)] == [False, True, True, False]
    assert profile_spec(load_config(None).metrics, 20) is None
    assert worker_name(3, 2, 7) == "rank3-gen2-step7"


# --- the CLI: exit 2, one line ----------------------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    (["tune", "--search", "train.nope=uniform(1,2)"], "unknown key 'train.nope'"),
    (["tune", "--search", "train.lr=uniform(1,2"], "malformed SPACE"),
    (["tune", "--search", "train.lr=uniform(1e-3,1e-2)", "--samples", "0"], "--samples 0"),
    (["tune"], "at least one --search"),
    (["tune", "--search", "mesh.dp=choice(2,3)"], "with mesh.dp=3"),
    (["tune", "--search", "train.lr=choice(1e-3)", "--dir", "/proc/nope/sweep"],
     "--dir /proc/nope/sweep: cannot write"),
    (["train", "--set", "metrics.profile_steps=5:30"], "outside the run"),
    (["config", "--set", "metrics.profile_steps=2-3"], "not a step range"),
])
def test_cli_bad_input_is_one_line_exit_2(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("elastimesh: error:") and needle in lines[0], err
    assert not os.path.exists(tmp_path / "sweeps")  # nothing started, nothing written


def test_optuna_is_refused_in_one_line_when_missing(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_optuna(name, *args, **kwargs):
        if name == "optuna" or name.startswith("optuna."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_optuna)
    with pytest.raises(ConfigError, match=r"needs the optuna package: pip install 'elastimesh\[tune\]'"):
        prepare(None, ["train.lr=uniform(1e-3,1e-2)"], samples=2, search_alg="optuna", directory=str(tmp_path))


def test_apply_puts_dotted_values_into_a_copy():
    doc = {"train": {"lr": 1.0}}
    out = apply(doc, {"train.lr": np.float32(0.5), "pipeline.layers": (1, 3)})
    assert out == {"train": {"lr": 0.5}, "pipeline": {"layers": [1, 3]}} and doc == {"train": {"lr": 1.0}}


def test_largest_trial_must_fit_an_embedded_ray(tmp_path):
    from orchestrator.errors import WorkerGroupStartupError
    from orchestrator.sweep.tuner import _check_fits

    sweep = prepare(None, ["mesh.dp=choice(1,2,4)", "mesh.tp=choice(1,2)"], samples=2,
                    directory=str(tmp_path))  # dp=4, tp=2: 8 ranks at most
    assert sweep.max_world == 8
    _check_fits(sweep, 8.0)
    with pytest.raises(WorkerGroupStartupError, match="the largest trial has 8 ranks"):
        _check_fits(sweep, 7.0)


def test_an_unwritable_profile_dir_is_bad_input(tmp_path):
    from orchestrator.errors import UserInputError
    from orchestrator.metrics import check_outputs

    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = load_config(None, [f"metrics.path={tmp_path}/m.jsonl", "metrics.profile_steps=1:1",
                             f"metrics.profile_dir={blocker}/traces"])
    with pytest.raises(UserInputError, match=r"metrics.profile_dir=.*cannot write"):
        check_outputs(cfg.metrics)
    check_outputs(load_config(None, [f"metrics.path={tmp_path}/m.jsonl", "metrics.profile_steps=1:1"]).metrics)
    assert (tmp_path / "profiles").is_dir()


# --- grid(...) as Ray Tune's grid_search; choice at random; Tune's own tables only with --verbose ------


def test_grid_is_tunes_grid_search_every_value_times_samples():
    from ray.tune.search.variant_generator import generate_variants

    spaces = parse_search(["train.lr=grid(1e-2, 1e-3, 1e-4)", "pipeline.schedule=choice(1f1b, gpipe)"])
    assert spaces["train.lr"].kind == "grid" and spaces["train.lr"].probes() == [1e-2, 1e-3, 1e-4]
    space = {key: s.to_tune() for key, s in spaces.items()}
    assert space["train.lr"] == {"grid_search": [1e-2, 1e-3, 1e-4]}
    # Tune's generator, as Tuner runs it --samples times: each pass gives every grid value once, and
    # draws the choice at random for each.
    samples = 4
    rng = np.random.default_rng(0)  # seeded: all 12 draws alike would otherwise fail 1 run in 2048
    drawn = [variant for _ in range(samples) for _, variant in generate_variants(space, random_state=rng)]
    assert len(drawn) == samples * 3
    assert sorted(v["train.lr"] for v in drawn) == sorted([1e-2, 1e-3, 1e-4] * samples)
    assert {v["pipeline.schedule"] for v in drawn} == {"1f1b", "gpipe"}  # drawn, not enumerated


@pytest.mark.parametrize("text,needle", [
    ("train.lr=grid(1e-3,1e-2", "malformed SPACE"),
    ("train.lr=grid(", "malformed SPACE"),
    ("train.lr=grid()", "grid() needs at least one value"),
    ("train.lr=grid(1,[2)", "cannot read the values"),
])
def test_malformed_grid_names_the_argument(text, needle):
    with pytest.raises(ConfigError) as err:
        parse_search([text])
    assert needle in err.value.message and "grid(a,b,...)" in FORMS and "\n" not in err.value.message


def test_malformed_grid_on_the_cli_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tune", "--search", "train.lr=grid(1e-3,1e-2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "malformed SPACE 'grid(1e-3,1e-2'" in lines[0]
    assert cli.main(["tune", "--search", "train.lr=grid(1e-3,1e-2)", "--search-alg", "optuna"]) == 2
    assert "takes no grid(...)" in capsys.readouterr().err


def test_tunes_own_tables_only_with_verbose(tmp_path):
    from orchestrator.sweep.tuner import build_tuner

    for verbose, expected in ((False, 0), (True, 1)):
        sweep = prepare(None, ["train.lr=grid(1e-3,1e-2)"], samples=1, directory=str(tmp_path / str(verbose)))
        tuner = build_tuner(sweep, use_gpu=False, verbose=verbose)
        assert tuner._local_tuner.get_run_config().verbose == expected
