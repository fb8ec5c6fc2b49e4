"""Which config keys a checkpoint depends on: the model fingerprint and the diff that names them.

Kept apart from the config schema and loader (orchestrator.config): this changes when the rules for
resuming a checkpoint change, not when a key is added. The inputs are the [model] section and
data.path; everything else (mesh, batch split, timeouts) may differ between save and resume.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from orchestrator.config import JobConfig, config_to_dict


def _fingerprint_view(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": dict(d.get("model", {})), "data.path": d.get("data", {}).get("path")}


def model_fingerprint(cfg: JobConfig) -> str:
    """sha256 hex of the model section plus data.path, used to refuse an alien checkpoint."""
    view = _fingerprint_view(config_to_dict(cfg))
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def model_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Keys ("model.d_model", and "data.path") whose values differ between two config dicts.

    Args:
        a, b: dicts shaped like `config_to_dict` output (e.g. one read from a manifest).

    Returns:
        Sorted "model.x" keys that differ or exist on one side only, then "data.path" if it
        differs: exactly the inputs of `model_fingerprint`.
    """
    va, vb = _fingerprint_view(a), _fingerprint_view(b)
    keys = sorted(set(va["model"]) | set(vb["model"]))
    diff = [f"model.{k}" for k in keys if va["model"].get(k) != vb["model"].get(k)]
    if va["data.path"] != vb["data.path"]:
        diff.append("data.path")
    return diff
