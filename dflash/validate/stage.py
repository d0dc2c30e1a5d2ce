"""Validate stage: completion shard -> validated + rejected shards and a per-shard QA report.

Each check is a small function with a stable reason code; the config sets every code to
``reject``, ``flag`` or ``off``. Nothing is deleted silently: a rejected record goes to
``rejected/`` with ``qa.reasons``, and every check counts its hits per category.
"""
from __future__ import annotations

import json
import logging
import re
from collections import Counter, defaultdict
from itertools import islice
from pathlib import Path
from typing import Callable, Collection

from dflash.core.config import completed
from dflash.core.io import SHARD_RE, atomic_files, iter_jsonl, json_text, naming_full_disk, with_field, zst_lines
from dflash.core.loops import repetition_loop
from dflash.core.reasons import EXCLUDED, TOOL_CODES, calls_a_tool, excerpt
from dflash.core.records import checked_records
from dflash.core.toolcalls import check_tool_calls, json_safe, target_tool_format
from dflash.core.vocabulary import BAD_CHAR, EXAMPLES_PER_REASON, LENGTH_BINS, SCRIPTS, TAGS, length_stats
from dflash.validate.text_checks import (ShardMemory, control_token_text, duplicate_completion, language_drift,
                                         stray_think, stub_answer, target_special_tokens, thinking_in_answer,
                                         truncated_stop)

log = logging.getLogger(__name__)

VALIDATE_READS = "validate reads the completions/ shards of the generate stage"
# Scripts written without spaces count a character as a word: 用户问法国的首都是哪里 is not one word.
SUBSTANCE = re.compile(f"[{SCRIPTS['Han']}{SCRIPTS['Kana']}{SCRIPTS['Thai']}]|\\w+|[^\\w\\s]")


def substance_tokens(text: str, limit: int | None = None) -> int:
    """Words (a character, in Chinese, Japanese and Thai) and punctuation marks outside the tags: a
    tokenizer-free measure of real content, counted up to ``limit`` (enough to tell trivial from
    not without scanning a long text)."""
    return sum(1 for _ in islice(SUBSTANCE.finditer(TAGS.sub(" ", text)), limit))


def _thinking(rec: dict) -> bool:
    return bool(rec.get("generation", {}).get("enable_thinking", rec.get("reasoning") is not None))


def encoding_problem(text: str) -> str | None:
    bad = BAD_CHAR.search(text)
    if bad is None:
        return None
    char, at = bad.group(), bad.start()
    if char == "\ufffd":
        return f"U+FFFD (a replacement character) at {at}"
    if "\ud800" <= char <= "\udfff":
        return f"not encodable as UTF-8 at {at} (a lone surrogate)"
    return f"control character U+{ord(char):04X} at {at}"


# Each check returns a detail (truthy) when the record has the problem. ``ctx`` holds the parsed
# parts, the config and the shard's memory (``text_checks.ShardMemory``). The codes, their order and
# default actions are ``reasons.REASONS``'s (tests/test_config.py holds the two equal); the tool-call
# codes come from check_tool_calls, one parse of the answer as the serving engine's parser reads it
# (validate.tool_format).
CHECKS: dict[str, Callable[[dict, dict], str | bool | None]] = {
    "abort_or_error": lambda rec, ctx: (rec["finish_reason"] in ("abort", "error") or rec.get("error"))
    and (rec.get("error") or rec["finish_reason"]),
    "finish_length": lambda rec, ctx: rec["finish_reason"] == "length"
    and f"stopped at {rec['usage']['completion_tokens']} tokens",
    "no_think_close": lambda rec, ctx: _thinking(rec) and "</think>" not in rec["text"],
    "empty_reasoning": lambda rec, ctx: _thinking(rec) and not (rec.get("reasoning") or "").strip(),
    "empty_answer": lambda rec, ctx: not TAGS.sub("", rec.get("content") or "").strip() and not ctx["tool_calls"],
    "trivial": lambda rec, ctx: (n := substance_tokens(rec.get("text") or "", ctx["cfg"]["trivial_min_tokens"]))
    < ctx["cfg"]["trivial_min_tokens"]
    and f"{n} words and marks",
    "repetition_loop": lambda rec, ctx: repetition_loop(rec.get("text") or "", **ctx["cfg"]["repetition"]),
    "stray_think": lambda rec, ctx: stray_think(rec),
    "encoding": lambda rec, ctx: encoding_problem(rec.get("text") or ""),
    # the text checks (text_checks): what real Qwen3.6 completions get wrong besides loops and tool calls
    "control_token_text": lambda rec, ctx: control_token_text(rec, ctx["memory"]),
    "language_drift": lambda rec, ctx: language_drift(rec, ctx["cfg"]["drift_min_letters"]),
    "thinking_in_answer": lambda rec, ctx: thinking_in_answer(rec),
    "stub_answer": lambda rec, ctx: stub_answer(rec),
    "truncated_stop": lambda rec, ctx: truncated_stop(rec),
    "duplicate_completion": lambda rec, ctx: duplicate_completion(rec, ctx["memory"],
                                                                  ctx["cfg"]["duplicate_min_chars"]),
    **{code: (lambda rec, ctx, code=code: ctx["tool_problems"].get(code)) for code in TOOL_CODES},
}


