"""`--deepspeed ds_config.json`: a DeepSpeed config read as elastimesh config keys.

``read_deepspeed(path, dp)`` returns ``{section: {key: value}}`` (what a TOML file would hold) with,
for each key, the DeepSpeed field it came from, and one warning line for every field that has no
counterpart here (never dropped silently). ``orchestrator.config.load`` merges it under the TOML and
``--set``, refusing a contradiction with them (exit 2). The mapping (README, "DeepSpeed configs"):

* batch: ``train_batch_size`` -> ``train.global_batch_size``, ``train_micro_batch_size_per_gpu`` ->
  ``train.micro_batch_size``; ``gradient_accumulation_steps`` is ours derived (global / (dp x micro)).
  Missing ones follow DeepSpeed's triangle rule (``DeepSpeedConfig._set_batch_related_parameters``)
  with DeepSpeed's world size = ``mesh.dp``; all three given must satisfy train = micro x accum x dp.
* ``"auto"``: DeepSpeed drops an "auto" field of its pydantic sections (``DeepSpeedConfigModel``),
  so the field's DeepSpeed default applies; for top-level fields (batch sizes, clipping, optimizer and
  scheduler params) "auto" is what the Hugging Face integration fills from its own arguments: here,
  from the TOML, ``--set`` or our default (the field is taken as absent).
* ``gradient_clipping`` -> ``train.grad_clip``; ``zero_optimization.stage`` -> ``mesh.zero`` (the legacy
  ``"zero_optimization": true`` is stage 1, as in DeepSpeed); ``offload_optimizer`` / ``offload_param``
  with ``device: "cpu"`` at stage 3 -> ``mesh.cpu_offload``; ``bf16`` / ``fp16`` -> ``train.dtype``
  (+ ``initial_scale_power`` -> ``train.loss_scale_initial``, ``loss_scale_window``); ``optimizer``
  Adam/AdamW -> ``train.lr``, ``beta1/2``, ``weight_decay``; ``scheduler`` WarmupLR / WarmupDecayLR /
  WarmupCosineLR -> ``train.warmup_steps``, ``lr``, ``lr_decay``, ``min_lr_ratio``, ``steps``;
  ``activation_checkpointing`` and ``pipeline.activation_checkpoint_interval`` ->
  ``train.activation_checkpointing``; ``pipeline.stages`` -> ``mesh.pp``; ``communication_data_type``
  -> ``train.grad_reduce``; ``steps_per_print`` -> ``metrics.log_every``; ``tensorboard`` / ``wandb``
  -> ``metrics.tensorboard_dir`` / ``metrics.wandb_project``.
* An optimizer or scheduler type with no counterpart changes the math: bad input, not a warning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from meshspeak.schema import ConfigError

AUTO = "auto"
ADAM_EPS = 1e-8  # workers/optim.py's AdamW eps
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
# Fields with no counterpart, and why (the warning says so); others get a generic reason.
WHY = {
    "zero_optimization.overlap_comm": "FSDP2 overlaps its collectives with compute by itself",
    "zero_optimization.contiguous_gradients": "FSDP2 keeps each unit's gradient shard contiguous by itself",
    "zero_optimization.reduce_bucket_size": "FSDP2 reduces per unit: set mesh.fsdp_unit_mb",
    "zero_optimization.allgather_bucket_size": "FSDP2 gathers per unit: set mesh.fsdp_unit_mb",
    "zero_optimization.stage3_prefetch_bucket_size": "FSDP2 prefetches the next unit: set mesh.fsdp_unit_mb",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "`elastimesh export` writes the model",
    "wall_clock_breakdown": "step timings are always in the metrics",
    "elasticity": "see the elastic.* keys",
}


def _where(dotted: str) -> str:
    return dotted or "the top level"


class DSReader:
    """Walks one DeepSpeed config; ``out`` and ``origin`` fill as fields are mapped, ``warnings`` as
    fields are found without a counterpart. Every field read is marked used; what remains unread at
    the end gets a warning too."""

    def __init__(self, path: str, doc: dict, dp: int, ours: Callable[[str], Any]) -> None:
        self.path, self.doc, self.dp, self.ours = path, doc, dp, ours
        self.out: dict[str, dict[str, Any]] = {}
        self.origin: dict[str, str] = {}  # "train.lr" -> "optimizer.params.lr"
        self.warnings: list[str] = []
        self.used: set[str] = set()

    # -- reading fields ---------------------------------------------------------------------------
    def raw(self, dotted: str) -> Any:
        node: Any = self.doc
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        self.used.add(dotted)
        return node

    def get(self, dotted: str, kind: str, *, auto: bool = True) -> Any:
        """The field's value checked against ``kind`` (int, number, bool, str, dict, list); None when
        absent or "auto" (``auto``: allowed); a wrong type is bad input naming the field."""
        value = self.raw(dotted)
        if value is None or (auto and value == AUTO):
            return None
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str),
              "dict": isinstance(value, dict), "list": isinstance(value, list)}[kind]
        if not ok:
            shown = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
                     "dict": "an object", "list": "a list"}[kind]
            extra = ' or "auto"' if auto else ""
            raise ConfigError(dotted, f"{self.path}: {dotted}: expected {shown}{extra}, got {value!r} "
                                      f"({type(value).__name__})")
        return value

    def put(self, key: str, value: Any, source: str) -> None:
        """Map to our ``key``; two DeepSpeed fields that disagree on one key are a contradiction."""
        section, name = key.split(".")
        if key in self.origin and self.out[section][name] != value:
            raise ConfigError(key, f"{self.path}: {source}={value!r} and {self.origin[key]}="
                                   f"{self.out[section][name]!r} disagree on {key}: make them agree")
        self.out.setdefault(section, {})[name] = value
        self.origin[key] = source

    def warn(self, dotted: str, why: str = "") -> None:
        self.used.add(dotted)
        reason = why or WHY.get(dotted, "elastimesh has no counterpart")
        self.warnings.append(f"{self.path}: {_where(dotted)} has no counterpart here ({reason}): ignored")

    def skip(self, prefix: str) -> None:
        """A disabled section (``"enabled": false``): its other fields do nothing in DeepSpeed either."""
        node = self.raw(prefix)
        self.used.update(self.leaves(node, prefix) if isinstance(node, dict) else [prefix])

    def leaves(self, node: Any = None, prefix: str = "") -> list[str]:
        node = self.doc if node is None else node
        if not isinstance(node, dict) or not node:
            return [prefix] if prefix else []
        out = []
        for k, v in node.items():
            out += self.leaves(v, f"{prefix}.{k}" if prefix else k)
        return out


# -- the sections ----------------------------------------------------------------------------------


def _batch(r: DSReader) -> None:
    tb = r.get("train_batch_size", "int")
    micro = r.get("train_micro_batch_size_per_gpu", "int")
    accum = r.get("gradient_accumulation_steps", "int")
    dp = r.dp
    for name, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accum)):
        if value is not None and value < 1:
            raise ConfigError(name, f"{r.path}: {name}={value}: must be >= 1")
    if tb is not None and micro is not None and accum is not None and tb != micro * accum * dp:
        raise ConfigError("train_batch_size", f"{r.path}: train_batch_size={tb} != train_micro_batch_size_per_gpu="
                                              f"{micro} x gradient_accumulation_steps={accum} x world size "
                                              f"(mesh.dp={dp}): fix one of them or mesh.dp")
    if tb is not None and micro is None:  # DeepSpeed: micro = train // world // accum (accum 1 if absent)
        micro = tb // dp // (accum or 1)
    if tb is None and micro is not None:
        tb = micro * (accum or 1) * dp
    if tb is None and micro is None and accum is not None:  # the TOML's micro batch, DeepSpeed's rule
        micro = r.ours("train.micro_batch_size")
        tb = micro * accum * dp
        r.put("train.global_batch_size", tb, "gradient_accumulation_steps")
        return
    if tb is not None:
        r.put("train.global_batch_size", tb, "train_batch_size")
    if micro is not None:
        r.put("train.micro_batch_size", micro, "train_micro_batch_size_per_gpu")


def _zero(r: DSReader) -> None:
    zero = r.raw("zero_optimization")
    if zero is None:
        return
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true is stage 1
        r.put("mesh.zero", 1 if zero else 0, "zero_optimization")
        return
    r.get("zero_optimization", "dict", auto=False)
    stage = r.raw("zero_optimization.stage")
    stage = 0 if stage == AUTO else r.get("zero_optimization.stage", "int")  # pydantic drops "auto": default 0
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise ConfigError("zero_optimization.stage", f"{r.path}: zero_optimization.stage={stage}: use 0, 1, 2 or 3")
        r.put("mesh.zero", stage, "zero_optimization.stage")
    for part in ("offload_optimizer", "offload_param"):
        field = f"zero_optimization.{part}"
        if r.raw(field) is None:
            continue
        r.get(field, "dict", auto=False)
        device = r.get(f"{field}.device", "str") or "none"
        if device == "cpu" and (stage or 0) == 3:
            r.put("mesh.cpu_offload", True, f"{field}.device")
        elif device == "cpu":
            r.warn(f"{field}.device", "mesh.cpu_offload offloads with ZeRO-3 only")
        elif device != "none":
            r.warn(f"{field}.device", f"{device} offload: only the host (cpu) is")
        for sub in r.doc["zero_optimization"][part]:
            if sub != "device":
                r.warn(f"{field}.{sub}")
    if r.get("zero_optimization.cpu_offload", "bool"):  # deprecated DeepSpeed spelling
        r.put("mesh.cpu_offload", True, "zero_optimization.cpu_offload")


def _precision(r: DSReader) -> None:
    bf16 = r.get("bf16.enabled", "bool") or r.get("bfloat16.enabled", "bool")
    fp16 = r.get("fp16.enabled", "bool")
    if bf16 and fp16:
        raise ConfigError("fp16.enabled", f"{r.path}: bf16.enabled and fp16.enabled are both true: enable one")
    for name, on in (("bf16", bf16), ("bfloat16", bf16), ("fp16", fp16)):
        if not on and r.raw(name) is not None:
            r.skip(name)
    if bf16:
        r.put("train.dtype", "bfloat16", "bf16.enabled")
    if not fp16:
        return
    r.put("train.dtype", "float16", "fp16.enabled")
    scale = r.get("fp16.loss_scale", "number")
    if scale:  # 0 (the default) is dynamic scaling, as here
        r.warn("fp16.loss_scale", "the loss scale is dynamic here (0)")
    power = r.get("fp16.initial_scale_power", "int")
    r.put("train.loss_scale_initial", float(2 ** (16 if power is None else power)), "fp16.initial_scale_power")
    window = r.get("fp16.loss_scale_window", "int")
    r.put("train.loss_scale_window", 1000 if window is None else window, "fp16.loss_scale_window")
    floor = r.get("fp16.min_loss_scale", "number")
    if floor is not None:  # DeepSpeed's default floor (1) is ours
        r.put("train.loss_scale_min", float(floor), "fp16.min_loss_scale")
    if r.get("fp16.hysteresis", "int") not in (None, 1):
        r.warn("fp16.hysteresis", "every overflow halves the scale here, as hysteresis=1")


def _optimizer(r: DSReader) -> None:
    if r.raw("optimizer") is None:
        return
    kind = r.get("optimizer.type", "str", auto=False) or ""
    params = r.get("optimizer.params", "dict") or {}
    adam_w = r.get("optimizer.params.adam_w_mode", "bool")
    if kind.lower() not in ("adam", "adamw", "fusedadam"):
        raise ConfigError("optimizer.type", f"{r.path}: optimizer.type={kind!r}: only Adam/AdamW have a "
                                            "counterpart here (AdamW): use AdamW or remove the optimizer")
    if kind.lower() != "adamw" and adam_w is False and (params.get("weight_decay") or 0) != 0:
        raise ConfigError("optimizer.params.adam_w_mode", f"{r.path}: optimizer Adam with adam_w_mode=false adds "
                                                          "weight decay to the gradient (L2), which AdamW here does "
                                                          "not: set adam_w_mode true or weight_decay 0")
    lr = r.get("optimizer.params.lr", "number")
    if lr is not None:
        r.put("train.lr", float(lr), "optimizer.params.lr")
    betas = r.get("optimizer.params.betas", "list")
    if betas is not None:
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
            raise ConfigError("optimizer.params.betas", f"{r.path}: optimizer.params.betas: expected two numbers, "
                                                        f"got {betas!r}")
        r.put("train.beta1", float(betas[0]), "optimizer.params.betas")
        r.put("train.beta2", float(betas[1]), "optimizer.params.betas")
    wd = r.get("optimizer.params.weight_decay", "number")
    if wd is not None:
        r.put("train.weight_decay", float(wd), "optimizer.params.weight_decay")
    eps = r.get("optimizer.params.eps", "number")
    if eps is not None and eps != ADAM_EPS:
        r.warn("optimizer.params.eps", f"AdamW's eps is {ADAM_EPS:g} here")
    for name in params:
        if name not in ("lr", "betas", "weight_decay", "eps", "adam_w_mode", "torch_adam"):
            r.warn(f"optimizer.params.{name}")
        r.used.add(f"optimizer.params.{name}")


def _warmup(r: DSReader, p: str, *, ratio: bool) -> None:
    """The warm-up fields all three schedulers share (linear from 0 here)."""
    steps = r.get(f"{p}.warmup_num_steps", "int")
    r.put("train.warmup_steps", 1000 if steps is None else steps, f"{p}.warmup_num_steps")  # DeepSpeed's default
    start = r.get(f"{p}.warmup_min_ratio" if ratio else f"{p}.warmup_min_lr", "number")
    if start:
        r.warn(f"{p}.warmup_min_ratio" if ratio else f"{p}.warmup_min_lr", "warm-up starts from 0 here")
    kind = r.get(f"{p}.warmup_type", "str")
    if kind != "linear":  # DeepSpeed's default is a log curve
        r.warnings.append(f"{r.path}: {p}.warmup_type={kind or 'log'}{'' if kind else ' (DeepSpeed default)'} has "
                          "no counterpart here (warm-up is linear): ignored")


def _scheduler(r: DSReader) -> None:
    if r.raw("scheduler") is None:
        return
    kind = r.get("scheduler.type", "str", auto=False) or ""
    if kind not in SCHEDULERS:
        raise ConfigError("scheduler.type", f"{r.path}: scheduler.type={kind!r} has no counterpart here: use "
                                            f"{', '.join(SCHEDULERS)}, or remove the scheduler")
    p = "scheduler.params"
    r.get(p, "dict")
    _warmup(r, p, ratio=kind == "WarmupCosineLR")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        top = r.get(f"{p}.warmup_max_lr", "number")
        top = 0.001 if top is None and kind == "WarmupDecayLR" else top  # DeepSpeed's default there
        if top is not None:  # DeepSpeed: the scheduler's max lr wins over the optimizer's
            before = r.out.get("train", {}).pop("lr", None)
            if r.origin.pop("train.lr", None) and before != float(top):
                r.warnings.append(f"{r.path}: optimizer.params.lr={before:g} is replaced by {p}.warmup_max_lr="
                                  f"{top:g}, as in DeepSpeed")
            r.put("train.lr", float(top), f"{p}.warmup_max_lr")
    if kind == "WarmupLR":
        r.put("train.min_lr_ratio", 1.0, "scheduler.type")  # constant after warm-up
    else:
        total = r.get(f"{p}.total_num_steps", "int")
        if total is not None:
            r.put("train.steps", total, f"{p}.total_num_steps")
        r.put("train.lr_decay", "linear" if kind == "WarmupDecayLR" else "cosine", "scheduler.type")
        floor = 0.0 if kind == "WarmupDecayLR" else r.get(f"{p}.cos_min_ratio", "number")
        r.put("train.min_lr_ratio", float(0.0001 if floor is None else floor),
              f"{p}.cos_min_ratio" if kind == "WarmupCosineLR" else "scheduler.type")
    for name in r.doc["scheduler"].get("params", {}) or {}:
        if f"{p}.{name}" not in r.used:
            r.warn(f"{p}.{name}")


def _checkpointing_and_pipeline(r: DSReader) -> None:
    if r.raw("activation_checkpointing") is not None:  # the model checkpoints its blocks
        r.get("activation_checkpointing", "dict", auto=False)
        r.put("train.activation_checkpointing", True, "activation_checkpointing")
        for name, value in r.doc["activation_checkpointing"].items():
            if value not in (False, None):
                r.warn(f"activation_checkpointing.{name}", "every block's activations are recomputed in its "
                                                           "backward, on the rank that holds them")
            r.used.add(f"activation_checkpointing.{name}")
    if r.raw("pipeline") is None:
        return
    r.get("pipeline", "dict", auto=False)
    stages = r.get("pipeline.stages", "int")
    if stages is not None:
        r.put("mesh.pp", stages, "pipeline.stages")
    interval = r.get("pipeline.activation_checkpoint_interval", "int")
    if interval:
        r.put("train.activation_checkpointing", True, "pipeline.activation_checkpoint_interval")
        if interval != 1:
            r.warn("pipeline.activation_checkpoint_interval", f"every block is checkpointed, not every {interval}th")
    partition = r.get("pipeline.partition", "str")
    if partition not in (None, "parameters"):
        r.warn("pipeline.partition", "stages are balanced by parameter count, or set pipeline.layers")


def _rest(r: DSReader) -> None:
    clip = r.get("gradient_clipping", "number")
    if clip is not None:
        r.put("train.grad_clip", float(clip), "gradient_clipping")
    every = r.get("steps_per_print", "int")
    if every is not None:
        r.put("metrics.log_every", max(1, every), "steps_per_print")
    comm = r.get("communication_data_type", "str")
    if comm is not None:
        dtypes = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
        if comm.lower() in dtypes:
            r.put("train.grad_reduce", dtypes[comm.lower()], "communication_data_type")
        else:
            r.warn("communication_data_type", "gradients reduce in float32 or bfloat16")
    if r.get("tensorboard.enabled", "bool"):
        out = r.get("tensorboard.output_path", "str") or "runs"
        r.put("metrics.tensorboard_dir", os.path.join(out, r.get("tensorboard.job_name", "str") or "DeepSpeedJobName"),
              "tensorboard.output_path")
    elif r.raw("tensorboard") is not None:
        r.skip("tensorboard")
    if r.get("wandb.enabled", "bool"):
        project = r.get("wandb.project", "str") or "deepspeed"
        r.put("metrics.wandb_project", project, "wandb.project")
    elif r.raw("wandb") is not None:
        r.skip("wandb")


def read_deepspeed(path: str, dp: int, ours: Callable[[str], Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str], list[str]]:
    """(``{section: {key: value}}``, key -> the DeepSpeed field it came from, warning lines).

    Args:
        path: the DeepSpeed JSON config.
        dp: ``mesh.dp`` as the TOML and ``--set`` give it: DeepSpeed's data-parallel world size.
        ours: ``"section.key" -> value`` from the TOML / ``--set`` / default (for "auto" fields).
    """
    doc = _load(path)
    r = DSReader(path, doc, dp, ours)
    for part in (_batch, _zero, _precision, _optimizer, _scheduler, _checkpointing_and_pipeline, _rest):
        part(r)
    for leaf in r.leaves():
        if leaf not in r.used:
            r.warn(leaf)
    return r.out, r.origin, r.warnings


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:  # DeepSpeed refuses them too (dict_raise_error_on_duplicate_keys)
        raise ValueError(f"duplicate key {dupes[0]!r}")
    return dict(pairs)


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh, object_pairs_hook=_no_duplicates)
    except FileNotFoundError:
        raise ConfigError(path, f"{path}: no such DeepSpeed config file: check the --deepspeed path") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise ConfigError(path, f"{path}: invalid DeepSpeed JSON: {exc}") from None
    except OSError as exc:
        raise ConfigError(path, f"{path}: cannot read the DeepSpeed config: {exc.strerror or exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(path, f"{path}: a DeepSpeed config is a JSON object, got {type(doc).__name__}")
    return doc
