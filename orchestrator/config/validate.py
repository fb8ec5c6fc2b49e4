"""The rules *between* config keys: whether a ``JobConfig`` describes a job that can run.

A key's own range or enum is declared with the key (``meshspeak.sections``, through
``meshspeak.schema.key``) and checked from there; this module holds what no single key can say: the
divisibility constraints between the model, the batch and the mesh, the pipeline layout, and the
elastic bounds. Every rule raises ``ConfigError`` naming the offending key and how to fix it, because
the CLI prints that one line and exits 2 (README.md, "Use": exit codes).

The checks that depend on the mesh shape live in ``check_mesh``, separately from the rest,
because the elastic controller re-runs them for every candidate mesh when dp changes. The
elastic bounds (``elastic.min_dp``/``max_dp``) are policy, not feasibility, so they are checked
for the configured target in ``validate_job`` and exposed to the controller as
``meshspeak.sections.dp_bounds``.

No torch, no Ray: the model's shape comes from its family's torch-free half
(``meshmodels.family.resolve_model``: a ``config.json`` with ``model.from_hf``).
"""

from __future__ import annotations

import dataclasses

from meshmodels.family import resolve_model
from meshspeak.profile import profile_range
from meshspeak.schedule import ZERO_BUBBLE
from meshspeak.schema import ConfigError, check_values
from meshspeak.sections import (
    BUILTIN_DATA,
    BUILTIN_VOCAB,
    JobConfig,
    ModelConfig,
    PipelineConfig,
    microbatches_per_replica,
)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


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
    # Tensor parallelism splits what the model family says (heads, vocabulary, FFN...) and, with
    # sequence parallelism, the sequence.
    resolved = resolve_model(cfg.model)
    resolved.family.check_mesh(resolved.shape, tp)
    _require(
        cfg.model.seq_len % tp == 0,
        "model.seq_len",
        f"model.seq_len={cfg.model.seq_len} is not divisible by mesh.tp={tp}: choose seq_len as a multiple of "
        f"tp (e.g. {_next_multiple(cfg.model.seq_len, tp)}) or a tp that divides {cfg.model.seq_len}",
    )
    _check_stages(cfg, pp, resolved.shape.n_layers)
    _check_batch(cfg, dp, pp)


def _check_stages(cfg: JobConfig, pp: int, n_layers: int) -> None:
    """Every pipeline stage holds at least one layer; ``pipeline.layers`` gives one count per stage."""
    model, pipe = cfg.model, cfg.pipeline
    layers_key = f"model.n_layers={n_layers}" if not model.from_hf else f"the {n_layers} layers of model.from_hf"

    n_stages = pp * pipe.virtual_stages
    if n_stages > n_layers:
        what = f"mesh.pp={pp}"
        if pipe.virtual_stages > 1:
            what += f" x pipeline.virtual_stages={pipe.virtual_stages} = {n_stages} stages"
        raise ConfigError(
            "mesh.pp",
            f"{what} exceeds {layers_key}: every pipeline stage needs at least one layer; lower "
            f"mesh.pp" + ("" if model.from_hf else " or raise model.n_layers"),
        )
    if pipe.layers is not None:
        _require(
            len(pipe.layers) == n_stages,
            "pipeline.layers",
            f"pipeline.layers has {len(pipe.layers)} entries but mesh.pp x "
            f"pipeline.virtual_stages = {n_stages} stages: give one layer count per stage",
        )


def _check_batch(cfg: JobConfig, dp: int, pp: int) -> None:
    """The global batch splits into whole microbatches per replica, as many as the schedule needs."""
    train, pipe = cfg.train, cfg.pipeline
    per_step = dp * train.micro_batch_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            "train.global_batch_size",
            f"train.global_batch_size={train.global_batch_size} is not divisible by mesh.dp x "
            f"train.micro_batch_size = {dp} x {train.micro_batch_size} = {per_step}: choose a "
            f"multiple of {per_step} (e.g. {_next_multiple(train.global_batch_size, per_step)})",
        )
    n_micro = microbatches_per_replica(train, dp)
    if pipe.schedule in ("interleaved_1f1b", *ZERO_BUBBLE) and pp < 2:
        # The executor sends stage outputs to the neighbouring pp rank; with one pp rank every
        # virtual stage would send to itself, and there is no bubble to shrink anyway.
        raise ConfigError(
            "pipeline.schedule",
            f"pipeline.schedule={pipe.schedule!r} needs mesh.pp >= 2, got mesh.pp={pp}: use "
            "pipeline.schedule='1f1b' with virtual_stages=1, or raise mesh.pp",
        )
    if pipe.schedule in ("1f1b", "interleaved_1f1b", *ZERO_BUBBLE) and n_micro < pp:
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
    # Every key's own rules first (declared with the key in meshspeak.sections), so the rules
    # between keys below never divide by zero.
    check_values(cfg, {f.name: type(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)})
    _check_relations(cfg)
    check_mesh(cfg, cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp)
    _check_elastic_bounds(cfg)
    profile_range(cfg.metrics.profile_steps, cfg.train.steps)


