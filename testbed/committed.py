"""A committed checkpoint of a job's model as the driver leaves one, without training: DCP's
``.metadata`` (bytes the test chooses), one small shard, and the manifest (``checkpoints.catalog.commit``)
with its files map. For the driver's resume decisions (``CheckpointCoordinator.resume_point``)."""

from __future__ import annotations

from pathlib import Path

from checkpoints.catalog import commit
from checkpoints.layout import DCP_METADATA, step_dir_name
from checkpoints.manifest import CheckpointManifest
from meshspeak.sections import config_to_dict
from orchestrator.config.fingerprint import model_fingerprint


def commit_checkpoint(root: Path, cfg, step: int, metadata: bytes, *, run_id: str = "",
                      data_identity: str = "") -> Path:
    """Commit ``step`` under ``root`` for ``cfg``'s model and batch (``run_id``: the run that made it);
    its step directory."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / DCP_METADATA).write_bytes(metadata)
    (path / "__0_0.distcp").write_bytes(b"s" * 20)
    batch = cfg.train.global_batch_size
    commit(str(root), CheckpointManifest(
        step=step, generation=1, mesh={"dp": 1, "pp": 1, "tp": 1}, model_fingerprint=model_fingerprint(cfg),
        data_cursor=step * batch, global_batch_size=batch, world_size=1, ranks_acked=[0],
        model_config=config_to_dict(cfg)["model"], data_identity=data_identity, run_id=run_id,
        files={DCP_METADATA: len(metadata), "__0_0.distcp": 20}))
    return path
