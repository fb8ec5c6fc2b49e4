"""``manifest.json``: the driver's commit record and description of one checkpoint (pure; no torch).

The driver writes it last, after every rank acknowledged its shard (see :func:`catalog.commit`), so
its presence is what makes a step directory a checkpoint. It records what a resume needs to know
before touching any tensor: the step, the data position, the mesh and pipeline layout that saved
it, which model it belongs to, and the sizes the DCP files must have, which lets the driver validate
a checkpoint without importing torch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from checkpoints.errors import ManifestError

FORMAT_VERSION = 2  # 2: DCP files in an attempt subdirectory (dcp_dir)
_AXES = ("dp", "pp", "tp")


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    """What one committed checkpoint holds. Construct with keywords; invalid values raise ManifestError."""

    step: int
    """Optimizer steps completed when the state was captured (training resumes at step + 1)."""
    generation: int
    """Elastic generation of the mesh that saved it (bumped on every rebuild)."""
    mesh: dict[str, int]
    """Degrees of the saving mesh: ``{"dp": d, "pp": p, "tp": t}``."""
    model_fingerprint: str
    """Hash of the model config: a resume refuses a checkpoint whose fingerprint differs."""
    data_cursor: int
    """Samples of the global order consumed so far (``step * global_batch_size``)."""
    global_batch_size: int
    world_size: int
    ranks_acked: list[int]
    """World ranks that reported their shard durably written; all of them for a commit."""
    schedule: str = ""
    """Pipeline schedule name of the saving run (informational; the loader may use another)."""
    stage_layers: list[list[int]] = field(default_factory=list)
    """Model layer indices held by each pipeline stage (virtual stages included), in stage order."""
    model_config: dict[str, Any] = field(default_factory=dict)
    data_identity: str = ""
    """Content identity of the training data (``meshdata`` source identity: the sidecar's hash),
    not its path: resuming onto moved data is fine, onto other data is refused. "" = not recorded."""
    files: dict[str, int] = field(default_factory=dict)
    """Minimum byte size of each DCP file, relative to the DCP directory (``dcp_dir``); lets the driver
    detect a missing or truncated shard without reading DCP's (pickled, torch-typed) ``.metadata``."""
    dcp_dir: str = ""
    """The subdirectory of the step directory that holds the DCP files of the save attempt that
    committed (e.g. ``g3``, the generation that wrote them): a write abandoned by an earlier attempt
    of the same step can only land in its own subdirectory, never in this one. "" (format 1): the
    step directory itself."""
    created_at: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION
    run_id: str = ""
    """The run that committed it (kept across resumes of that run). A run purges, replaces and resumes
    after a failure only its own checkpoints; empty in manifests written before runs had ids."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps up to ``step`` skipped as bad (loss or grad norm not finite): a resume skips them again
    rather than train their batches (orchestrator/recovery/bad_steps.py)."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def mesh_str(self) -> str:
        return " ".join(f"{axis}={self.mesh[axis]}" for axis in _AXES)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: Any, path: str | None = None) -> CheckpointManifest:
        """Build from parsed JSON. Unknown keys are ignored (written by a newer minor version).

        Raises:
            ManifestError: not an object, a required key missing, a wrong type or value, or a
                format_version this code cannot read.
        """
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(data).__name__}", path)
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ManifestError("manifest has no integer format_version", path)
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"manifest format_version {version} is newer than this elastimesh reads "
                f"({FORMAT_VERSION}); upgrade elastimesh to load it",
                path,
            )
        required = ("step", "generation", "mesh", "model_fingerprint", "data_cursor",
                    "global_batch_size", "world_size", "ranks_acked", "created_at")
        missing = [k for k in required if k not in data]
        if missing:
            raise ManifestError(f"manifest is missing {', '.join(missing)}", path)
        names = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except ManifestError as e:
            raise ManifestError(e.message, path) from None
        except TypeError as e:  # a field of the wrong kind slipped past the checks
            raise ManifestError(f"manifest fields are malformed: {e}", path) from None

    @classmethod
    def from_json(cls, text: str, path: str | None = None) -> CheckpointManifest:
        """Parse ``manifest.json`` text.

        Raises:
            ManifestError: the text is not JSON or does not describe a valid manifest.
        """
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"manifest is not valid JSON ({e}); the file is damaged", path) from None
        return cls.from_dict(data, path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(message: str) -> None:
    raise ManifestError(f"invalid manifest: {message}")


def _validate(m: CheckpointManifest) -> None:
    for name in ("step", "generation", "data_cursor", "world_size", "global_batch_size", "format_version"):
        value = getattr(m, name)
        if not _is_int(value) or value < 0:
            _fail(f"{name} must be a non-negative int, got {value!r}")
    if m.global_batch_size < 1 or m.world_size < 1:
        _fail("global_batch_size and world_size must be >= 1")
    if not isinstance(m.mesh, dict) or set(m.mesh) != set(_AXES):
        _fail(f"mesh must be an object with exactly dp, pp, tp, got {m.mesh!r}")
    if not all(_is_int(m.mesh[a]) and m.mesh[a] >= 1 for a in _AXES):
        _fail(f"mesh degrees must be ints >= 1, got {m.mesh!r}")
    if math.prod(m.mesh[a] for a in _AXES) != m.world_size:
        _fail(f"world_size {m.world_size} != dp*pp*tp of mesh {m.mesh!r}")
    if not isinstance(m.dcp_dir, str) or m.dcp_dir in (".", "..") or "/" in m.dcp_dir or "\\" in m.dcp_dir:
        _fail(f"dcp_dir must be a plain subdirectory name of the step directory, got {m.dcp_dir!r}")
    if not all(isinstance(v, str) for v in (m.model_fingerprint, m.schedule, m.run_id)):
        _fail("model_fingerprint, schedule and run_id must be strings")
    if not isinstance(m.data_identity, str):
        _fail("data_identity must be a string")
    if not isinstance(m.model_config, dict):
        _fail("model_config must be an object")
    acked = m.ranks_acked
    if not isinstance(acked, list) or not all(_is_int(r) and 0 <= r < m.world_size for r in acked):
        _fail(f"ranks_acked must be a list of ranks in [0, {m.world_size}), got {acked!r}")
    if len(set(acked)) != len(acked):
        _fail(f"ranks_acked has duplicates: {acked!r}")
    skipped = m.skipped_steps
    if not isinstance(skipped, list) or not all(_is_int(s) and 1 <= s <= m.step for s in skipped):
        _fail(f"skipped_steps must be a list of steps in [1, {m.step}], got {skipped!r}")
    layers = m.stage_layers
    if not isinstance(layers, list) or not all(
        isinstance(s, list) and all(_is_int(i) and i >= 0 for i in s) for s in layers
    ):
        _fail("stage_layers must be a list of lists of layer indices")
    if layers and len(layers) % m.mesh["pp"] != 0:
        _fail(f"{len(layers)} stages cannot be spread over pp={m.mesh['pp']}")
    if not isinstance(m.files, dict) or not all(
        isinstance(k, str) and k not in ("", ".", "..") and "/" not in k and _is_int(v) and v >= 0
        for k, v in m.files.items()
    ):
        _fail("files must map relative file names to byte sizes")
    if not isinstance(m.created_at, (int, float)) or isinstance(m.created_at, bool) or not math.isfinite(m.created_at):
        _fail(f"created_at must be a unix time, got {m.created_at!r}")