def _check_relations(cfg: JobConfig) -> None:
    _check_head_width(cfg.model)
    _check_builtin_vocab(cfg)
    _check_virtual_stages(cfg.pipeline)
    if cfg.pipeline.schedule in ZERO_BUBBLE:
        _check_zero_bubble(cfg)
    _check_sharding(cfg)
    _check_compression(cfg)
    _require(
        not cfg.elastic.rebalance or cfg.mesh.dp >= 2,
        "elastic.rebalance",
        f"elastic.rebalance=true needs mesh.dp >= 2 (it moves microbatches between data-parallel "
        f"replicas; got mesh.dp={cfg.mesh.dp}): raise mesh.dp or set elastic.rebalance=false",
    )
    if cfg.pipeline.layers is not None:
        _check_layer_counts(cfg)


def _check_head_width(model: ModelConfig) -> None:
    """The heads split ``d_model`` evenly, each head an even number of channels."""
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


def _check_builtin_vocab(cfg: JobConfig) -> None:
    """The sources are named once (``_check_mixtures``); the built-in byte data needs its vocabulary."""
    vocab = resolve_model(cfg.model).shape.vocab_size
    _check_mixtures(cfg)
    data_paths = [p for p, _ in cfg.data.mix] if cfg.data.mix else [cfg.data.path]
    if BUILTIN_DATA in data_paths:
        _require(
            vocab >= BUILTIN_VOCAB,
            "model.vocab_size",
            f"model.vocab_size={vocab} is too small for data.path=\"builtin\" (byte "
            f"tokens need {BUILTIN_VOCAB}): set model.vocab_size >= {BUILTIN_VOCAB}",
        )


def _check_virtual_stages(pipe: PipelineConfig) -> None:
    """``pipeline.virtual_stages`` as the schedule needs it: >= 2 interleaved, 2 for zbv, else 1."""
    if pipe.schedule == "interleaved_1f1b":
        _require(
            pipe.virtual_stages >= 2,
            "pipeline.virtual_stages",
            f"pipeline.schedule='interleaved_1f1b' needs pipeline.virtual_stages >= 2, got "
            f"{pipe.virtual_stages}: set virtual_stages=2 or use schedule='1f1b'",
        )
    elif pipe.schedule == "zbv":
        # Not set for the user: virtual_stages also decides how many entries pipeline.layers needs.
        _require(
            pipe.virtual_stages == 2,
            "pipeline.virtual_stages",
            f"pipeline.schedule='zbv' needs pipeline.virtual_stages=2 (its V holds two model chunks "
            f"on every pp rank), got {pipe.virtual_stages}: set pipeline.virtual_stages=2",
        )
    else:
        _require(
            pipe.virtual_stages == 1,
            "pipeline.virtual_stages",
            f"pipeline.virtual_stages={pipe.virtual_stages} needs "
            f"pipeline.schedule='interleaved_1f1b' (got {pipe.schedule!r}): set virtual_stages=1 "
            f"or switch the schedule",
        )


def _check_sharding(cfg: JobConfig) -> None:
    """CPU offload and HSDP's replicate groups, against the ZeRO level and mesh.dp."""
    _require(
        not cfg.mesh.cpu_offload or cfg.mesh.zero == 3,
        "mesh.cpu_offload",
        "mesh.cpu_offload=true needs mesh.zero=3: ZeRO-0..2 keep the parameters gathered on the "
        "device through the step; set mesh.zero=3 or mesh.cpu_offload=false",
    )
    _require(
        cfg.mesh.dp % cfg.mesh.dp_replicate == 0,
        "mesh.dp_replicate",
        f"mesh.dp_replicate={cfg.mesh.dp_replicate} must divide mesh.dp={cfg.mesh.dp} (shard groups "
        f"of dp / dp_replicate ranks): pick a divisor of dp",
    )
    _require(
        cfg.mesh.dp_replicate == 1 or cfg.mesh.zero >= 1,
        "mesh.dp_replicate",
        f"mesh.dp_replicate={cfg.mesh.dp_replicate} needs mesh.zero >= 1: ZeRO-0 already replicates "
        f"over all dp ranks; set mesh.dp_replicate=1 or mesh.zero=1..3",
    )


def _check_layer_counts(cfg: JobConfig) -> None:
    """``pipeline.layers``: every stage at least one layer, all of them adding up to the model's."""
    pipe, model = cfg.pipeline, cfg.model
    for i, n in enumerate(pipe.layers):
        _require(
            n >= 1, "pipeline.layers", f"pipeline.layers[{i}]={n}: every stage needs >= 1 layer"
        )
    _require(
        sum(pipe.layers) == resolve_model(model).shape.n_layers,
        "pipeline.layers",
        f"pipeline.layers={list(pipe.layers)} sums to {sum(pipe.layers)} but "
        f"model.n_layers={resolve_model(model).shape.n_layers}: make the per-stage counts add up to n_layers",
    )


