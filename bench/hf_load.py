"""Build + Hugging Face load of a model far bigger than one rank's share: peak host memory and time.

A random Llama-architecture model (written as sharded HF safetensors + ``config.json``, no download)
is built and loaded by every rank of a dp=4 x tp=2 mesh (8 gloo ranks, one process each, the tests'
rank pool): ``RankRuntime`` with ``model.from_hf`` + ``checkpoint.init_from``, i.e. the stage is built
on the meta device, TP'd and FSDP2-sharded, ``to_empty`` allocates the local shards and DCP's
``HuggingFaceStorageReader`` reads only this rank's slices into them. Each rank's share is 1/8 of the
model, so a rank that materialised its stage would hold 8x its share.

Per rank it records the RSS just before building, the peak during the build + load, both as the
kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``; this includes
file-backed pages of the mmapped safetensors the reader touched, which the kernel can drop) and as
the peak of anonymous memory (``RssAnon`` sampled every 2 ms: what the process really allocated).
The goal compares the anonymous peak with the rank's local shard plus one FSDP unit:

    ratio = (peak RssAnon - RssAnon before) / (local shard bytes + largest block unit's gathered bytes)  <= 1.25

where a block unit is one transformer block (``mesh.fsdp_unit_mb = 0``) as ZeRO-3 gathers it per tp
shard; the root unit (embedding, final norm, head) is reported too. The same build with random init
(no ``init_from``: each parameter's full value is generated once, then sliced) is reported as well.
Time: the slowest rank's build + load (barrier to barrier) vs ``transformers``'
``AutoModelForCausalLM.from_pretrained`` of the same directory in one fresh process (its peak RSS too).

    python bench/hf_load.py [--quick] [--out PATH]

Writes ``bench/results/hf_load.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "bench" / "results" / "hf_load.json"
GOAL = 1.25
DP, TP = 4, 2
PRESETS = {
    # ~161M parameters, 0.64 GB fp32: a rank's share at dp=4 x tp=2 is ~80 MB.
    "full": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
             "num_key_value_heads": 8, "vocab_size": 32000},
    # ~21M parameters for a quick check of the script itself.
    "quick": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 32000},
}
FILE_BYTES = 256 * 2**20  # safetensors file size of the generated model (sharded + index, like the Hub)


def write_model(directory: str, sizes: dict[str, int]) -> dict[str, int]:
    """A random Llama in HF layout: config.json, model-0000i-of-0000n.safetensors, index. Returns counts."""
    import torch
    from safetensors.torch import save_file

    from meshmodels.family import load_family

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "bos_token_id": 1,
              "eos_token_id": 2, "dtype": "float32", **sizes}
    family = load_family("llama")
    shape = family.shape_from_hf(config, argparse.Namespace(seq_len=128, init_std=0.02), "bench")
    tensors = family.hf_tensors(shape)
    groups: list[list[str]] = [[]]
    used = 0
    for name, dims in tensors.items():
        nbytes = 4 * int(torch.Size(dims).numel())
        if groups[-1] and used + nbytes > FILE_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        out = {}
        for name in group:
            dims = tensors[name]
            out[name] = torch.ones(dims) if name.endswith("norm.weight") else torch.randn(dims, generator=gen) * 0.02
            total += out[name].numel() * 4
        save_file(out, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del out
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh)
    return {"params": total // 4, "bytes": total, "files": len(groups)}


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class _AnonPeak:
    """Peak RssAnon, sampled on a thread every 2 ms."""

    def __init__(self) -> None:
        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status("RssAnon"))


class BuildAndLoad:
    """A rank-pool job: build this rank's ``RankRuntime`` (with or without init_from) and measure it."""

    def __init__(self, model_dir: str, init_from: bool) -> None:
        self.model_dir, self.init_from = model_dir, init_from

    def __call__(self, rank: int, store_port: int, generation: int) -> dict:
        import gc

        import torch
        import torch.distributed as dist

        from meshspeak.mesh import MeshShape
        from orchestrator.config.load import load_config
        from orchestrator.control.generation import runtime_spec
        from orchestrator.plan.mesh_plan import make_plan
        from workers.groups import build_process_groups
        from workers.runtime import RankRuntime

        overrides = [f"model.from_hf={self.model_dir}", f"mesh.dp={DP}", f"mesh.tp={TP}", "mesh.pp=1",
                     "model.seq_len=128", "mesh.fsdp_unit_mb=0", "train.global_batch_size=4",
                     "train.micro_batch_size=1", "data.path=builtin"]
        if self.init_from:
            overrides.append(f"checkpoint.init_from={self.model_dir}")
        cfg = load_config(None, overrides)
        plan = make_plan(cfg)
        spec = dataclasses.replace(runtime_spec(cfg, plan, data_path="builtin", use_gpu=False, mask_eos_id=None,
                                                resuming=False), collective_timeout_s=300)
        groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=generation,
                                      shape=MeshShape(DP, 1, TP), world_rank=rank, timeout_s=300,
                                      device=torch.device("cpu"))
        gc.collect()
        dist.barrier()
        rss0, anon0 = _status("VmRSS"), _status("RssAnon")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
        sampler = _AnonPeak()
        t0 = time.perf_counter()
        runtime = RankRuntime(spec, groups)
        build_s = time.perf_counter() - t0
        anon_peak, hwm = sampler.stop(), _status("VmHWM")
        dist.barrier()
        module = runtime.stages[0].module
        local = sum(p.to_local().numel() * 4 for p in module.parameters())

        def gathered(mod) -> int:  # bytes of mod's parameters gathered over dp, per tp shard
            total = 0
            for p in mod.parameters():
                tp_sharded = any(getattr(pl, "dim", None) is not None for pl in p.placements[1:])
                total += p.numel() // (TP if tp_sharded else 1) * 4
            return total

        blocks = [gathered(b) for b in module.layers.values()]
        root = gathered(module) - sum(blocks)
        runtime.destroy()
        return {"rank": rank, "build_load_s": build_s, "rss_before": rss0, "anon_before": anon0,
                "peak_rss_delta": hwm - rss0, "peak_anon_delta": anon_peak - anon0, "local_shard_bytes": local,
                "largest_block_unit_bytes": max(blocks), "root_unit_bytes": root}


