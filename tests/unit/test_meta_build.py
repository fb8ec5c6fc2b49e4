"""Big models build small: a stage is built on the meta device and only what ``parallelize`` leaves on
this rank is ever allocated (meshmodels/build.py). No processes: the "sharding" here keeps 1/8
of every parameter's rows, as an 8-way dp shard would, and the host memory growth is measured."""

from __future__ import annotations

import psutil
import torch
from torch import nn

from meshmodels.build import build_local_stage
from meshmodels.family import resolve_model
from orchestrator.config.load import load_config

SHARDS = 8


def _keep_an_eighth(module: nn.Module) -> nn.Module:
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            assert param.device.type == "meta", "the stage was materialised before it was sharded"
            rows = max(1, param.shape[0] // SHARDS)
            sub.register_parameter(name, nn.Parameter(torch.empty((rows, *param.shape[1:]), device="meta")))
    return module


def test_build_allocates_only_the_local_shard():
    cfg = load_config(None, ["model.d_model=1024", "model.n_heads=8", "model.n_layers=8", "model.vocab_size=4096",
                             "mesh.tp=1"])
    resolved = resolve_model(cfg.model)
    with torch.device("meta"):
        whole = resolved.family.build_stage(resolved.shape, range(8))
    full_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())  # ~0.5 GB
    process = psutil.Process()
    before = process.memory_info().rss
    stage = build_local_stage(resolved.family, resolved.shape, range(8), device=torch.device("cpu"), seed=0,
                              parallelize=_keep_an_eighth)
    grown = process.memory_info().rss - before
    local = sum(p.numel() * p.element_size() for p in stage.parameters())
    assert local < full_bytes / SHARDS * 1.2
    # The whole stage would add its full size; building it sharded adds about its shard.
    assert grown < 2 * local + 32 * 2**20, (grown, local)
    assert all(p.device.type == "cpu" for p in stage.parameters())
