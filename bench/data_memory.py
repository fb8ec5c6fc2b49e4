"""A rank's memory does not grow with the corpus: RSS of a rank training on a >= 2 GB token corpus.

Builds (once; ``--corpus DIR`` reuses it) a synthetic corpus of ``--gb`` GB of int32 token ids —
random ids < 32000 in documents of random length ending in EOS (id 0), written through the same
shard builder as ``data prepare`` (row groups of ~64k tokens, shards of 8M tokens, format-2 sidecar),
so the trainer reads it exactly as a prepared corpus (document masks on). Then, each in a fresh
process, one rank (a world-1 process group + ``RankRuntime``, what a rank actor runs minus Ray) trains
``--steps`` steps of the same small model on

* **builtin**: the shipped 450 KB corpus (held in memory), and
* **big**: the synthetic corpus, read lazily (sample order over the whole corpus: every window of a
  step lands in a different row group).

Figures: the rank's RSS (psutil) before the runtime is built, after it is built, after step 1 and
after every later step; ``growth_over_run_mb`` = max RSS after step 1 - RSS after step 1 (the run
after the first step's one-time allocations: optimizer state, autograd buffers), goal <= 64 MB on
the big corpus; ``start_s`` = seconds from "build the runtime" to the end of step 1 (the data open
is part of it), goal big <= 2 x builtin. The driver's own check of the big corpus (``validate_source``:
the sidecar plus every shard's footer) is timed too.

    python bench/data_memory.py [--quick] [--gb 2.0] [--steps 40] [--corpus DIR] [--out PATH]

``--quick`` uses a 20 MB corpus and 4 steps (a smoke run for the tests, not a measurement). Writes
``bench/results/data_memory.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # bench/common.py: also puts the repository root on sys.path

ROOT = common.ROOT
VOCAB = 32000
EOS = 0
MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.seq_len=512", f"model.vocab_size={VOCAB}"]
TRAIN = ["train.global_batch_size=16", "train.micro_batch_size=4"]


def make_corpus(out: Path, gb: float, seed: int = 0) -> dict:
    """Synthetic shards of ``gb`` GB of int32 tokens, written like ``data prepare`` writes them."""
    import hashlib

    import numpy as np

    from meshdata.index import FORMAT_VERSION, SIDECAR
    from meshdata.prepare import SHARD_TOKENS, UnitResult, _ShardBuilder

    target = int(gb * 2**30 / 4)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files, shards, docs = [], {}, 0
    result = UnitResult()
    builder = _ShardBuilder(SHARD_TOKENS, result)

    def drain() -> None:
        for data, info in result.shards:
            name = f"shard-{len(files):05d}.parquet"
            (out / name).write_bytes(data)
            files.append(name)
            shards[name] = info
        result.shards.clear()

    while result.tokens < target:
        lengths = rng.integers(50, 4000, 256).astype(np.int64)
        ids = rng.integers(1, VOCAB, int(lengths.sum()), dtype=np.int32)
        ids[np.cumsum(lengths) - 1] = EOS  # every document ends with EOS
        builder.add(ids, lengths)
        docs += len(lengths)
        drain()
    builder.finish()
    drain()
    meta = {"format": FORMAT_VERSION,
            "tokenizer": {"kind": "synthetic", "hash": hashlib.sha256(f"random-{seed}".encode()).hexdigest(),
                          "vocab_size": VOCAB, "bos_id": None, "eos_id": EOS, "files": []},
            "vocab_size": VOCAB, "documents": docs, "num_tokens": result.tokens, "files": files, "shards": shards}
    (out / SIDECAR).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def child(data_path: str, steps: int) -> dict:
    """One rank in this process: RSS and timings (run in a fresh process per side)."""
    import psutil
    import torch
    import torch.distributed as dist

    from meshdata.masks import mask_eos_for
    from meshspeak.mesh import MeshShape
    from meshspeak.schedule import make_schedule
    from orchestrator.config.load import load_config
    from orchestrator.control.generation import runtime_spec
    from orchestrator.plan.mesh_plan import make_plan
    from workers.groups import build_process_groups
    from workers.runtime import RankRuntime

    torch.set_num_threads(1)
    proc = psutil.Process()
    mb = lambda: proc.memory_info().rss / 2**20  # noqa: E731
    cfg = load_config(None, [*MODEL, *TRAIN, f"train.steps={steps}", f"data.path={data_path}",
                             "mesh.dp=1", "mesh.pp=1", "mesh.tp=1"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rss_before = mb()
    t0 = time.perf_counter()
    groups = build_process_groups(store_addr="127.0.0.1", store_port=store.port, generation=1,
                                  shape=MeshShape(1, 1, 1), world_rank=0, timeout_s=60, device=torch.device("cpu"))
    spec = runtime_spec(cfg, make_plan(cfg), data_path=cfg.data.path, use_gpu=False,
                        mask_eos_id=mask_eos_for(cfg.data), resuming=False)
    runtime = RankRuntime(spec, groups)
    built_s = time.perf_counter() - t0
    rss_built = mb()
    actions = make_schedule("1f1b", 1, cfg.train.global_batch_size // cfg.train.micro_batch_size, 1)[0]
    rss, step_s, losses = [], [], []
    for step in range(1, steps + 1):
        s0 = time.perf_counter()
        losses.append(runtime.train_step(step, actions).loss)
        step_s.append(time.perf_counter() - s0)
        rss.append(mb())
    start_s = built_s + step_s[0]
    runtime.destroy()
    return {"rss_before_runtime_mb": rss_before, "rss_after_build_mb": rss_built, "rss_after_step_mb": rss,
            "growth_over_run_mb": max(rss) - rss[0], "growth_from_build_mb": max(rss) - rss_built,
            "build_s": built_s, "first_step_s": step_s[0], "start_s": start_s, "step_s": step_s,
            "losses": losses, "num_samples": runtime.data.num_samples(), "mask_eos_id": spec.mask_eos_id}


def run_child(data_path: str, steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--child", data_path, "--steps", str(steps)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"child on {data_path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "data_memory", "20 MB corpus, 4 steps: a smoke run, not a measurement")
    parser.add_argument("--gb", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--corpus", default=None, help="directory for the synthetic corpus (reused if complete)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 40)
    if args.child:
        print(json.dumps(child(args.child, steps)))
        return 0
    gb = args.gb or (0.02 if args.quick else 2.0)

    tmp = None
    corpus = Path(args.corpus) if args.corpus else Path(tmp := tempfile.mkdtemp(prefix="elastimesh-bigcorpus-"))
    try:
        corpus_facts = _corpus_facts(corpus, gb)
        sides = {"builtin": run_child("builtin", steps), "big": run_child(str(corpus), steps)}
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    big, builtin = sides["big"], sides["builtin"]
    start_ratio = big["start_s"] / builtin["start_s"]
    result = {
        "benchmark": "data_memory",
        "goal": "rank RSS growth over the run <= 64 MB on a >= 2 GB token corpus; first step start "
                "(runtime build incl. data open + step 1) <= 2x the built-in corpus's",
        "quick": args.quick,
        "growth_over_run_mb": big["growth_over_run_mb"],
        "start_ratio": start_ratio,
        "goal_met": big["growth_over_run_mb"] <= 64 and start_ratio <= 2.0 and (args.quick or gb >= 2.0),
        "peak_rss_mb": {k: max(v["rss_after_step_mb"]) for k, v in sides.items()},
        "peak_rss_big_minus_builtin_mb": max(big["rss_after_step_mb"]) - max(builtin["rss_after_step_mb"]),
        "corpus": corpus_facts,
        "sides": sides,
        "config": {"model": MODEL, "train": TRAIN, "steps": steps, "cache_mb": 4},
        "environment": common.environment(),
        "machine": common.machine(load_average=common.load_average()),
    }
    out = Path(args.out)
    common.write_result(out, result)
    print(f"data_memory: {result['corpus']['token_gb']:.2f} GB of tokens; RSS growth over the run "
          f"{big['growth_over_run_mb']:.1f} MB (builtin {builtin['growth_over_run_mb']:.1f} MB); start "
          f"{big['start_s']:.2f}s vs builtin {builtin['start_s']:.2f}s ({start_ratio:.2f}x); goal "
          f"{'met' if result['goal_met'] else 'NOT met'} -> {out}")
    return 0


def _corpus_facts(corpus: Path, gb: float) -> dict:
    """The corpus at ``corpus`` (made with ``gb`` GB of tokens unless it is complete there): its size
    and shape, how long making it and the driver's validation of it took."""
    from meshdata import validate_source
    from meshdata.index import SIDECAR

    t0 = time.perf_counter()
    if (corpus / SIDECAR).exists():
        meta = json.loads((corpus / SIDECAR).read_text())
    else:
        meta = make_corpus(corpus, gb)
    make_s = time.perf_counter() - t0
    corpus_bytes = sum(f.stat().st_size for f in corpus.glob("*.parquet"))
    t0 = time.perf_counter()
    src = validate_source(str(corpus), 512, VOCAB, 16)
    validate_s = time.perf_counter() - t0
    return {"token_gb": meta["num_tokens"] * 4 / 2**30, "num_tokens": meta["num_tokens"],
            "documents": meta["documents"], "shards": len(meta["files"]), "file_bytes": corpus_bytes,
            "row_groups": int(len(src.index.rg_tokens)), "generate_s": make_s,
            "driver_validate_s": validate_s}

if __name__ == "__main__":
    sys.exit(main())
