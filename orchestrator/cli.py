"""`elastimesh` / `python -m orchestrator`: train, plan, config, ckpt list|inspect, data prepare.

Exit codes (README.md, "Use"): 0 done; 2 bad input — one line on stderr naming the key or file
and the fix, no traceback; 1 training failed within the elastic limits.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from orchestrator.config import ConfigError, load_config

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
        if name == "plan":
            p.add_argument("--json", action="store_true", help="print the plan as JSON")
        else:
            p.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")
    conf = sub.add_parser("config", help="print the resolved job config as TOML, or (--doc) every key")
    conf.add_argument("config", nargs="?", help="job TOML file")
    conf.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    conf.add_argument("--doc", action="store_true", help="print the table of every key (type, default, "
                      "allowed values, meaning) as README shows it")
    ckpt = sub.add_parser("ckpt", help="list or inspect checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True, parser_class=_Parser)
    ckpt_sub.add_parser("list", help="committed and partial checkpoints under DIR").add_argument("dir")
    ckpt_sub.add_parser("inspect", help="one checkpoint: step, mesh, size, time, valid?").add_argument("path")
    data = sub.add_parser("data", help="prepare Parquet token shards")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    prep = data_sub.add_parser("prepare", help="byte-tokenize text files into Parquet shards")
    prep.add_argument("texts", nargs="+")
    prep.add_argument("--out", required=True)
    prep.add_argument("--shard-tokens", type=int, default=1_000_000)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from checkpoints.errors import CheckpointError
    from orchestrator.errors import OrchestratorError
    from workers.data import DataError

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
    if args.command == "plan":
        from orchestrator.plan import describe, make_plan
        from orchestrator.plan_render import render

        cfg = load_config(args.config, args.overrides)
        info = describe(cfg, make_plan(cfg))
        sys.stdout.write(json.dumps(info, indent=2) + "\n" if args.json else render(info))
        return 0
    if args.command == "config":
        from orchestrator.config import config_doc, config_to_dict
        from orchestrator.config_schema import dump_toml

        if args.doc:
            sys.stdout.write(config_doc())
        else:
            sys.stdout.write(dump_toml(config_to_dict(load_config(args.config, args.overrides))))
        return 0
    if args.command == "train":
        from orchestrator.launch import run_job

        cfg = load_config(args.config, args.overrides)
        summary = run_job(cfg, progress=not args.no_progress and sys.stderr.isatty())
        if summary.resume_step is not None:  # stopped by a signal: one line saying where it resumes
            where = (f"committed in checkpoint.dir={cfg.checkpoint.dir}; running it again resumes from step "
                     f"{summary.resume_step}" if cfg.checkpoint.dir else
                     "not saved (checkpoint.dir is unset): running it again starts from step 1")
            sys.stderr.write(f"elastimesh: stopped after step {summary.final_step}: {where}\n")
            return 0
        logger.info("done: step %d, %d generation(s), %d restart(s)", summary.final_step,
                    summary.generations, summary.restarts)
        return 0
    if args.command == "ckpt":
        from checkpoints.catalog import describe, format_table, list_checkpoints, require_root

        if args.ckpt_command == "list":
            require_root(args.dir)  # an absent DIR is a mistake here, not "no checkpoints yet"
            sys.stdout.write(format_table(list_checkpoints(args.dir, read_dcp_metadata=False)) + "\n")
        else:
            sys.stdout.write(json.dumps(describe(args.path), indent=2, default=str) + "\n")
        return 0
    if args.command == "data":
        from workers.data import prepare

        info = prepare(args.texts, args.out, shard_tokens=args.shard_tokens)
        sys.stdout.write(f"wrote {info['num_tokens']} tokens in {len(info['files'])} shard(s) to {args.out}\n")
        return 0
    raise AssertionError(args.command)
