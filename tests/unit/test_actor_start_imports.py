"""A rank actor's start imports what its first join needs (``RankActor.warm``), so that a hot spare's
promotion does not import it on the recovery's critical path, and its objects are frozen with the
rest. FSDP2's ``fully_shard`` imports dynamo (0.7-0.9 s of CPU) although nothing is compiled: an actor
start that left it out made each promoted spare's join that much slower in the chaos campaign. Run in a
fresh interpreter: this one has imported everything long ago."""

from __future__ import annotations

import subprocess
import sys

from testbed.ray_start import free_ports

FIRST_JOIN_AFTER_WARM = """
import os, sys, types
from workers.actor import RankActor
RankActor.warm(types.SimpleNamespace())  # what an actor imports as it starts, before any generation
before = set(sys.modules)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
mesh = init_device_mesh("cpu", (1,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model(torch.randn(2, 8)).sum().backward()
torch.optim.AdamW(model.parameters()).step()
dist.destroy_process_group()
print(sorted(m for m in set(sys.modules) - before if m.startswith(("torch._dynamo", "torch._inductor", "sympy"))))
"""


# What a promoted spare's first join and snapshot load imported before its warm-up did (listed from
# sys.modules around those calls in tests/ray/test_rank_health.py's spare test): the project's lazily
# imported checkpoint modules, the model family's module, and clear_dtensor_caches' import of
# torch.distributed.tensor.debug (torch.distributed._tools, torch.utils.flop_counter; 0.2-0.9 s).
SPARE_FIRST_JOIN_IMPORTS = ("checkpoints.layout", "checkpoints.memory", "checkpoints.snapshot_taker",
                            "checkpoints.staging", "checkpoints.storage", "checkpoints.writer", "meshmodels.gpt",
                            "torch.distributed._tools.fsdp2_mem_tracker", "torch.distributed.tensor.debug",
                            "torch.utils.flop_counter", "torch.utils.module_tracker",
                            "torch.utils.serialization.config")

SPARE_WARM = """
import sys, types
from workers.actor import RankActor
wanted = sys.argv[1].split(",")
RankActor.warm(types.SimpleNamespace())  # the actor's start: a mesh member's too
print(sorted(m for m in wanted if m not in sys.modules))
RankActor.warm(types.SimpleNamespace(), "gpt")  # SparePool.warm: the job's model.family
print(sorted(m for m in wanted if m not in sys.modules))
"""


def test_a_spare_warmed_with_the_family_has_imported_what_its_first_join_and_load_import():
    out = subprocess.run([sys.executable, "-c", SPARE_WARM, ",".join(SPARE_FIRST_JOIN_IMPORTS)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    at_start, with_family = out.stdout.strip().splitlines()[-2:]
    assert "meshmodels.gpt" in at_start and "torch.distributed.tensor.debug" in at_start  # a start stays light
    assert with_family == "[]"


def test_a_first_fsdp2_step_after_the_actor_start_imports_no_dynamo():
    out = subprocess.run([sys.executable, "-c", FIRST_JOIN_AFTER_WARM, str(free_ports(1)[0])],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
