"""The driver's job configuration: loading a TOML file with ``--set`` overrides (``load``), the rules
between keys (``validate``) and the model fingerprint that decides whether a checkpoint can be resumed
(``fingerprint``).

The sections themselves, which the ranks receive too, are declared in ``meshspeak.sections``; this
package re-exports what a caller of the loader needs, so ``from orchestrator.config import *`` gives
the loader and the config types together.
"""

from meshspeak.schema import ConfigError
from meshspeak.sections import (
    ALL_KEYS,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    ElasticConfig,
    EvalConfig,
    JobConfig,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    PipelineConfig,
    ResourcesConfig,
    TrainConfig,
    config_doc,
    config_to_dict,
    dp_bounds,
    microbatches_per_replica,
    replace_mesh,
)
from orchestrator.config.load import load_config
from orchestrator.config.validate import check_mesh

__all__ = [
    "ALL_KEYS", "CheckpointConfig", "ConfigError", "DataConfig", "ElasticConfig", "EvalConfig", "JobConfig",
    "MeshConfig", "MetricsConfig", "ModelConfig", "PipelineConfig", "ResourcesConfig", "SECTIONS",
    "TrainConfig", "check_mesh", "config_doc", "config_to_dict", "dp_bounds", "load_config",
    "microbatches_per_replica", "replace_mesh",
]  # fmt: skip
