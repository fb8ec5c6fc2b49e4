"""The rules *between* config keys: whether a `JobConfig` describes a job that can run.

A key's own range or enum is declared with the key (`orchestrator.config`, through
`config_schema.key`) and checked from there; this module holds what no single key can say: the
divisibility constraints between the model, the batch and the mesh, the pipeline layout, and the
elastic bounds. Every rule raises `ConfigError` naming the offending key and how to fix it, because
the CLI prints that one line and exits 2 (README.md, "Use": exit codes).

The checks that depend on the mesh shape live in `check_mesh`, separately from the rest,
because the elastic controller re-runs them for every candidate mesh when dp changes. The
elastic bounds (`elastic.min_dp`/`max_dp`) are policy, not feasibility, so they are checked
for the configured target in `validate_job` and exposed to the controller as `dp_bounds`.

Pure stdlib: importable by the driver, the workers and the checkpoint tools alike.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from orchestrator.config_schema import ConfigError, check_values

if TYPE_CHECKING:  # only for annotations; config.py imports this module at runtime
    from orchestrator.config import JobConfig, TrainConfig

DTYPES = ("float32", "bfloat16")
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
ZERO_STAGES = (2, 3)
BUILTIN_DATA = "builtin"
BUILTIN_VOCAB = 256  # the built-in corpus is tokenised as raw bytes


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def microbatches_per_replica(train: TrainConfig, dp: int) -> int:
    """Number of microbatches each DP replica runs per step.

    Args:
        train: the train section (global and micro batch sizes).
        dp: data-parallel degree of the mesh in question.

    Returns:
        `global_batch_size // (dp * micro_batch_size)`; exact only when `check_mesh` passes.
    """
    return train.global_batch_size // (dp * train.micro_batch_size)


def dp_bounds(cfg: JobConfig) -> tuple[int, int]:
    """The (min, max) data-parallel degree the elastic controller may use.

    `elastic.max_dp = 0` means "never grow past the configured mesh.dp".
    """
    return cfg.elastic.min_dp, cfg.elastic.max_dp or cfg.mesh.dp


def check_mesh(cfg: JobConfig, dp: int, pp: int, tp: int) -> None:
    """Check that the model, batch and pipeline settings of `cfg` fit a (dp, pp, tp) mesh.

    Called by `load_config` for the configured mesh and by the elastic controller for each
    candidate mesh. Messages name the mesh axes as `mesh.dp` etc. with the candidate values.
    Does not check `dp_bounds`: a mesh outside the elastic bounds is a policy decision.

    Raises:
        ConfigError: naming the first key that does not fit, with a suggested fix.
    """
    for axis, degree in (("dp", dp), ("pp", pp), ("tp", tp)):
        _require(
            isinstance(degree, int) and degree >= 1,
            f"mesh.{axis}",
            f"mesh.{axis} must be an integer >= 1, got {degree!r}",
        )
    model, train, pipe = cfg.model, cfg.train, cfg.pipeline

    # Tensor parallelism splits attention heads, the vocabulary (embedding / loss_parallel),
    # the FFN hidden dimension, and - with sequence parallelism - the sequence.
    for key, size in (
        ("model.n_heads", model.n_heads),
        ("model.vocab_size", model.vocab_size),
        ("model.seq_len", model.seq_len),
    ):
        name = key.split(".")[1]
        _require(
            size % tp == 0,
            key,
            f"{key}={size} is not divisible by mesh.tp={tp}: choose {name} as a multiple of tp "
            f"(e.g. {_next_multiple(size, tp)}) or a tp that divides {size}",
        )
    if model.ffn_hidden:
        _require(
            model.ffn_hidden % tp == 0,
            "model.ffn_hidden",
            f"model.ffn_hidden={model.ffn_hidden} is not divisible by mesh.tp={tp}: choose a "
            f"multiple of tp (e.g. {_next_multiple(model.ffn_hidden, tp)}) or 0 for 4*d_model",
        )

    n_stages = pp * pipe.virtual_stages
    if n_stages > model.n_layers:
        what = f"mesh.pp={pp}"
        if pipe.virtual_stages > 1:
            what += f" x pipeline.virtual_stages={pipe.virtual_stages} = {n_stages} stages"
        raise ConfigError(
            "mesh.pp",
            f"{what} exceeds model.n_layers={model.n_layers}: every pipeline stage needs at "
            f"least one layer; lower mesh.pp or raise model.n_layers",
        )
    if pipe.layers is not None:
        _require(
            len(pipe.layers) == n_stages,
            "pipeline.layers",
            f"pipeline.layers has {len(pipe.layers)} entries but mesh.pp x "
            f"pipeline.virtual_stages = {n_stages} stages: give one layer count per stage",
        )

    per_step = dp * train.micro_batch_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            "train.global_batch_size",
            f"train.global_batch_size={train.global_batch_size} is not divisible by mesh.dp x "
            f"train.micro_batch_size = {dp} x {train.micro_batch_size} = {per_step}: choose a "
            f"multiple of {per_step} (e.g. {_next_multiple(train.global_batch_size, per_step)})",
        )
    n_micro = microbatches_per_replica(train, dp)
    if pipe.schedule == "interleaved_1f1b" and pp < 2:
        # The executor sends stage outputs to the neighbouring pp rank; with one pp rank every
        # virtual stage would send to itself, and there is no bubble to shrink anyway.
        raise ConfigError(
            "pipeline.schedule",
            f"pipeline.schedule='interleaved_1f1b' needs mesh.pp >= 2, got mesh.pp={pp}: use "
            "pipeline.schedule='1f1b' with virtual_stages=1, or raise mesh.pp",
        )
    if pipe.schedule in ("1f1b", "interleaved_1f1b") and n_micro < pp:
        raise ConfigError(
            "train.global_batch_size",
            f"pipeline.schedule={pipe.schedule!r} needs at least mesh.pp={pp} microbatches per "
            f"replica, got {n_micro} (train.global_batch_size={train.global_batch_size} / "
            f"(mesh.dp={dp} x train.micro_batch_size={train.micro_batch_size})): raise "
            f"train.global_batch_size to {pp * per_step} or lower train.micro_batch_size",
        )
    if pipe.schedule == "interleaved_1f1b" and n_micro % pp:
        example = _next_multiple(train.global_batch_size, pp * per_step)
        raise ConfigError(
            "train.global_batch_size",
            f"pipeline.schedule='interleaved_1f1b' needs the microbatches per replica "
            f"({n_micro}) to be a multiple of mesh.pp={pp}: set train.global_batch_size to a "
            f"multiple of {pp * per_step} (e.g. {example})",
        )


def _next_multiple(value: int, divisor: int) -> int:
    return max(divisor, -(-value // divisor) * divisor)


def validate_job(cfg: JobConfig) -> None:
    """Check every rule for a complete job; the first violation raises `ConfigError`."""
    # Every key's own rules first (declared with the key in orchestrator.config), so the rules
    # between keys below never divide by zero.
    check_values(cfg, {f.name: type(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
    _check_relations(cfg)
    check_mesh(cfg, cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp)
    _check_elastic_bounds(cfg)


def _check_relations(cfg: JobConfig) -> None:
    model, pipe = cfg.model, cfg.pipeline
    _require(
        model.d_model % model.n_heads == 0,
        "model.d_model",
        f"model.d_model={model.d_model} is not divisible by model.n_heads={model.n_heads}: choose "
        f"d_model as a multiple of n_heads (e.g. {_next_multiple(model.d_model, model.n_heads)})",
    )
    # Rotary embeddings rotate channel pairs, so each head needs an even width.
    even = model.n_heads * (model.head_dim + 1)
    _require(
        model.head_dim % 2 == 0,
        "model.d_model",
        f"model.d_model / model.n_heads = {model.head_dim} is odd: rotary embeddings need an even "
        f"head_dim; choose d_model = n_heads x an even number (e.g. {even})",
    )
    if cfg.data.path == BUILTIN_DATA:
        _require(
            model.vocab_size >= BUILTIN_VOCAB,
            "model.vocab_size",
            f"model.vocab_size={model.vocab_size} is too small for data.path=\"builtin\" (byte "
            f"tokens need {BUILTIN_VOCAB}): set model.vocab_size >= {BUILTIN_VOCAB}",
        )
    if pipe.schedule == "interleaved_1f1b":
        _require(
            pipe.virtual_stages >= 2,
            "pipeline.virtual_stages",
            f"pipeline.schedule='interleaved_1f1b' needs pipeline.virtual_stages >= 2, got "
            f"{pipe.virtual_stages}: set virtual_stages=2 or use schedule='1f1b'",
        )
    else:
        _require(
            pipe.virtual_stages == 1,
            "pipeline.virtual_stages",
            f"pipeline.virtual_stages={pipe.virtual_stages} needs "
            f"pipeline.schedule='interleaved_1f1b' (got {pipe.schedule!r}): set virtual_stages=1 "
            f"or switch the schedule",
        )
    if pipe.layers is not None:
        for i, n in enumerate(pipe.layers):
            _require(
                n >= 1, "pipeline.layers", f"pipeline.layers[{i}]={n}: every stage needs >= 1 layer"
            )
        _require(
            sum(pipe.layers) == model.n_layers,
            "pipeline.layers",
            f"pipeline.layers={list(pipe.layers)} sums to {sum(pipe.layers)} but "
            f"model.n_layers={model.n_layers}: make the per-stage counts add up to n_layers",
        )


def _check_elastic_bounds(cfg: JobConfig) -> None:
    dp, el = cfg.mesh.dp, cfg.elastic
    _require(
        el.min_dp <= dp,
        "elastic.min_dp",
        f"elastic.min_dp={el.min_dp} > mesh.dp={dp}: lower elastic.min_dp to at most {dp} or "
        f"raise mesh.dp",
    )
    _require(
        el.max_dp == 0 or el.max_dp >= dp,
        "elastic.max_dp",
        f"elastic.max_dp={el.max_dp} < mesh.dp={dp}: raise elastic.max_dp to at least {dp}, "
        f"or set 0 to mean mesh.dp",
    )
