"""`data prepare` throughput vs the `tokenizers` library's own batch encode, same text, same cores.

A synthetic JSON-lines corpus (paragraphs of the built-in corpus, shuffled and repeated to ``--mb``
MB) and a byte-level BPE trained offline on it (``--vocab`` tokens) are made first. Then, alternating
(A B A B ...) so that load drift hits both sides alike:

* **tokenizers**: the text already in memory as a list of strings, ``Tokenizer.encode_batch_fast`` on
  batches of ~1 MB of text, the library's own thread pool over every core — the ceiling for encoding
  alone (no reading, no writing);
* **prepare**: ``meshdata.prepare`` end to end — read and parse the JSON lines, encode (Ray tasks,
  one per core, one encode thread each), add EOS, build Parquet shards, hash and write them, write the
  sidecar — on a local Ray that is already started (its start is reported separately:
  ``ray_start_s``; ``end_to_end_ratio`` charges it to one prepare).

Figure: ``ratio`` = the median over the rounds of each round's prepare tokens/s / tokenizers tokens/s
(``ratio_spread``: min, max, each round's); goal >= 0.8 in every round (``rounds_meeting_goal``).

    python bench/data_prepare.py [--quick] [--mb 64] [--vocab 32000] [--rounds 3] [--out PATH]

``--quick``: 2 MB, vocab 2000, one round (a smoke run for the tests, not a measurement). Writes
``bench/results/data_prepare.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common  # bench/common.py: also puts the repository root on sys.path
from stats import paired_ratios, repeats_meeting, spread

BATCH_CHARS = 1 << 20
GOAL_RATIO = 0.8


def make_inputs(folder: Path, mb: float, vocab: int) -> tuple[list[str], Path, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshdata.source import BUILTIN_FILE

    paragraphs = [p for p in BUILTIN_FILE.read_text().split("\n\n") if p.strip()]
    rng = random.Random(0)
    docs, size = [], 0
    while size < mb * 2**20:
        doc = "\n\n".join(rng.sample(paragraphs, rng.randint(1, 4)))
        docs.append(doc)
        size += len(doc.encode())
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(paragraphs, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return docs, corpus, folder


def baseline(tokenizer_path: Path, docs: list[str]) -> tuple[float, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    t0 = time.perf_counter()
    tokens = 0
    batch, chars = [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= BATCH_CHARS:
            tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
            batch, chars = [], 0
    if batch:
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
    return time.perf_counter() - t0, tokens


def ours(corpus: Path, tok_dir: Path, out: Path) -> tuple[float, int]:
    from meshdata import prepare
    from orchestrator.cluster.prepare_tasks import RayFanOut

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    meta = prepare([str(corpus)], str(out), tokenizer=str(tok_dir), parallel=True, fan_out=RayFanOut())
    return time.perf_counter() - t0, meta["num_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, "data_prepare", "2 MB, vocab 2000, one round: a smoke run, not a measurement")
    parser.add_argument("--mb", type=float, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    mb = args.mb or (2.0 if args.quick else 64.0)
    vocab = args.vocab or (2000 if args.quick else 32000)
    rounds = args.rounds or (1 if args.quick else 3)

    import ray

    tmp = Path(tempfile.mkdtemp(prefix="elastimesh-prepare-bench-"))
    try:
        t0 = time.perf_counter()
        docs, corpus, tok_dir = make_inputs(tmp / "in", mb, vocab)
        make_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
        ray_start_s = time.perf_counter() - t0
        ours(corpus, tok_dir, tmp / "warm")  # workers started, tokenizer loaded: steady state measured
        runs = {"tokenizers": [], "prepare": []}
        for r in range(rounds):
            order = ["tokenizers", "prepare"] if r % 2 == 0 else ["prepare", "tokenizers"]
            for side in order:
                wall, tokens = baseline(tok_dir / "tokenizer.json", docs) if side == "tokenizers" else \
                    ours(corpus, tok_dir, tmp / "out")
                runs[side].append({"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall})
        ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "data_prepare",
        "goal": "data prepare tokens/s >= 0.8 x tokenizers' own encode_batch_fast tokens/s, same text and cores, "
                "in every round (the headline: the median of the per-round ratios)",
        "goal_ratio": GOAL_RATIO,
        "quick": args.quick,
        **figures(runs, ray_start_s),
        "config": {"text_mb": mb, "documents": len(docs), "vocab": vocab, "rounds": rounds, "make_s": make_s,
                   "prepare_tasks": "one per CPU, RAYON_NUM_THREADS=1", "baseline_threads": "tokenizers default (all cores)"},
        "machine": common.machine(load_average=common.load_average()),
    }
    out = Path(args.out)
    common.write_result(out, result)
    rate, spread_ = result["tokens_per_s"], result["ratio_spread"]
    print(f"data_prepare: {rate['prepare']:,.0f} tokens/s vs tokenizers {rate['tokenizers']:,.0f} tokens/s "
          f"= {spread_['median']:.2f}x [{spread_['min']:.2f}, {spread_['max']:.2f}] (goal >= {GOAL_RATIO} in "
          f"every round: {result['rounds_meeting_goal']}); with Ray's start ({ray_start_s:.1f}s) "
          f"{result['end_to_end_ratio']:.2f}x -> {out}")
    return 0


def figures(runs: dict[str, list[dict]], ray_start_s: float) -> dict:
    """The headline from the interleaved rounds: each round's prepare tokens/s over the tokenizers run of
    the same round, their median with its spread, and the goal only when every round meets it; the
    median tokens/s of each side; ``end_to_end_ratio`` charges Ray's start to one (median) prepare."""
    ratios = paired_ratios([r["tokens_per_s"] for r in runs["prepare"]],
                           [r["tokens_per_s"] for r in runs["tokenizers"]])
    rate = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    wall_prepare = statistics.median(r["wall_s"] for r in runs["prepare"])
    end_to_end = (runs["prepare"][0]["tokens"] / (wall_prepare + ray_start_s)) / rate["tokenizers"]
    meeting, every_round = repeats_meeting(ratios, lambda x: x >= GOAL_RATIO)
    return {"ratio": statistics.median(ratios), "ratio_spread": spread(ratios),
            "ratio_of_median_rates": rate["prepare"] / rate["tokenizers"],
            "rounds_meeting_goal": meeting, "goal_met": every_round,
            "tokens_per_s": rate, "end_to_end_ratio": end_to_end, "ray_start_s": ray_start_s, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