def judge(rec: dict, cfg: dict,
          memory: ShardMemory | None = None) -> tuple[list[str], list[str], list[dict], dict[str, str]]:
    """(reasons that reject, flags that do not, parsed tool calls, detail per hit) for one record;
    ``memory`` is the shard's so far (the target's special tokens, earlier completions), else none."""
    calls, problems = check_tool_calls(rec.get("content") or "", rec.get("reasoning"), rec.get("tools"),
                                       cfg["tool_format"])
    calls = json_safe(calls)  # the record stores them, and JSON has no NaN
    ctx = {"tool_calls": calls, "tool_problems": problems, "cfg": cfg, "memory": memory or ShardMemory()}
    reasons, flags, details = [], [], {}
    for code, check in CHECKS.items():
        action = cfg["checks"].get(code, "reject")
        if action == "off":
            continue
        hit = check(rec, ctx)
        if hit:
            (reasons if action == "reject" else flags).append(code)
            details[code] = hit if isinstance(hit, str) else code
    return reasons, flags, calls, details


def example(rec: dict, code: str, detail: str, calls: list[dict]) -> dict:
    """What a reader needs to judge one hit: where, what the check saw, the text around it and,
    for tool-call problems, the offered tools and the parsed calls."""
    ex = {"id": rec["id"], "category": rec["category"], "detail": detail, "excerpt": excerpt(rec, code)}
    if code in TOOL_CODES:
        ex["offered_tools"] = [{"name": t["function"]["name"],
                                "parameters": t["function"].get("parameters")} for t in rec.get("tools") or []]
        ex["calls"] = calls
    return ex


GENERATION_SUFFIX = re.compile(r"-g\d+$")


# The reason of an id listed without one. Not its file and line: a comment added at the top of a
# list would change every later id's reason, and with it the validate params of their shards.
UNSTATED = "listed in validate.exclude"


def exclusion_file_problem(path: str | Path) -> str:
    kind = "a folder, not a file of ids" if Path(path).is_dir() else "no such file"
    return (f"validate.exclude: {path}: {kind} (paths are relative to the folder snakemake runs in): fix the path, "
            f"or take it out of the list")


def read_exclusions(paths: list[str | Path]) -> dict[str, str]:
    """Sample ids to drop, with the reason for each: a ``.jsonl`` file holds ``{"id", "reason"}``
    objects; any other file one id per line (``#`` starts a comment). A prompt id drops every
    generation of that prompt; a record id (``<prompt id>-gN``) only that generation."""
    excluded: dict[str, str] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(exclusion_file_problem(path))
        # utf-8-sig: a list saved by a Windows editor starts with a BOM, which would hide its first id
        for lineno, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
            where = f"{path}:{lineno}"
            if path.suffix == ".jsonl":
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
                except RecursionError:
                    raise ValueError(f"{where}: nested too deeply for a JSON parser; expected a flat "
                                     f'{{"id", "reason"}} object') from None
                if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                    raise ValueError(f'{where}: expected an object with a string "id" (and an optional "reason")')
                excluded[entry["id"]] = str(entry.get("reason") or UNSTATED)
            elif (sample := line.split("#", 1)[0].strip()):
                if len(sample.split()) > 1:
                    raise ValueError(f"{where}: one sample id per line, got {sample!r}")
                excluded[sample] = UNSTATED
    return excluded