def _check_mixtures(cfg: JobConfig) -> None:
    """A mixture names its own sources: ``data.mix`` beside a ``data.path`` other than the default is
    ambiguous (which one trains?), and so is ``eval.mix`` beside ``eval.path``; refused, not guessed."""
    _require(
        not (cfg.data.mix and cfg.data.path != BUILTIN_DATA),
        "data.mix",
        f"data.mix and data.path = {cfg.data.path!r} are both set: a mixture names its own sources; remove "
        "data.path, or add it to data.mix with a weight",
    )
    _require(
        not (cfg.eval.mix and cfg.eval.path),
        "eval.mix",
        f"eval.mix and eval.path = {cfg.eval.path!r} are both set: remove eval.path, or add it to eval.mix "
        "with a weight",
    )


def _check_compression(cfg: JobConfig) -> None:
    """Gradient compression and 1-bit Adam: what each works with (workers/compression.py)."""
    train, mesh = cfg.train, cfg.mesh
    _require(
        train.grad_compression != "powersgd" or mesh.zero == 0,
        "train.grad_compression",
        f"train.grad_compression=\"powersgd\" needs mesh.zero=0 (it compresses the all-reduce of "
        f"replicated gradients; got mesh.zero={mesh.zero}): set mesh.zero=0, or use \"int8\"/\"int4\", "
        f"which also quantize ZeRO-1..3's reduce-scatter",
    )
    if train.grad_compression in ("int8", "int4"):
        _require(
            mesh.dp_replicate == 1,
            "train.grad_compression",
            f"train.grad_compression={train.grad_compression!r} with mesh.dp_replicate={mesh.dp_replicate}: "
            f"HSDP's all-reduce across replica groups is FSDP2's own and cannot be quantized; set "
            f"mesh.dp_replicate=1 or train.grad_compression=\"none\"",
        )
        _require(
            train.grad_compression != "int4" or train.quant_block % 2 == 0,
            "train.quant_block",
            f"train.quant_block={train.quant_block} is odd: int4 packs two values per byte, so a block "
            f"must hold an even number of values (e.g. {train.quant_block + 1})",
        )
    if train.optimizer == "onebit_adam":
        _require(
            mesh.zero == 0,
            "train.optimizer",
            f"train.optimizer=\"onebit_adam\" needs mesh.zero=0 (1-bit Adam all-reduces the replicated "
            f"momentum; got mesh.zero={mesh.zero}): set mesh.zero=0 or train.optimizer=\"adamw\"",
        )
        _require(
            train.grad_compression == "none",
            "train.grad_compression",
            f"train.optimizer=\"onebit_adam\" compresses the momentum itself and reduces no gradients "
            f"after its warm-up: set train.grad_compression=\"none\" (got {train.grad_compression!r})",
        )
        _require(
            train.onebit_warmup_steps < train.steps,
            "train.onebit_warmup_steps",
            f"train.onebit_warmup_steps={train.onebit_warmup_steps} >= train.steps={train.steps}: 1-bit "
            f"Adam would never compress; lower it (DeepSpeed suggests 15-25% of the run, e.g. "
            f"{max(1, train.steps // 5)})",
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


def _check_zero_bubble(cfg: JobConfig) -> None:
    """What the split backward of zb-h1/zbv cannot do (workers/split_backward.py)."""
    name = cfg.pipeline.schedule
    # Its W pass is a second backward over the graph: torch.utils.checkpoint recomputes a block's
    # forward for each backward pass that unpacks its activations, so every checkpointed block
    # would run its forward three times per microbatch instead of two (tests/unit/test_split_backward.py).
    _require(
        not cfg.train.activation_checkpointing,
        "train.activation_checkpointing",
        f"pipeline.schedule={name!r} does not support train.activation_checkpointing=true: its "
        f"weight-gradient pass would recompute every checkpointed block's forward once more; set "
        f"train.activation_checkpointing=false or pipeline.schedule='1f1b'",
    )
    # A compiled block is one autograd node: its input and weight gradients cannot be taken apart
    # (torch's own zero-bubble schedules refuse torch.compile for the same reason).
    _require(
        not cfg.train.compile,
        "train.compile",
        f"pipeline.schedule={name!r} does not support train.compile=true: a compiled block's "
        f"backward cannot be split into input and weight gradients; set train.compile=false or "
        f"pipeline.schedule='1f1b'",
    )
    if name == "zbv":
        resolved = resolve_model(cfg.model)
        tied = resolved.family.tied_parameters(resolved.shape)
        # The V puts the first and the last stage on pp rank 0; tied copies are kept equal between
        # two ranks (workers/tied.py) and a checkpoint holds one tensor per name per rank.
        _require(
            not tied,
            "pipeline.schedule",
            f"pipeline.schedule='zbv' places the first and last stage on one pp rank, which the tied "
            f"parameters {', '.join(tied)} of this model cannot share; use pipeline.schedule='zb-h1'",
        )
