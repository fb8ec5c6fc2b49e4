"""`elastimesh` / `python -m orchestrator`: train, plan, config, tune, report, ckpt list|inspect, data prepare.

Exit codes (README.md, "Use"): 0 done; 2 bad input — one line on stderr naming the key or file
and the fix, no traceback; 1 training failed within the elastic limits.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from meshspeak.schema import ConfigError
from orchestrator.config.load import load_config

logger = logging.getLogger("elastimesh")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse would print the usage too)
        sys.stderr.write(f"elastimesh: error: {message} (see `elastimesh --help`)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="elastimesh", description="Elastic DP x PP x TP training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text in (("train", "train a model (no CONFIG: the built-in tiny job on a local Ray)"),
                       ("plan", "print the mesh, stage split, rank coordinates and memory estimate")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", nargs="?", help="job TOML file")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
        _add_deepspeed(p)
        if name == "plan":
            p.add_argument("--json", action="store_true", help="print the plan as JSON")
            p.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                           help="device memory per rank: also recommend the cheapest mesh.zero / "
                                "mesh.dp_replicate that fits it")
        else:
            p.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    conf = sub.add_parser("config", help="print the resolved job config as TOML, or (--doc) every key")
    conf.add_argument("config", nargs="?", help="job TOML file")
    conf.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    _add_deepspeed(conf)
    conf.add_argument("--doc", action="store_true", help="print the table of every key (type, default, "
                      "allowed values, meaning) as README shows it")
    _add_tune(sub)
    report = sub.add_parser("report", help="goodput table, figures and an HTML page from a run's metrics JSONL")
    report.add_argument("metrics", help="the run's metrics.path: a file or a URI (s3://...); a run still going too")
    report.add_argument("--out", help="directory for report.html, report.json and the PNGs (default: report/)")
    ckpt = sub.add_parser("ckpt", help="list or inspect checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
    ckpt_sub.add_parser("list", help="committed and partial checkpoints under DIR").add_argument("dir")
    ckpt_sub.add_parser("inspect", help="one checkpoint: step, mesh, size, time, valid?").add_argument("path")
    export = sub.add_parser("export", help="write a committed checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a step-N checkpoint directory (or a checkpoint.dir: its newest)")
    export.add_argument("--out", required=True, help="new directory for the safetensors, config.json, ...")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    export.add_argument("--max-shard-gb", type=float, default=4.0, help="split the weights into files of this size")
    export.add_argument("--family", default="", metavar="PKG.MOD:NAME", help="import this model family (needed "
                        "when the checkpoint records one that is not built in: a checkpoint never names code to run)")
    export.add_argument("--tokenizer-from", default="", metavar="PATH_OR_URI", help="copy the tokenizer files from "
                        "here (default: the data path the checkpoint records, if it is a local path)")
    data = sub.add_parser("data", help="prepare Parquet token shards")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    prep = data_sub.add_parser("prepare", help="tokenize text (.txt, .jsonl/.json, .parquet, dirs, globs) "
                               "into Parquet token shards, one document per row")
    prep.add_argument("inputs", nargs="+", metavar="INPUT")
    prep.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    prep.add_argument("--tokenizer", default=None, metavar="TOK", help="a Hugging Face tokenizer.json or a "
                      "directory holding it (+ tokenizer_config.json); default: bytes (vocab 256)")
    prep.add_argument("--text-key", default="text", help="JSON lines: the field holding the text")
    prep.add_argument("--text-column", default="text", help="Parquet input: the column holding the text")
    prep.add_argument("--encoding", default="utf-8", help="encoding of .txt / JSON input files")
    prep.add_argument("--shard-tokens", type=int, default=8_000_000, help="tokens per shard at most")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.add_argument("--chat", action="store_true", help='JSON lines of {"messages": [{"role", "content"}...]}: '
                      "render each with the tokenizer's chat template, one conversation per row, loss only on the "
                      "assistant's tokens (its {%% generation %%} blocks)")
    prep.add_argument("--seq-len", type=int, default=None, metavar="N", help="--chat: refuse conversations of "
                      "more than N + 1 tokens now (training refuses them against model.seq_len anyway)")
    return parser


def _add_deepspeed(p) -> None:
    p.add_argument("--deepspeed", metavar="DS_CONFIG.json", help="a DeepSpeed config: its batch, ZeRO, precision, "
                   "optimizer, scheduler, checkpointing and pipeline fields as config keys (README: DeepSpeed)")


def _load(args):
    """The job config of ``args`` (config, --set, --deepspeed); a DeepSpeed field with no counterpart
    is one warning line on stderr."""
    return load_config(args.config, args.overrides, deepspeed=getattr(args, "deepspeed", None),
                       warn=lambda line: sys.stderr.write(f"elastimesh: warning: {line}\n"))


def _add_tune(sub) -> None:
    from orchestrator.sweep.tuner import SCHEDULERS, SEARCH_ALGS

    p = sub.add_parser("tune", help="sweep hyper-parameters with Ray Tune, one elastic job per trial")
    p.add_argument("config", nargs="?", help="job TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--search", action="append", default=[], metavar="KEY=SPACE",
                   help="grid(a,b,...) (every value), choice(a,b,...) (drawn at random), uniform(a,b), "
                   "loguniform(a,b) or randint(a,b) (upper bound excluded)")
    p.add_argument("--samples", type=int, default=1, help="trials to run (with grid(...): repeats of the grid)")
    p.add_argument("--verbose", action="store_true", help="also print Ray Tune's own per-trial status tables")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="fifo", help="asha: stop bad trials early")
    p.add_argument("--grace-steps", type=int, default=0, help="ASHA's first rung (default: steps / 4)")
    p.add_argument("--search-alg", choices=SEARCH_ALGS, default="random",
                   help="optuna: TPE (needs the optional `tune` extra)")
    p.add_argument("--max-concurrent", type=int, default=0, help="trials at once (default: what fits)")
    p.add_argument("--dir", help="the sweep's directory; rerun to resume (default: sweeps/<config name>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from checkpoints.errors import CheckpointError
    from meshdata import DataError
    from orchestrator.errors import OrchestratorError

    try:
        return _dispatch(args)
    except (ConfigError, DataError, CheckpointError) as exc:
        return _fail(str(exc), 2)
    except OrchestratorError as exc:
        return _fail(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"elastimesh: error: {message.splitlines()[0]}\n")
    return code


def _dispatch(args) -> int:
    """Run the subcommand ``args`` names; its exit code."""
    commands = {"plan": _plan, "config": _config, "train": _train, "tune": _tune, "report": _report,
                "ckpt": _ckpt, "export": _export, "data": _data_prepare}
    if args.command not in commands:
        raise AssertionError(args.command)
    return commands[args.command](args)


def _plan(args) -> int:
    """`elastimesh plan`: the mesh, stage split, ranks and memory estimate (``--json``: as JSON)."""
    from orchestrator.plan.mesh_plan import describe, make_plan
    from orchestrator.plan.render import render

    cfg = _load(args)
    info = describe(cfg, make_plan(cfg))
    if args.memory_gib is not None:
        from orchestrator.plan.strategy import recommend

        if args.memory_gib <= 0:
            raise ConfigError("--memory-gib", f"--memory-gib must be > 0, got {args.memory_gib}")
        info["strategy"] = recommend(cfg, int(args.memory_gib * 2**30))
    sys.stdout.write(json.dumps(info, indent=2) + "\n" if args.json else render(info))
    return 0


def _config(args) -> int:
    """`elastimesh config`: the resolved job as TOML (``--doc``: every key's documentation)."""
    from meshspeak.sections import config_doc
    from orchestrator.config.load import config_toml

    if args.doc:
        sys.stdout.write(config_doc())
    else:
        sys.stdout.write(config_toml(_load(args)))
    return 0


def _train(args) -> int:
    """`elastimesh train`: run the job; stopped by a signal, one line saying where it resumes."""
    cfg = _load(args)  # before Ray's import (~1.5 s, more on a loaded machine): bad config exits at once
    from orchestrator.launch import run_job

    summary = run_job(cfg, progress=not args.no_progress and sys.stderr.isatty())
    if summary.resume_step is not None:
        where = (f"committed in checkpoint.dir={cfg.checkpoint.dir}; running it again resumes from step "
                 f"{summary.resume_step}" if cfg.checkpoint.dir else
                 "not saved (checkpoint.dir is unset): running it again starts from step 1")
        sys.stderr.write(f"elastimesh: stopped after step {summary.final_step}: {where}\n")
        return 0
    logger.info("done: step %d, %d generation(s), %d restart(s)", summary.final_step,
                summary.generations, summary.restarts)
    return 0


def _tune(args) -> int:
    from orchestrator.sweep.tuner import tune_command

    return tune_command(args)


def _report(args) -> int:
    from orchestrator.report.command import report_command

    return report_command(args)


def _ckpt(args) -> int:
    """`elastimesh ckpt list DIR` (a table) or `ckpt inspect PATH` (JSON)."""
    from checkpoints.catalog import list_checkpoints
    from checkpoints.inspect_view import describe, format_table, require_root

    if args.ckpt_command == "list":
        require_root(args.dir)  # an absent DIR is a mistake here, not "no checkpoints yet"
        sys.stdout.write(format_table(list_checkpoints(args.dir, read_dcp_metadata=False)) + "\n")
    else:
        sys.stdout.write(json.dumps(describe(args.path), indent=2, default=str) + "\n")
    return 0


def _export(args) -> int:
    """`elastimesh export CKPT --out DIR`: one line saying what was written, one more when the tokenizer
    files were left behind."""
    from meshmodels.export import export_checkpoint

    info = export_checkpoint(args.checkpoint, args.out, args.dtype, int(args.max_shard_gb * 2**30),
                             family=args.family, tokenizer_from=args.tokenizer_from)
    sys.stdout.write(f"exported step {info['step']} ({info['tensors']} tensors, {info['bytes'] / 2**20:,.1f} MiB "
                     f"{info['dtype']}, {len(info['files'])} file(s)) to {info['out']}\n")
    if info["tokenizer_skipped"]:
        sys.stdout.write(f"tokenizer files not copied: the checkpoint records data at {info['tokenizer_skipped']}, "
                         "which export does not contact on its own: pass --tokenizer-from to copy them\n")
    return 0


def _data_prepare(args) -> int:
    """`elastimesh data prepare`: text or (``--chat``) conversations -> shards, one line said."""
    from meshdata import prepare
    from orchestrator.cluster.prepare_tasks import RayFanOut

    info = prepare(args.inputs, args.out, tokenizer=args.tokenizer, text_key=args.text_key,
                   text_column=args.text_column, encoding=args.encoding, shard_tokens=args.shard_tokens,
                   progress=not args.no_progress and sys.stderr.isatty(), fan_out=RayFanOut(),
                   chat=args.chat, seq_len=args.seq_len)
    what = (f"{info['documents']} conversations ({info['chat']['counted_tokens']} assistant tokens counted)"
            if args.chat else f"{info['documents']} documents")
    sys.stdout.write(f"wrote {what}, {info['num_tokens']} tokens in {len(info['files'])} shard(s) to {args.out}\n")
    return 0
