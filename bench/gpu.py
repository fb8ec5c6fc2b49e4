"""The GPU path measured on a machine with >= 1 GPU: correctness, throughput/MFU, checkpoint stall, NCCL.

    python bench/gpu.py [--parts a,b,c,d] [--steps N] [--peak-tflops T] [--out PATH]
    python bench/gpu.py --dry-run [--ray] [--out PATH]

Writes ``bench/results/gpu.json`` (or ``--out``; a dry run: ``gpu_dry_run.json``). Each part runs the
real rank code (``RankRuntime`` on process groups made by ``build_process_groups``; part d the real
``Controller`` on Ray actors):

(a) ``cpu_vs_cuda``: a tiny model, 10 fp32 steps on one rank on the CPU (gloo) and on one GPU
    (NCCL); every step's loss within 1e-4 relative. TF32 is switched off for this comparison (it
    rounds matmul inputs to 10 mantissa bits, which is the point of TF32 and not a defect); the
    TF32 losses are reported next to it.
(b) ``throughput``: one GPU, bf16, a Llama-1B-shaped model of the built-in GPT family (d_model 2048,
    16 layers, 16 heads, ffn 5632, vocab 32000, seq 2048, micro batch 2, 8 sequences per step)
    with and without ``train.compile``: tokens/s and MFU = (6 N + 12 L d s) x tokens/s / peak, N the
    parameters without the embedding table (TorchTitan's formula; causal attention does half the
    12 L d s, so this slightly flatters MFU as TorchTitan's does), peak the GPU's dense bf16 peak
    from its name (``PEAK_BF16``; ``--peak-tflops`` overrides). Goal: MFU >= 45% with compile (the
    headline variant, fixed before measuring; eager's verdict beside it in ``goal_met_by_variant``).
(c) ``checkpoint_stall``: a ~350M model trains with an async checkpoint every other step; the stall
    (save call + the wait for staging before the next optimizer step, what RankRuntime reports)
    vs the time of a synchronous save of the same state. Goal: median stall <= 2% of it.
(d) ``nccl_mesh`` (>= 2 GPUs, else skipped with the reason): meshes (2,1,1), (1,2,1), (1,1,2) on
    Ray actors with one GPU each equal the single-process fp32 reference (1e-4 relative, TF32 off
    in the actors via NVIDIA_TF32_OVERRIDE=0), and a rank killed mid-run is recovered
    (``bench/gpu_mesh.py``).

``--dry-run`` runs the same code on the CPU at tiny sizes (gloo instead of NCCL, compile with the
"aot_eager" backend instead of inductor, no MFU): a smoke run for CI (tests/process/test_bench_scripts.py),
not a measurement. Part d needs Ray and takes minutes on CPU, so the dry run skips it unless
``--ray`` is given. A dry run compares the CPU with the CPU, so it claims no goal: every ``goal_met``
in its file is null (``withhold_goals``), and it never writes ``gpu.json`` unless ``--out`` says so.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu.json"
DRY_RUN_OUT = ROOT / "bench" / "results" / "gpu_dry_run.json"
DRY_RUN_NOTE = "dry run on the CPU (CPU compared with CPU, tiny sizes): a smoke run, not a measurement"
LOSS_RTOL = 1e-4
GOAL_MFU, GOAL_STALL = 0.45, 0.02
# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from NVIDIA's data sheets; first match wins.
PEAK_BF16 = [("H200", 989e12), ("GH200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
             ("H800", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12),
             ("L40S", 362e12), ("L4", 121e12)]
TINY = ["model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=64",
        "train.global_batch_size=8", "train.micro_batch_size=2"]
LLAMA_1B = ["model.d_model=2048", "model.n_heads=16", "model.n_layers=16", "model.ffn_hidden=5632",
            "model.vocab_size=32000", "model.seq_len=2048", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.dtype=bfloat16"]
MID_350M = ["model.d_model=1024", "model.n_heads=16", "model.n_layers=24", "model.ffn_hidden=2816",
            "model.vocab_size=32000", "model.seq_len=1024", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.dtype=bfloat16"]
DRY_MODEL = ["model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32",
             "model.vocab_size=512", "train.global_batch_size=4", "train.micro_batch_size=2"]


def peak_flops(name: str) -> float | None:
    for key, peak in PEAK_BF16:
        if key.lower() in name.lower():
            return peak
    return None


# -- one rank in this process ---------------------------------------------------------------------
class OneRank:
    """A world-1 generation + RankRuntime in this process (what a rank actor builds, minus Ray)."""

    _generation = 0

    def __init__(self, overrides: list[str], device: torch.device, steps: int) -> None:
        from common import rank_runtime

        from orchestrator.config.load import load_config

        self.cfg = load_config(None, [*overrides, "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", f"train.steps={steps}"])
        OneRank._generation += 1
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.runtime, self.actions = rank_runtime(self.cfg, store_port=self.store.port, generation=OneRank._generation,
                                                  timeout_s=300, store_prefix=f"gpu-bench-{OneRank._generation}",
                                                  device=device)
        self.device = device
        self.step = 0

    def train(self) -> tuple[float, float]:
        """One step; (loss, wall seconds including the device's queued work)."""
        self.step += 1
        self._sync()
        t0 = time.perf_counter()
        result = self.runtime.train_step(self.step, self.actions)
        self._sync()
        if not result.ok:
            raise RuntimeError(result.error)
        return result.loss, time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def close(self) -> None:
        self.runtime.destroy()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _device(dry: bool) -> torch.device:
    from workers.device import select_device

    return torch.device("cpu") if dry else select_device(True)


def _tf32(on: bool) -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32" if on else "ieee"


# -- (a) -------------------------------------------------------------------------------------------
def part_cpu_vs_cuda(dry: bool, steps: int = 10) -> dict:
    def losses(device: torch.device) -> list[float]:
        rank = OneRank(TINY, device, steps)
        try:
            return [rank.train()[0] for _ in range(steps)]
        finally:
            rank.close()

    cpu = losses(torch.device("cpu"))
    device = _device(dry)
    _tf32(False)
    exact = losses(device)
    _tf32(True)
    tf32 = losses(device) if device.type == "cuda" else exact
    rel = max(abs(a - b) / abs(a) for a, b in zip(cpu, exact))
    return {"device": str(device), "steps": steps, "cpu": cpu, "cuda_fp32": exact, "cuda_tf32": tf32,
            "max_rel_diff": rel, "max_rel_diff_tf32": max(abs(a - b) / abs(a) for a, b in zip(cpu, tf32)),
            "goal": f"max_rel_diff <= {LOSS_RTOL} (TF32 off)", "goal_met": rel <= LOSS_RTOL}


# -- (b) -------------------------------------------------------------------------------------------
def model_flops_per_token(cfg) -> tuple[int, float]:
    """(parameters without the embedding table, training FLOPs per token: 6 N + 12 L d s)."""
    from meshmodels.gpt_model import GPT

    with torch.device("meta"):
        model = GPT(cfg.model)
    n = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    m = cfg.model
    return n, 6 * n + 12 * m.n_layers * m.d_model * m.seq_len


def part_throughput(dry: bool, steps: int, warmup: int, peak: float | None) -> dict:
    overrides = DRY_MODEL + ["train.dtype=bfloat16"] if dry else LLAMA_1B
    device = _device(dry)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = peak or (peak_flops(name) if device.type == "cuda" else None)
    out: dict = {"device_name": name, "peak_bf16_flops": peak, "model": overrides, "runs": {}}
    for compiled in (False, True):
        rank = OneRank([*overrides, f"train.compile={str(compiled).lower()}"], device, warmup + steps)
        try:
            n, flops_tok = model_flops_per_token(rank.cfg)
            tokens = rank.cfg.train.global_batch_size * rank.cfg.model.seq_len
            warm = [rank.train()[1] for _ in range(warmup)]
            times = sorted(rank.train()[1] for _ in range(steps))
            memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        finally:
            rank.close()
        median = times[len(times) // 2]
        tps = tokens / median
        mfu = flops_tok * tps / peak if peak else None
        out["runs"]["compile" if compiled else "eager"] = {
            "median_step_s": median, "step_times_s": times, "warmup_step_times_s": warm,
            "tokens_per_step": tokens, "tokens_per_s": tps, "mfu": mfu, "max_memory_allocated": memory}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    out.update(params_non_embedding=n, flops_per_token=flops_tok)
    # The goal is judged on one variant fixed before measuring (train.compile, the fast path a user
    # turns on), never the better of the two; eager's verdict is beside it. None: no known peak (or the CPU).
    met = {name: (r["mfu"] >= GOAL_MFU if r["mfu"] is not None else None) for name, r in out["runs"].items()}
    out["goal"] = f"MFU >= {GOAL_MFU:.0%} of the dense bf16 peak with train.compile (the headline variant)"
    out.update(headline_variant="compile", goal_met=met["compile"], goal_met_by_variant=met)
    return out


# -- (c) -------------------------------------------------------------------------------------------
def part_checkpoint_stall(dry: bool, saves: int, workdir: str) -> dict:
    from checkpoints.writer import AsyncCheckpointWriter

    device = _device(dry)
    rank = OneRank(DRY_MODEL if dry else MID_350M, device, 4 * saves + 4)
    runtime = rank.runtime
    try:
        for _ in range(2):
            rank.train()
        sync_s = []
        for i in range(2):  # a synchronous save of the same state, what the async one is held against
            writer = AsyncCheckpointWriter(runtime.groups.ckpt_group, use_async=False)
            path = os.path.join(workdir, f"sync-{i}")
            t0 = time.perf_counter()
            writer.save(_snapshot(runtime, rank.step), path)
            sync_s.append(time.perf_counter() - t0)
            writer.close()
            _rm(path)
        stalls, plain = [], []
        for i in range(saves):
            plain.append(rank.train()[1])
            path = os.path.join(workdir, f"async-{i}")
            runtime.save_checkpoint(path, rank.step)
            rank.train()  # overlaps the write; waits for staging before its optimizer step
            ack = runtime.wait_checkpoint()
            stalls.append(ack.stall_s)
            _rm(path)
    finally:
        rank.close()
    stall, sync = sorted(stalls)[len(stalls) // 2], sorted(sync_s)[len(sync_s) // 2]
    return {"device": str(device), "model": DRY_MODEL if dry else MID_350M, "sync_save_s": sync_s,
            "async_stall_s": stalls, "plain_step_s": plain, "median_stall_s": stall, "median_sync_s": sync,
            "ratio": stall / sync, "goal": f"median async stall <= {GOAL_STALL:.0%} of a synchronous save",
            "goal_met": stall / sync <= GOAL_STALL}


def _snapshot(runtime, step: int) -> dict:
    from checkpoints.state import TrainingState

    return TrainingState(runtime.model_parts(), runtime.optimizers).snapshot(step=step, data_cursor=0, rng=False)


def _rm(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# -- main ------------------------------------------------------------------------------------------
def output_path(out: str | None, dry: bool) -> Path:
    """``--out``, else ``gpu.json``; a dry run's own default file is ``gpu_dry_run.json``."""
    return Path(out) if out else DRY_RUN_OUT if dry else DEFAULT_OUT


def withhold_goals(result: dict) -> dict:
    """A dry run's result with every ``goal_met`` (at any depth) set to None: its parts ran on the CPU
    at tiny sizes, so no figure in it may read as a goal reached (or missed) on a GPU."""
    for key, value in result.items():
        if key == "goal_met":
            result[key] = None
        elif isinstance(value, dict):
            withhold_goals(value)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: a smoke run, not a measurement")
    parser.add_argument("--ray", action="store_true", help="with --dry-run: also run part d on CPU actors")
    parser.add_argument("--parts", default="a,b,c,d")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per throughput run")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, if not in PEAK_BF16")
    parser.add_argument("--out", default=None, help=f"default {DEFAULT_OUT} ({DRY_RUN_OUT.name} for --dry-run)")
    args = parser.parse_args(argv)
    from common import write_result  # bench/ is on sys.path

    dry, parts = args.dry_run, set(args.parts.split(","))
    if not dry and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; use --dry-run for the CPU smoke run", file=sys.stderr)
        return 2
    if dry:
        import workers.parallelize as parallelize  # inductor takes minutes on a small CPU: trace only

        parallelize.apply_compile = functools.partial(parallelize.apply_compile, backend="aot_eager")
    result: dict = {"benchmark": "gpu", "dry_run": dry, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpus": torch.cuda.device_count(), "host": platform.node()}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as workdir:
        if "a" in parts:
            result["cpu_vs_cuda"] = part_cpu_vs_cuda(dry, steps=3 if dry else 10)
        if "b" in parts:
            result["throughput"] = part_throughput(dry, steps=2 if dry else args.steps, warmup=1 if dry else 3,
                                                   peak=args.peak_tflops * 1e12 if args.peak_tflops else None)
        if "c" in parts:
            result["checkpoint_stall"] = part_checkpoint_stall(dry, saves=2 if dry else 5, workdir=workdir)
        if "d" in parts:
            from gpu_mesh import part_nccl_mesh  # bench/ is on sys.path

            result["nccl_mesh"] = part_nccl_mesh(dry, run=not dry or args.ray, workdir=workdir)
    result["wall_s"] = time.perf_counter() - t0
    if dry:
        withhold_goals(result)
        result["note"] = DRY_RUN_NOTE
    out = output_path(args.out, dry)
    write_result(out, result)
    goals = {k: v.get("goal_met") for k, v in result.items() if isinstance(v, dict) and "goal_met" in v}
    print(f"gpu bench ({'dry run' if dry else torch.cuda.get_device_name()}): goals {goals} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