def exclusions_by_shard(excluded: dict[str, str], prompts_dir: str | Path) -> tuple[dict[str, dict], list[str]]:
    """The exclusions grouped by the prompt shard ("00003") holding each id, and the ids no shard
    holds (held-out prompts, typos). Reads the prompts' id index, not the completion shards."""
    index_path = Path(prompts_dir) / "ids.tsv"
    if index_path.exists():
        shard_of = dict(line.split("\t") for line in index_path.read_text(encoding="utf-8").splitlines())
    else:  # prompts written before the index existed
        shard_of = {rec["id"]: m.group(1) for path in sorted(Path(prompts_dir).iterdir())
                    if (m := SHARD_RE.search(path.name)) for rec in iter_jsonl(path)}
    by_shard: dict[str, dict] = defaultdict(dict)
    unknown = []
    for sample, reason in sorted(excluded.items()):
        shard = shard_of.get(sample) or shard_of.get(GENERATION_SUFFIX.sub("", sample))
        if shard is None:
            unknown.append(sample)
        else:
            by_shard[shard][sample] = reason
    return dict(by_shard), unknown


def validate_settings(config: dict) -> dict:
    """The validate rule's params: the ``validate`` section but its exclusion files, whose ids
    reach each shard's job as ``excluded`` (a new id re-runs only its shard)."""
    return {k: v for k, v in config["validate"].items() if k != "exclude"}


def validate_job(config: dict, completions_path: Path, target_dir: str | Path, validated_path: Path,
                 rejected_path: Path, qa_path: Path, excluded: dict[str, str] | None) -> dict:
    """The validate stage's job (its rule's script, the pilot's and ``dflash validate``) with the
    ``validate`` section's checks; ``excluded``: the ids of this shard that ``validate.exclude``
    lists, with their reasons."""
    return validate_for_target(completions_path, validated_path, rejected_path, qa_path, validate_settings(config),
                               excluded, target_dir)


def validate_for_target(completions_path: Path, validated_path: Path, rejected_path: Path, qa_path: Path, cfg: dict,
                        excluded: dict[str, str] | None, target_dir: str | Path) -> dict:
    """:func:`validate_shard` with what the target folder tells: the special tokens
    ``control_token_text`` looks for and, with ``validate.tool_format: target``, the tool-call format
    its chat template writes (``toolcalls.target_tool_format``)."""
    if cfg["tool_format"] == "target":
        cfg = {**cfg, "tool_format": target_tool_format(target_dir)}
    return validate_shard(completions_path, validated_path, rejected_path, qa_path, cfg, excluded,
                          target_special_tokens(target_dir))


