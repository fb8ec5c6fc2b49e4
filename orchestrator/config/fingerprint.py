"""Which config keys a checkpoint depends on: the model fingerprint and the diff that names them.

Kept apart from the config schema and loader (meshspeak.sections, orchestrator.config.load): this changes when the rules for
resuming a checkpoint change, not when a key is added. The input is the [model] section; everything
else (mesh, batch split, timeouts) may differ between save and resume. The data is checked by content,
not by ``data.path`` (the manifest's ``data_identity``, orchestrator/saves/checkpointing.py), so a moved
corpus resumes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from meshspeak.sections import JobConfig, config_to_dict


def _fingerprint_view(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": dict(d.get("model", {}))}


def model_fingerprint(cfg: JobConfig) -> str:
    """sha256 hex of the model section, used to refuse an alien checkpoint."""
    view = _fingerprint_view(config_to_dict(cfg))
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def model_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Keys ("model.d_model", ...) whose values differ between two config dicts.

    Args:
        a, b: dicts shaped like `config_to_dict` output (e.g. one read from a manifest).

    Returns:
        Sorted "model.x" keys that differ or exist on one side only: exactly the inputs of
        `model_fingerprint`.
    """
    va, vb = _fingerprint_view(a), _fingerprint_view(b)
    keys = sorted(set(va["model"]) | set(vb["model"]))
    return [f"model.{k}" for k in keys if va["model"].get(k) != vb["model"].get(k)]
