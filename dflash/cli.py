"""``dflash <stage>``: run one stage's package function on explicit paths, without Snakemake.

Each subcommand calls exactly what the stage's rule script calls, with the stage's section of a
validated config file, so one shard can be run or debugged by hand.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from dflash.core.config import ConfigError, load_config
from dflash.core.dialects import LOGGING_SERVERS
from dflash.core.errors import debug_requested, describe
from dflash.core.storage import safe_to_destroy_job
from dflash.core.vocabulary import CATEGORIES, TOOL_CATEGORY
from dflash.core.workflow import exit_on_sigterm, set_threads, setup_logging, target_dir
from dflash.generate.adopt import adopt_command
from dflash.inspect.check import check_tools_command
from dflash.inspect.files import inspect_command
from dflash.plan.stage import cache_size_command, plan_command
from dflash.prompts.stage import prompts_job
from dflash.report.stage import check_run_command, report_job
from dflash.serve.commands import serve_command_command
from dflash.validate.stage import read_exclusions, validate_job


def _prompts_target(cfg: dict, a: argparse.Namespace) -> str:
    """The target folder whose tokenizer and template screen the prompts (``--target``, else the
    config's), which must exist."""
    target = a.target or target_dir(cfg)
    if not Path(target).is_dir():
        fix = ("give the target model's folder" if a.target else f"fix target.path in {a.config}, or give --target"
               if cfg["target"]["path"] else f"build the demo target first (snakemake {target}), or give --target")
        raise FileNotFoundError(f"{target}: no such model folder (its tokenizer and template screen the prompts): "
                                f"{fix}")
    return target


# Each subcommand is one call of its stage's job, as the rule's script makes it, or of a command's
# function. The stages that import torch are imported when run: a command that needs none (plan,
# check, inspect, --help) starts in a fraction of a second.
def _prompts(cfg, a):
    prompts_job(cfg, _prompts_target(cfg, a), a.out)


def _target(cfg, a):
    from dflash.target.stage import target_job  # torch

    target_job(cfg, a.out, teach=a.teach, made_by=" ".join(["dflash", *sys.argv[1:]]))


def _generate(cfg, a):
    from dflash.generate.stage import generate_job  # torch

    generate_job(cfg, a.prompts, a.out, a.target, a.summary)


def _validate(cfg, a):
    validate_job(cfg, a.completions, a.target or target_dir(cfg), a.validated, a.rejected, a.qa,
                 read_exclusions(a.exclude if a.exclude is not None else cfg["validate"]["exclude"]))


def _tokenize(cfg, a):
    from dflash.tokenize.stage import tokenize_job  # torch

    tokenize_job(cfg, a.validated, a.target, a.out, a.index)


def _hidden(cfg, a):
    from dflash.hidden.stage import hidden_job  # torch

    hidden_job(cfg, a.tokenized, a.target, a.out)


def _train(cfg, a):
    from dflash.train.stage import train_job  # torch

    train_job(cfg, a.tokenized, a.hidden or [], a.target, a.out, cfg["run"])


def _eval(cfg, a):
    from dflash.eval.stage import run_eval_job  # torch

    run_eval_job(cfg, a.checkpoint, a.target, a.heldout, a.out)


def _report(cfg, a):
    report_job(cfg, a.manifest, a.qa, a.gates, a.checkpoint, a.eval, a.html, a.json)


def _inspect(a) -> int:
    inspect_command(a.shards, a.category, a.reason, a.flag, a.id, a.limit, a.json, a.full, a.target)
    return 0


def _adopt(a) -> int:
    adopt_command(a.logs, a.target, a.out, {"server": a.server, "tool_format": a.tool_format,
                                            "enable_thinking": not a.no_thinking,
                                            **({"category": a.category} if a.category else {})})
    return 0


def _check_tools(a) -> int:
    return check_tools_command(a.output_dir, a.category, a.config, a.examples, a.json)


def _check_run(a) -> int:
    check_run_command(a.output_dir)
    return 0


def _cache_size(cfg, a):
    cache_size_command(cfg, a.tokens, a.tokenized, a.target)


def _plan(cfg, a):
    plan_command(cfg, a.config, a.prompts, a.heldout, a.output_tokens, a.mean_output_tokens, a.pilot, a.target, a.json)


def _safe_to_destroy(cfg, a):
    safe_to_destroy_job(cfg, a.workdir, a.prefix)


def _serve_command(cfg, a):
    serve_command_command(cfg, a.checkpoint, a.target and str(a.target))


# What each command reads and writes: an output that is also an input, or another output
# (validate --validated X --rejected X), would overwrite records with others.
READS_WRITES = {
    "prompts": (("target",), ("out",)), "target": ((), ("out",)),
    "generate": (("prompts", "target"), ("out", "summary")),
    "validate": (("completions", "exclude", "target"), ("validated", "rejected", "qa")),
    "tokenize": (("validated", "target"), ("out", "index")), "hidden": (("tokenized", "target"), ("out",)),
    "train": (("tokenized", "hidden", "target"), ("out",)), "eval": (("checkpoint", "target", "heldout"), ("out",)),
    "report": (("manifest", "qa", "gates", "checkpoint", "eval"), ("html", "json")),
    "adopt": (("logs", "target"), ("out",)), "plan": ((), ("json",)),
}


def path_clash(args: argparse.Namespace) -> str | None:
    """Why the command's paths cannot all be used as given (an output that is an input or another
    output), or None."""
    reads, writes = READS_WRITES.get(args.stage, ((), ()))
    given: dict[str, str] = {}
    for flag in reads + writes:
        value = getattr(args, flag, None)
        for path in value if isinstance(value, list) else [value] if value is not None else []:
            key = os.path.realpath(path)
            if flag in writes and key in given:
                return (f"--{flag} {path} is also {given[key]}: every output needs a path of its own (it would "
                        f"overwrite what is read or written there)")
            given.setdefault(key, f"--{flag}")
    return None


def count(least: int):
    """An argparse type: a whole number of at least ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: give {least} or more")
        return value
    return parse


def amount(text: str) -> float:
    """An argparse type: a positive, finite number (1.64e9 allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number")
    return value


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of a failure (also DFLASH_DEBUG=1)")
    p = argparse.ArgumentParser(
        prog="dflash", parents=[common],
        description="Run one pipeline stage on explicit paths, exactly as its Snakemake rule does. A failure is "
                    "one line naming the file, line or id; --debug (or DFLASH_DEBUG=1) shows its traceback.",
    )
    sub = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    add_stages(sub, common)
    add_inspect(sub, common)
    add_adopt(sub, common)
    add_check(sub, common)
    return p


def add_stages(sub, common: argparse.ArgumentParser) -> None:
    """The subcommands that run one stage as its rule does, and the planning and serving helpers."""
    def stage(name, fn, help, *args):
        s = sub.add_parser(name, help=help, description=help, parents=[common])
        s.add_argument("--config", default="config.yaml", type=Path, help="pipeline config (default: config.yaml)")
        s.add_argument("--threads", type=count(1), default=None, help="torch threads (default: the config's)")
        for flag, kw in args:
            s.add_argument(flag, **kw)
        s.set_defaults(fn=fn)

    path = {"type": Path, "required": True}
    paths = {"type": Path, "nargs": "+", "required": True}
    target = ("--target", {"type": Path, "required": True, "help": "target model folder"})
    stage("prompts", _prompts, "source files of the config -> prompt shards folder", ("--out", path),
          ("--target", {"type": Path, "help": "target model folder (default: the config's)"}))
    stage("target", _target, "build and teach the tiny demo target (or copy target.build.prebuilt when it was made "
          "from the same config, sources and code)", ("--out", path),
          ("--teach", {"action": "store_true", "help": "teach even when target.build.prebuilt could be copied (how "
                                                       "`make demo-target` remakes the shipped target)"}))
    stage("generate", _generate, "prompt shard -> completion shard",
          ("--prompts", path), target, ("--out", path),
          ("--summary", {"type": Path, "help": "also write the shard's summary JSON here"}))
    stage("validate", _validate, "completion shard -> validated, rejected shards + QA JSON",
          ("--completions", path), ("--validated", path), ("--rejected", path), ("--qa", path),
          ("--exclude", {"type": Path, "nargs": "*", "help": "exclusion id files (default: the config's validate.exclude)"}),
          ("--target", {"type": Path, "help": "target model folder, for its special tokens (default: the config's)"}))
    stage("tokenize", _tokenize, "validated shard -> tokenized rows (.safetensors + .json index)",
          ("--validated", path), target, ("--out", path), ("--index", path))
    stage("hidden", _hidden, "tokenized shard -> selected target layer features",
          ("--tokenized", path), target, ("--out", path))
    stage("train", _train, "tokenized + hidden shards -> drafter checkpoint folder",
          ("--tokenized", paths), ("--hidden", {"type": Path, "nargs": "*", "help": "none with train.hidden_states: online"}),
          target, ("--out", path))
    stage("eval", _eval, "held-out prompts -> acceptance length per category (JSON)",
          ("--checkpoint", path), target, ("--heldout", path), ("--out", path))
    stage("report", _report, "stage outputs -> summary HTML + JSON",
          ("--manifest", path), ("--qa", path), ("--gates", path), ("--checkpoint", path),
          ("--eval", path), ("--html", path), ("--json", path))
    stage("cache-size", _cache_size, "the hidden-state cache a run would write (tokens x layers x hidden x bytes)",
          ("--tokens", {"type": amount, "help": "planned token count (e.g. 1.64e9)"}),
          ("--tokenized", {"type": Path, "nargs": "*", "help": "tokenized shard indexes (.json) to count"}),
          ("--target", {"type": Path, "help": "target model folder (default: the config's)"}))
    stage("plan", _plan, "forecast output tokens, hours, cost, sizes and jobs per node kind (before renting)",
          ("--prompts", {"type": amount, "help": "training prompts (default: the manifest, else the sources counted)"}),
          ("--output-tokens", {"type": amount, "help": "total output tokens, e.g. 1.64e9 (default: from the pilot)"}),
          ("--mean-output-tokens", {"type": amount, "help": "output tokens per prompt, instead of a total (as "
                                                            "plan.mean_output_tokens: the prompts x this)"}),
          ("--heldout", {"type": amount, "help": "held-out prompts the eval decodes, with --prompts (default: unknown)"}),
          ("--pilot", {"type": Path, "help": "the pilot's summary (default: <output_dir>/pilot/summary.json if there)"}),
          ("--target", {"type": Path, "help": "target model folder, to size the hidden-state cache (default: the config's)"}),
          ("--json", {"type": Path, "help": "also write the plan as JSON here"}))
    stage("serve-command", _serve_command, "the vLLM and SGLang commands that serve the target with a trained drafter",
          ("checkpoint", {"type": Path, "help": "the drafter checkpoint folder (results/checkpoints/<run>)"}),
          ("--target", {"type": Path, "help": "target model folder or name (default: the config's)"}))
    stage("safe-to-destroy", _safe_to_destroy, "is every output of this machine in the storage? (exit 0: yes)",
          ("--prefix", {"help": "the run's --default-storage-prefix, e.g. s3://bucket/run (none: a run "
                                "without storage, whose every output here is at risk)"}),
          ("--workdir", {"type": Path, "default": Path("."), "help": "where snakemake runs (default: here)"}))


def add_inspect(sub, common: argparse.ArgumentParser) -> None:
    inspect = sub.add_parser(
        "inspect", parents=[common], help="print records of any stage's shard (local or s3://), filtered",
        description="Print the records of prompt, completion, validated, rejected, tokenized or hidden-state "
                    "shards, local or s3:// (boto3; AWS_ENDPOINT_URL for other S3 servers), or an eval report's "
                    "figures per category. Filters combine.")
    inspect.add_argument("shards", nargs="+",
                         help="shard files (.jsonl.zst, .jsonl, .safetensors), a stage's output folder (its shards) or "
                              "an eval report (eval/<run>.json)")
    for flag, what in [("--category", "category"), ("--reason", "rejection reason code"), ("--flag", "QA flag code"),
                       ("--id", "record or prompt id")]:
        inspect.add_argument(flag, action="append", default=[], help=f"only this {what} (repeatable)")
    inspect.add_argument("--limit", type=count(0), default=10, help="at most this many records (0: all; default 10)")
    inspect.add_argument("--json", action="store_true", help="whole records, one JSON object per line")
    inspect.add_argument("--full", action="store_true", help="do not shorten long texts")
    inspect.add_argument("--target", type=Path, help="target model folder: decode tokenized rows")
    inspect.set_defaults(run=_inspect)


def add_adopt(sub, common: argparse.ArgumentParser) -> None:
    adopt = sub.add_parser(
        "adopt", parents=[common], help="logged SGLang/vLLM chat completions -> a completion shard (no generation)",
        description="Turn logged chat-completion exchanges ({request, response} lines, or OpenAI batch lines; "
                    "local or s3://) into completion records, text rebuilt as the model emitted it. In a "
                    "pipeline run, give the files as prompt sources with format: chat_completions instead.")
    adopt.add_argument("logs", nargs="+", help="JSONL or JSONL.zst files of logged exchanges")
    adopt.add_argument("--target", type=Path, required=True, help="target model folder (its tokenizer)")
    adopt.add_argument("--out", type=Path, required=True, help="completion shard to write (.jsonl.zst)")
    adopt.add_argument("--server", choices=["auto", *LOGGING_SERVERS], default="auto")
    adopt.add_argument("--tool-format", choices=["xml", "hermes"], default="xml")
    adopt.add_argument("--category", choices=CATEGORIES,
                       help="category of lines that carry none (default: other)")
    adopt.add_argument("--no-thinking", action="store_true", help="requests without enable_thinking had it off")
    adopt.set_defaults(run=_adopt)


def add_check(sub, common: argparse.ArgumentParser) -> None:
    check = sub.add_parser("check", parents=[common], help="answers about a run's outputs, verdict first",
                           description="Answers about a run's outputs (local or s3://), verdict first.")
    checks = check.add_subparsers(dest="what", required=True, metavar="WHAT")
    tools = checks.add_parser(
        "tools", parents=[common], help="can the tool records teach calling tools? (exit 3: not usable)",
        description="Whether a finished run's tool records (or another --category's) are usable: a verdict line "
                    "(usable / usable with caveats / not usable, exit status 3) with the numbers behind it, then "
                    "records kept and rejected by reason, kept records that call a tool, answer in prose or "
                    "refuse, calls per tool against the tools offered, the argument-schema pass rate, how "
                    "replayed conversations ended, tag loops, and examples of each.")
    tools.add_argument("output_dir", help="the run's output_dir: results, or s3://bucket/prefix/results")
    tools.add_argument("--category", default=TOOL_CATEGORY, help=f"the category to check (default: {TOOL_CATEGORY})")
    tools.add_argument("--config", type=Path, help="read the gates' thresholds from this config "
                                                   "(default: the schema's defaults)")
    tools.add_argument("--examples", type=count(0), default=3, help="examples per class (default 3; 0: none)")
    tools.add_argument("--json", action="store_true", help="everything as one JSON object")
    tools.set_defaults(run=_check_tools)
    run = checks.add_parser(
        "run", parents=[common], help="a finished run's headline, as its console showed it",
        description="The headline a run printed when it wrote its report (records kept, trainable tokens, "
                    "acceptance, gates, generation's time and cost), read from report/summary.json.")
    run.add_argument("output_dir", help="the run's output_dir: results, or s3://bucket/prefix/results")
    run.set_defaults(run=_check_run)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging()
    exit_on_sigterm(f"dflash {args.stage} stopped; its unfinished outputs are removed")
    if clash := path_clash(args):
        print(f"dflash {args.stage}: {clash}", file=sys.stderr)
        return 2
    try:
        if hasattr(args, "run"):  # needs no pipeline config
            return args.run(args)
        try:
            cfg = load_config(args.config)
        except (ConfigError, FileNotFoundError) as e:
            print(f"dflash {args.stage}: {describe(e)}", file=sys.stderr)
            return 2
        set_threads(args.threads or cfg["threads"])
        args.fn(cfg, args)
        return 0
    except BrokenPipeError:  # piped into head
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if getattr(args, "debug", False) or debug_requested():
            raise
        print(f"dflash {args.stage}: {describe(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