def validate_shard(completions_path: Path, validated_path: Path, rejected_path: Path, qa_path: Path,
                   cfg: dict, excluded: dict[str, str] | None = None, special_tokens: Collection[str] = ()) -> dict:
    """Judge every record of a completion shard; in == kept + rejected, always. A record whose id
    or prompt id is in ``excluded`` is rejected with reason ``EXCLUDED`` and not judged.
    ``special_tokens`` are the target's (``text_checks.target_special_tokens``), which
    ``control_token_text`` looks for.

    Records stream through: memory holds one record plus the shard's counts and lengths, and a
    digest of each completion (``duplicate_completion``)."""
    unknown = set(cfg["checks"]) - set(CHECKS)
    if unknown:
        raise ValueError(f"validate.checks: unknown check(s) {sorted(unknown)}; known: {sorted(CHECKS)}")
    # the thresholds a caller left out from the schema; a check left out stays on (reject)
    cfg = {**completed({k: v for k, v in cfg.items() if k != "checks"}, "validate"), "checks": cfg["checks"]}
    excluded = excluded or {}
    hits: dict[str, Counter] = defaultdict(Counter)
    per_cat: dict[str, Counter] = defaultdict(Counter)
    lengths: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    examples: dict[str, list[dict]] = defaultdict(list)
    seen: set[str] = set()  # a record twice would be trained twice
    memory = ShardMemory(special_tokens)
    # The three outputs appear together or not at all: rejected records alone would look like a run.
    with atomic_files(validated_path, rejected_path, qa_path) as (validated_tmp, rejected_tmp, qa_tmp):
        # zstd level 1: these shards are read once more, by tokenize; level 3 would cost a third of the stage.
        with zst_lines(validated_tmp, 1, validated_path) as keep, zst_lines(rejected_tmp, 1, rejected_path) as reject:
            # No check reads token ids: they stay unparsed, and pass through in the raw lines.
            for line, rec in checked_records(completions_path, "completion", VALIDATE_READS,
                                             skip_arrays=("prompt_token_ids", "output_token_ids")):
                if rec["id"] in seen:
                    raise ValueError(f"{completions_path}: record id {rec['id']} appears twice; every id must be "
                                     f"unique (re-run the generate rule of this shard)")
                seen.add(rec["id"])
                cat = rec["category"]
                why = excluded.get(rec["id"]) or excluded.get(rec.get("prompt_id"))
                if why:
                    reasons, flags, calls, details = [EXCLUDED], [], [], {EXCLUDED: why}
                else:
                    reasons, flags, calls, details = judge(rec, cfg, memory)
                per_cat[cat]["records"] += 1
                for code in reasons + flags:
                    hits[code][cat] += 1
                    if len(examples[code]) < EXAMPLES_PER_REASON:
                        examples[code].append(example(rec, code, details[code], calls))
                qa = {"flags": flags, "tool_calls": calls, "details": details}
                if reasons:
                    qa["reasons"] = reasons
                per_cat[cat]["rejected" if reasons else "kept"] += 1
                if not reasons and calls_a_tool(qa):
                    per_cat[cat]["kept_calling_tool"] += 1
                (reject if reasons else keep)(with_field(line, rec, "qa", qa))
                tokens = rec["usage"]["completion_tokens"]
                lengths[cat]["output_tokens"].append(tokens)
                if not reasons:
                    lengths[cat]["kept_output_tokens"].append(tokens)
                lengths[cat]["reasoning_chars"].append(len(rec.get("reasoning") or ""))
                lengths[cat]["content_chars"].append(len(rec.get("content") or ""))
        report = qa_report(completions_path, cfg, hits, per_cat, lengths, examples)
        with naming_full_disk(qa_path):
            qa_tmp.write_text(json_text(report), encoding="utf-8")
    log.info("validate %s: %d records, %d kept, %d rejected (%s)", report["shard"], report["records"], report["kept"],
             report["rejected"], ", ".join(f"{c}={n['total']}" for c, n in report["checks"].items() if n["total"])
             or "no hits")
    return report


def qa_report(completions_path: Path, cfg: dict, hits: dict, per_cat: dict, lengths: dict, examples: dict) -> dict:
    """A shard's QA report: records kept and rejected, hits per check and category, lengths, examples."""
    kept = sum(c["kept"] for c in per_cat.values())
    rejected = sum(c["rejected"] for c in per_cat.values())
    total = kept + rejected
    return {
        "shard": Path(completions_path).name,
        "records": total,
        "kept": kept,
        "rejected": rejected,
        "reject_rate": round(rejected / total, 4) if total else 0.0,
        "checks": {code: {"action": cfg["checks"].get(code, "reject"), "total": sum(hits[code].values()),
                          "by_category": dict(hits[code])} for code in [*CHECKS, EXCLUDED]},
        "categories": {cat: dict(c) for cat, c in sorted(per_cat.items())},
        "length_bins": LENGTH_BINS,
        "lengths": {cat: {name: length_stats(v) for name, v in sorted(kinds.items())}
                    for cat, kinds in sorted(lengths.items())},
        "examples": dict(examples),
    }
