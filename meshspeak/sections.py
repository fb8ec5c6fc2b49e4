"""The job configuration's sections: one frozen dataclass per TOML section, every key declared once.

This module owns the config *schema* both sides read: each key is declared exactly once with
``key(default, doc, <rules>)`` (type = annotation; defaults make a tiny dp=2, tp=2 CPU job).
Coercion, the key's own range/enum errors, unknown-key suggestions and the README key table
(``elastimesh config --doc``) are derived from those declarations (``meshspeak.schema``). Loading a
TOML file with ``--set`` overrides is the driver's (``orchestrator.config.load``), the rules between
keys too (``orchestrator.config.validate``); the ranks only ever receive sections.

To add a key: declare it in its section below; nothing else is needed for it to be loaded,
validated, suggested and documented (then regenerate README's table: ``elastimesh config --doc``).

Pure stdlib (no ray, no torch): frozen dataclasses pickle cleanly to actors, and each component
should receive only its own section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshspeak.schema import doc_table, iter_keys, key, plain_value

__all__ = [
    "ALL_KEYS", "CheckpointConfig", "DataConfig", "ElasticConfig", "EvalConfig", "FIELDS", "JobConfig",
    "MeshConfig", "MetricsConfig", "ModelConfig", "PipelineConfig", "ResourcesConfig", "SECTIONS",
    "TrainConfig", "config_doc", "config_to_dict", "dp_bounds", "microbatches_per_replica", "replace_mesh",
]  # fmt: skip

# Allowed values of the enum-like keys (the rules between keys use them too).
DTYPES = ("float32", "bfloat16", "float16", "float64")
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb-h1", "zbv")
ZERO_STAGES = (0, 1, 2, 3)
GRAD_REDUCE = ("float32", "bfloat16")
GRAD_COMPRESSION = ("none", "powersgd", "int8", "int4")
OPTIMIZERS = ("adamw", "onebit_adam")
BUILTIN_DATA = "builtin"
BUILTIN_VOCAB = 256  # the built-in corpus is tokenised as raw bytes


_SECTION = dict(frozen=True, kw_only=True, slots=True)


@dataclass(**_SECTION)
class MeshConfig:
    dp: int = key(2, "data-parallel replicas: the axis that shrinks and grows", ge=1)
    pp: int = key(1, "pipeline stages", ge=1)
    tp: int = key(2, "tensor-parallel shards (with sequence parallelism)", ge=1)
    zero: int = key(3, "3: params, grads and optimizer state sharded over dp (FSDP2); 2: params "
                       "gathered for the step; 1: as 2 (torch has no ZeRO-1 apart from ZeRO-2); 0: "
                       "replicated, one all-reduce of the grads per FSDP unit", choices=ZERO_STAGES)
    # See meshspeak.mesh.fsdp_units for the grouping.
    fsdp_unit_mb: float = key(25.0, "consecutive blocks share one FSDP unit (one all-gather and "
                                    "reduce-scatter) up to this many MB of fp32 parameters per tp "
                                    "shard; 0 = one unit per block", ge=0)
    cpu_offload: bool = key(False, "ZeRO-Offload: sharded parameters, gradients and the optimizer "
                                   "step on the host (FSDP2 CPUOffloadPolicy); needs zero=3")
    dp_replicate: int = key(1, "HSDP: shard within groups of dp / dp_replicate ranks, replicate across "
                               "dp_replicate groups (zero >= 1); must divide dp", ge=1)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


@dataclass(**_SECTION)
class ModelConfig:
    n_layers: int = key(4, "transformer blocks", ge=1)
    d_model: int = key(64, "hidden size", ge=1)
    n_heads: int = key(4, "attention heads", ge=1)
    vocab_size: int = key(256, "vocabulary size; >= 256 for the built-in corpus (byte tokens)", ge=1)
    seq_len: int = key(64, "tokens per training sequence", ge=1)
    ffn_hidden: int = key(0, "feed-forward hidden size; 0 = 4 * d_model", ge=0)
    norm_eps: float = key(1e-5, "RMSNorm epsilon", gt=0)
    init_std: float = key(0.02, "standard deviation of the initial weights", gt=0)
    rope_theta: float = key(10000.0, "rotary embedding base", gt=0)
    family: str = key("", 'model family: "gpt" (built-in), "llama", or "package.module:Name" (a user\'s '
                          'ModelFamily); empty = "llama" with from_hf, else "gpt"')
    from_hf: str = key("", "Hugging Face model directory whose config.json gives the architecture (then no "
                           "size key may be set)")

    @property
    def ffn_dim(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(**_SECTION)
class TrainConfig:
    steps: int = key(20, "optimizer steps to train", ge=1)
    global_batch_size: int = key(8, "sequences per optimizer step, whatever the mesh", ge=1)
    micro_batch_size: int = key(2, "sequences per microbatch per DP replica", ge=1)
    lr: float = key(3e-3, "peak learning rate after warmup", gt=0)
    min_lr_ratio: float = key(0.1, "the decay ends at lr * min_lr_ratio (1 = constant after warmup)", ge=0, le=1)
    lr_decay: str = key("cosine", "shape of the decay from lr to lr * min_lr_ratio over the steps after "
                                  "warmup", choices=("cosine", "linear"))
    warmup_steps: int = key(2, "linear warmup steps", ge=0)
    weight_decay: float = key(0.0, "AdamW weight decay", ge=0)
    beta1: float = key(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = key(0.95, "AdamW beta2", ge=0, lt=1)
    grad_clip: float = key(1.0, "global grad-norm clip; 0 = off", ge=0)
    seed: int = key(0, "fixes the initial weights and the global sample order")
    dtype: str = key("float32", "compute dtype (fp32 master weights); float16 adds dynamic loss "
                                "scaling, for GPUs without bf16; float64 keeps weights, optimizer state "
                                "and reductions in fp64 (exact comparisons)", choices=DTYPES)
    loss_scale_initial: float = key(65536.0, "float16: the dynamic loss scale's first value", gt=0)
    loss_scale_window: int = key(2000, "float16: overflow-free steps in a row before the loss scale doubles "
                                       "(an overflow halves it and skips the step)", ge=1)
    loss_scale_min: float = key(1.0, "float16: the loss scale's floor; gradients that still overflow there "
                                     "make a bad step (train.max_bad_steps), as a non-finite loss does", gt=0)
    activation_checkpointing: bool = key(False, "recompute each block's activations in backward")
    compile: bool = key(False, "torch.compile each transformer block (kernel fusion)")
    max_bad_steps: int = key(3, "a step whose loss or grad norm is not finite is skipped; this many in a "
                                "row roll back to the newest checkpoint and go on past those batches", ge=1)
    grad_reduce: str = key("float32", "dtype of the data-parallel gradient reduction (FSDP2 "
                                      "reduce_dtype); bfloat16 halves its bytes", choices=GRAD_REDUCE)
    grad_compression: str = key("none", "powersgd: low-rank compressed gradient all-reduce (torch's "
                                        "DDP PowerSGD hook; needs mesh.zero=0); int8 / int4: blockwise "
                                        "quantized all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1..3), "
                                        "quantize -> all-to-all -> dequantize-reduce as ZeRO++'s qgZ; "
                                        "error feedback reset on every resize", choices=GRAD_COMPRESSION)
    powersgd_rank: int = key(2, "PowerSGD matrix approximation rank", ge=1)
    powersgd_plain_steps: int = key(2, "steps of each generation all-reduced uncompressed before "
                                       "PowerSGD starts (torch's start_powerSGD_iter; it suggests ~10% "
                                       "of the run)", ge=2)
    quant_block: int = key(128, "int8/int4 gradient compression: values per fp32 scale (blockwise absmax); "
                                "even for int4", ge=2)
    optimizer: str = key("adamw", 'adamw, or "onebit_adam": DeepSpeed\'s 1-bit Adam (Adam for '
                                  "onebit_warmup_steps, then frozen variance and 1-bit compressed momentum "
                                  "with error feedback; needs mesh.zero=0 and grad_compression=\"none\")",
                         choices=OPTIMIZERS)
    onebit_warmup_steps: int = key(100, "onebit_adam: uncompressed Adam steps before the variance freezes "
                                        "(DeepSpeed's freeze_step; it suggests 15-25% of the run); below "
                                        "train.steps", ge=1)


@dataclass(**_SECTION)
class PipelineConfig:
    schedule: str = key("1f1b", "pipeline schedule; zb-h1 and zbv split each backward into input and "
                                "weight gradients (zero bubble, Qi et al. 2024)", choices=SCHEDULES)
    virtual_stages: int = key(1, "model chunks per pp rank; >= 2 for interleaved_1f1b, 2 for zbv (its V), "
                                 "else 1", ge=1)
    # TOML has no null, so an empty list also means "balanced".
    layers: tuple[int, ...] | None = key(None, "layers per stage in stage order (pp * virtual_stages "
                                               "entries); empty = balanced by parameter count")


@dataclass(**_SECTION)
class DataConfig:
    path: str = key("builtin", '"builtin" (shipped corpus, byte tokens) or a Parquet shard directory: a '
                               'path or a URI (file://, s3://, gs://, any fsspec scheme)')
    mask_document_boundaries: str | bool = key(
        "auto", "do not count a target whose input is EOS (no predicting a document from the previous "
                'one); "auto" = on when the shards record an EOS id', choices=(True, False, "auto"))
    # TOML: mix = [{path = "s3://web/", weight = 0.7}, {path = "code/", weight = 0.3}]
    mix: tuple[tuple[str, float], ...] | None = key(
        None, "a mixture instead of data.path: sources (each like data.path) with weights > 0; every step "
              "holds each in proportion, each source is read once per pass in its own seeded order")


@dataclass(**_SECTION)
class EvalConfig:
    path: str = key("", "held-out data (a shard directory or URI, like data.path); empty = no evaluation")
    every: int = key(0, "evaluate after every N steps and after the last; 0 = after the last step only", ge=0)
    batches: int = key(4, "held-out batches of train.global_batch_size windows: samples [0, batches * "
                          "global_batch_size) of eval.path in order, the same on any mesh", ge=1)
    mix: tuple[tuple[str, float], ...] | None = key(
        None, "held-out mixture instead of eval.path (like data.mix): each batch holds the sources in "
              "proportion, each read in file order")


@dataclass(**_SECTION)
class CheckpointConfig:
    dir: str = key("", "where checkpoints go (a path or a URI); empty = checkpoints off")
    every: int = key(0, "save every N steps and after the last step; 0 = after the last step only (with dir set)", ge=0)
    async_write: bool = key(True, "write in the background while training goes on", toml="async")
    when_busy: str = key("wait", "a save due while the previous one still writes (storage slower than `every` "
                                 "steps): 'wait' stalls training until that one committed (every periodic save is "
                                 "made); 'defer' trains on and starts it at the first step after the commit (event "
                                 "checkpoint_deferred): fewer saves, no stall", choices=("wait", "defer"))
    keep: int = key(3, "keep the last K committed checkpoints", ge=1)
    resume: bool = key(True, "resume from the newest committed checkpoint in dir")
    init_from: str = key("", "Hugging Face safetensors directory loaded at step 0 when dir has nothing to resume")
    memory_every: int = key(1, "with dir set: every N steps each rank also snapshots its shard into a peer's "
                               "memory, and a failure resumes from there (at most N steps lost); 0 = off", ge=0)
    memory_keep: int = key(3, "in-memory snapshots each rank keeps of its own shard and of the peer's it holds: "
                              "the newest complete set and the memory_keep - 1 newest after it (host memory per rank: "
                              "`elastimesh plan`; launch refuses a mesh whose copies exceed a node's memory); "
                              "fewer copies may re-run a few more steps after a failure",
                           ge=2)
    lease_s: float = key(60.0, "with dir set: the driver holds a run lease on dir (LEASE.json, renewed every "
                               "lease_s / 6): a second driver on dir exits 2; a dead driver's lease is taken "
                               "over lease_s after its last renewal", gt=0)


@dataclass(**_SECTION)
class ElasticConfig:
    min_dp: int = key(1, "fail rather than shrink below this many replicas", ge=1)
    max_dp: int = key(0, "grow no higher than this; 0 = mesh.dp", ge=0)
    collective_timeout_s: float = key(60.0, "process-group timeout: bounds a blocked collective", gt=0)
    step_timeout_s: float = key(120.0, "a step in which no rank progressed (finished an action of the "
                                       "schedule or a phase of the update) for this long counts as a "
                                       "hang (seconds compiling not counted); also how often a "
                                       "checkpoint's ranks are probed while they stage and write it (live "
                                       "ones are waited for: a slow save is not a failure)", gt=0)
    hang_probe_factor: float = key(0.5, "once a step ran this many times the recent median step (at least "
                                        "1 s), probe the ranks still in it, and again at that interval: "
                                        "a rank answering no probe is hung (a live but slow step is never "
                                        "cut short); 0 = wait for step_timeout_s alone", ge=0)
    max_restarts: int = key(3, "rebuilds after failures allowed before the job fails", ge=0)
    rebuild_timeout_s: float = key(120.0, "how often a forming generation's members (join, checkpoint or "
                                          "snapshot load) are probed while they work: members that answer "
                                          "are waited for however long it takes, silent ones fail it", gt=0)
    grow_check_s: float = key(5.0, "how often to look for capacity to grow back", gt=0)
    drain_poll_s: float = key(1.0, "how often to look for drain (preemption) notices of the job's nodes; "
                                   "0 = ignore them", ge=0)
    spares: int = key(0, "warm spare actors kept beside the mesh (on other nodes where possible), started once "
                         "the first step trained: a failed rank is replaced by one without shrinking dp, and a "
                         "new spare is requested", ge=0)
    straggler_factor: float = key(2.0, "a rank whose compute time exceeds this many times its peers' "
                                       "median is slow", gt=1)
    straggler_steps: int = key(5, "consecutive slow steps before a rank is reported as a straggler", ge=1)
    evict_stragglers: bool = key(False, "swap a reported straggler for a spare (or drop it) at the next "
                                        "step boundary")
    rebalance: bool = key(False, "give each data-parallel replica a share of the step's microbatches "
                                 "proportional to its measured speed, re-decided at step boundaries; "
                                 "same global batch, same math; needs mesh.dp >= 2 (with zero=3 the "
                                 "parameters stay gathered through the step, as zero=2)")


@dataclass(**_SECTION)
class MetricsConfig:
    path: str = key("metrics.jsonl", "JSONL metrics file")
    tensorboard_dir: str = key("", "TensorBoard log directory; empty = none")
    timeline: str = key("", "Chrome-trace timeline file of the latest step; empty = none")
    log_every: int = key(1, "log a step record every N steps", ge=1)
    # Checked against train.steps in config_validate.profile_range; traces: workers/profiling.py.
    profile_steps: str = key("", 'torch.profiler trace of steps "A:B" (1 <= A <= B <= train.steps) '
                                 "on every rank, one file per rank and step; empty = off")
    profile_dir: str = key("", "where the profiler traces go; empty = profiles/ beside metrics.path")
    # Experiment trackers (orchestrator/tracking/): optional extras, written from the driver only.
    mlflow_uri: str = key("", "MLflow tracking URI (a directory, file://, http(s)://, databricks): the "
                              "config as params, steps and events as metrics; empty = off "
                              "(pip install 'elastimesh[mlflow]')")
    mlflow_experiment: str = key("elastimesh", "MLflow experiment the run goes into")
    wandb_project: str = key("", "Weights & Biases project: the config, steps and events; files under "
                                 "wandb/ beside metrics.path; empty = off (pip install 'elastimesh[wandb]')")
    wandb_mode: str = key("online", 'W&B mode: "offline" writes the run only locally (`wandb sync` '
                                    "uploads it later)", choices=("online", "offline"))


@dataclass(**_SECTION)
class ResourcesConfig:
    use_gpu: str | bool = key("auto", '"auto" uses GPUs when the cluster has them',
                              choices=(True, False, "auto"))
    cpus_per_worker: float = key(1.0, "CPUs reserved per rank actor", gt=0)
    placement_timeout_s: float = key(60.0, "bound on placing the rank actors", gt=0)
    connect_timeout_s: float = key(30.0, "bound on joining the Ray cluster at RAY_ADDRESS (ray.init itself retries "
                                         "an address that accepts but never answers for minutes)", gt=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


# Section name -> dataclass, in JobConfig order (the JobConfig field names are the section names).
SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(JobConfig)  # type: ignore[misc]
}

# section -> {toml key -> dataclass field}
FIELDS: dict[str, dict[str, dataclasses.Field[Any]]] = {name: {} for name in SECTIONS}
for _section, _name, _field in iter_keys(SECTIONS):
    FIELDS[_section][_name] = _field

ALL_KEYS: list[str] = [f"{section}.{key}" for section, keys in FIELDS.items() for key in keys]


def config_doc() -> str:
    """The Markdown table of every config key (README's "Config keys" section is this, verbatim)."""
    return doc_table(SECTIONS)


# --- derived views -------------------------------------------------------------------------


def replace_mesh(cfg: JobConfig, **changes: int) -> JobConfig:
    """Return `cfg` with mesh fields replaced, e.g. `replace_mesh(cfg, dp=3)`; not re-validated."""
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **changes))


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as {section: {toml_key: value}}, JSON/TOML-ready.

    Tuples become lists (a mixture a list of {path, weight} tables); None values are left out (TOML
    has no null, and a missing key loads as its default), so `load_config` of this dict written as
    TOML gives back `cfg`.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        out[name] = {}
        for key, f in FIELDS[name].items():
            value = getattr(section, f.name)
            if value is not None:
                out[name][key] = plain_value(f, value)
    return out


def microbatches_per_replica(train: TrainConfig, dp: int) -> int:
    """Number of microbatches each DP replica runs per step.

    Args:
        train: the train section (global and micro batch sizes).
        dp: data-parallel degree of the mesh in question.

    Returns:
        ``global_batch_size // (dp * micro_batch_size)``; exact only when ``check_mesh`` passes.
    """
    return train.global_batch_size // (dp * train.micro_batch_size)


def dp_bounds(mesh: MeshConfig, elastic: ElasticConfig) -> tuple[int, int]:
    """The (min, max) data-parallel degree the elastic controller may use.

    ``elastic.max_dp = 0`` means "never grow past the configured mesh.dp".
    """
    return elastic.min_dp, elastic.max_dp or mesh.dp