def transformers_load(model_dir: str) -> dict:
    code = ("import time, torch; from transformers import AutoModelForCausalLM\n"
            "def s(f):\n"
            "    return int([l for l in open('/proc/self/status') if l.startswith(f + ':')][0].split()[1]) * 1024\n"
            "r0 = s('VmRSS'); t = time.perf_counter()\n"
            f"m = AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.float32)\n"
            "dt = time.perf_counter() - t\n"
            "print({'from_pretrained_s': dt, 'peak_rss_delta': s('VmHWM') - r0, "
            "'params': sum(p.numel() for p in m.parameters())})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return eval(out.stdout.strip().splitlines()[-1])  # our own dict literal


def run_mesh_job(job) -> list[dict]:
    from testbed.rank_pool import _Pool

    pool = _Pool()  # fresh processes: nothing left over from another run
    try:
        out = pool.run(job, DP * TP, timeout=1200)
    finally:
        pool.close()
    return [out[r] for r in sorted(out)]


def summarize(ranks: list[dict]) -> dict:
    ratios = [r["peak_anon_delta"] / (r["local_shard_bytes"] + r["largest_block_unit_bytes"]) for r in ranks]
    return {"max_build_load_s": max(r["build_load_s"] for r in ranks),
            "max_peak_anon_delta_mb": max(r["peak_anon_delta"] for r in ranks) / 2**20,
            "max_peak_rss_delta_mb": max(r["peak_rss_delta"] for r in ranks) / 2**20,
            "max_local_shard_mb": max(r["local_shard_bytes"] for r in ranks) / 2**20,
            "largest_block_unit_mb": max(r["largest_block_unit_bytes"] for r in ranks) / 2**20,
            "root_unit_mb": max(r["root_unit_bytes"] for r in ranks) / 2**20,
            "max_ratio_anon_to_shard_plus_unit": max(ratios), "ranks": ranks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~21M-parameter model (checks the script)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    preset = "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory(prefix="hf-load-") as model_dir:
        model = write_model(model_dir, PRESETS[preset])
        share = model["bytes"] / (DP * TP)
        loaded = summarize(run_mesh_job(BuildAndLoad(model_dir, init_from=True)))
        random_init = summarize(run_mesh_job(BuildAndLoad(model_dir, init_from=False)))
        hf = transformers_load(model_dir)
    result = {
        "benchmark": "hf_load", "preset": preset, "mesh": {"dp": DP, "pp": 1, "tp": TP},
        "model": {**model, **PRESETS[preset], "model_over_rank_share": model["bytes"] / share},
        "goal": f"peak anonymous RSS growth during build + HF load <= {GOAL} x (local shard + one block unit)",
        "init_from": loaded, "random_init": random_init, "transformers_from_pretrained": hf,
        "load_time_ratio_vs_transformers": loaded["max_build_load_s"] / hf["from_pretrained_s"],
        "goal_met": loaded["max_ratio_anon_to_shard_plus_unit"] <= GOAL,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "created_at": time.time(),
    }
    for section in ("init_from", "random_init"):
        result[section] = {k: v for k, v in result[section].items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"hf_load ({preset}, {model['params'] / 1e6:.0f}M params, {model['bytes'] / 2**20:.0f} MiB; share "
          f"{share / 2**20:.0f} MiB/rank): peak anon +{loaded['max_peak_anon_delta_mb']:.0f} MiB vs shard "
          f"{loaded['max_local_shard_mb']:.0f} + unit {loaded['largest_block_unit_mb']:.0f} MiB -> ratio "
          f"{loaded['max_ratio_anon_to_shard_plus_unit']:.2f} (goal <= {GOAL}); build+load "
          f"{loaded['max_build_load_s']:.1f} s vs from_pretrained {hf['from_pretrained_s']:.1f} s; "
          f"random init ratio {random_init['max_ratio_anon_to_shard_plus_unit']:.2f}")
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
