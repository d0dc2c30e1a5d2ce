"""``dflash check tools``: can a run's tool-category records teach a drafter to call tools?

One verdict line first (usable / usable with caveats / not usable, with the numbers that drove
it), then what it rests on: records generated, kept and rejected by reason; what the kept
records do (call a tool, answer in prose, refuse); calls per tool against the tools offered; how
many calls pass their tool's JSON Schema; how replayed conversations ended; repeated tag runs
(loops); and a few examples of each. Read from the run's completion, validated and rejected
shards, local or ``s3://``, one record at a time: memory holds counts and examples only.
"""
from __future__ import annotations

import json
import posixpath
import re
from collections import Counter, defaultdict
from pathlib import Path

from dflash.core.config import defaults, load_config
from dflash.core.io import SHARD_RE, iter_jsonl_lines
from dflash.core.loops import LOOP_MIN_REPEATS, loop_patterns
from dflash.core.reasons import ANCHORS, BAD_CALL, calls_a_tool, excerpt
from dflash.core.storage import folder_files, local_copy
from dflash.core.toolcalls import call_problems
from dflash.core.units import percent
from dflash.core.vocabulary import TAGS, TOOL_CATEGORY, terminal_safe
from dflash.inspect.files import check_filters

# The verdict. "not usable" comes from the two gates (gates.max_category_reject_rate and
# gates.min_tool_call_share, read from the config or the schema's defaults, so the check and the
# run's gates agree); "caveats" from what the gates do not look at:
SCHEMA_PASS_CAVEAT = 0.95  # under it, more than one call in 20 names wrong or untyped arguments
LOOP_CAVEAT_SHARE = 0.01  # tag loops in over 1% of the records: the target degenerates often, and
#                           the checks that reject them cost generation time
REPLAY_COMPLETED_CAVEAT = 0.5  # under half the replayed conversations reach their answer: few
#                                multi-step examples survive

# A refusal: an answer with no tool call whose opening (REFUSAL_CHARS characters, tags left out)
# says the model cannot or will not do it. A heuristic: "I can't stress enough" at the start counts.
REFUSAL = re.compile(r"\b(?:I(?:\s+am|['’]m)\s+(?:not\s+able|unable|not\s+allowed)|"
                     r"I\s+(?:cannot|can['’]?t|can\s+not|won['’]t|will\s+not|do\s+not\s+have\s+access|"
                     r"don['’]t\s+have\s+access)|unable\s+to\s+(?:help|assist|access|do|complete|provide))\b", re.I)
REFUSAL_CHARS = 300

KEPT_CLASSES = ("calls", "prose", "refusal", "bad_call")
CLASS_TEXT = {"calls": "call a tool", "prose": "answer in prose", "refusal": "refuse",
              "bad_call": "hold a broken call (its check only flags)"}
EXCERPT_CHARS = 160
STAGES = ("completions", "validated", "rejected")
TOKEN_IDS = ("prompt_token_ids", "output_token_ids")  # never read here: left unparsed


def is_refusal(answer: str) -> bool:
    return bool(REFUSAL.search(TAGS.sub(" ", answer)[:REFUSAL_CHARS]))


def kept_class(rec: dict) -> str:
    """What a kept record does: calls (a valid call), bad_call (a call a flag-only check faults),
    refusal, or prose."""
    qa = rec.get("qa") or {}
    if calls_a_tool(qa):
        return "calls"
    if qa.get("tool_calls"):
        return "bad_call"
    return "refusal" if is_refusal(rec.get("content") or "") else "prose"


def _line(text: str, chars: int = EXCERPT_CHARS, tail: bool = False) -> str:
    """One line of at most ``chars`` characters: line breaks shown as ↵, runs of spaces as one."""
    text = re.sub(r"[ \t]+", " ", text.strip()).replace("\n", "↵")
    if len(text) <= chars:
        return text
    return "…" + text[-chars + 1:] if tail else text[:chars - 1] + "…"


def _call_text(call: dict) -> str:
    return f"{call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})"


class Tally:
    """The counts of one category, fed one record at a time."""

    def __init__(self, category: str, examples: int):
        self.category, self.max_examples = category, examples
        self.records = self.kept = self.rejected = 0
        self.reasons: Counter = Counter()
        self.classes: Counter = Counter()
        self.prose_closing_replay = 0
        self.offered: Counter = Counter()  # records offering each tool
        self.called: Counter = Counter()  # calls naming it, in kept and rejected records
        self.called_kept: Counter = Counter()
        self.not_offered: Counter = Counter()  # calls naming it in a record that does not offer it
        self.schema = Counter()  # calls: parsed, to_offered (tools the record offers), passed; kept_*: in kept records
        self.schema_failures: Counter = Counter()
        self.replay_stops: Counter = Counter()
        self.replay_conversations = self.replay_records = 0
        self.loops: dict[str, Counter] = defaultdict(Counter)  # unit -> records, kept, longest
        self.loop_records = 0
        self.examples: dict[str, list[dict]] = defaultdict(list)

    def _example(self, key: str, rec: dict, text: str, detail: str | None = None) -> None:
        if len(self.examples[key]) < self.max_examples:
            self.examples[key].append({"id": rec["id"], **({"detail": detail} if detail else {}), "excerpt": text})

    def completion(self, rec: dict) -> None:
        self.records += 1
        replay = rec.get("replay")
        if replay:
            self.replay_records += 1
            self.replay_conversations += replay["step"] == 0
            if replay.get("stop"):
                self.replay_stops[replay["stop"]] += 1

    def judged(self, rec: dict, kept: bool) -> None:
        qa = rec.get("qa") or {}
        offered = {t["function"]["name"]: t["function"] for t in rec.get("tools") or []}
        self.offered.update(offered.keys())
        for call in qa.get("tool_calls") or []:
            name = call["name"]
            self.called[name] += 1
            self.called_kept[name] += kept
            self.schema["parsed"] += 1
            if name not in offered:
                self.not_offered[name] += 1
                self.schema["kept_not_offered"] += kept
                continue
            self.schema["to_offered"] += 1
            problems = call_problems(name, call["arguments"], offered)
            self.schema["passed"] += not problems
            self.schema["kept_to_offered"] += kept
            self.schema["kept_failed"] += kept and bool(problems)
            self.schema_failures.update({code for code, _ in problems})
        loops = loop_patterns(rec.get("text") or "")
        self.loop_records += bool(loops)
        for unit, longest in loops.items():
            name = " ".join(unit)
            self.loops[name].update(records=1, kept=int(kept))
            self.loops[name]["longest"] = max(self.loops[name]["longest"], longest)
            text = rec.get("text") or ""
            at = re.search(r"\s*".join(map(re.escape, unit)), text)
            self._example(f"loop {name}", rec, _line(text[at.start() if at else 0:]), f"{longest} in a row")
        if kept:
            self.kept += 1
            cls = kept_class(rec)
            self.classes[cls] += 1
            closing = cls == "prose" and (rec.get("replay") or {}).get("stop") == "completed"
            self.prose_closing_replay += closing
            if cls in ("calls", "bad_call"):
                text = "; ".join(map(_call_text, qa["tool_calls"]))
                detail = ", ".join(c for c in qa.get("flags", []) if c in BAD_CALL) or None
            else:
                text = TAGS.sub(" ", rec.get("content") or "")
                detail = "closes a replayed conversation" if closing else None
            self._example(cls, rec, _line(text), detail)
            return
        self.rejected += 1
        for code in qa.get("reasons", []):
            self.reasons[code] += 1
            # where the problem shows: around its anchor, else the end of the text
            detail = str((qa.get("details") or {}).get(code, code))
            self._example(f"rejected {code}", rec, _line(excerpt(rec, code), tail=code not in ANCHORS),
                          None if detail == code else detail)

    def result(self) -> dict:
        to_offered = self.schema["to_offered"]
        return {
            "category": self.category,
            "records": self.records, "kept": self.kept, "rejected": self.rejected,
            "reject_rate": self.rejected / self.records if self.records else 0.0,
            "rejected_by_reason": dict(self.reasons.most_common()),
            "kept_classes": {c: self.classes[c] for c in KEPT_CLASSES},
            "call_share": self.classes["calls"] / self.kept if self.kept else 0.0,
            "prose_closing_replay": self.prose_closing_replay,
            "tools": {name: {"offered": self.offered[name], "called": self.called[name],
                             "called_in_kept": self.called_kept[name], "called_not_offered": self.not_offered[name]}
                      for name in sorted(set(self.offered) | set(self.called),
                                         key=lambda n: (-self.offered[n], -self.called[n], n))},
            "never_offered": sorted(set(self.called) - set(self.offered)),
            "schema": {"calls": self.schema["parsed"], "to_offered_tools": to_offered, "passed": self.schema["passed"],
                       "pass_rate": self.schema["passed"] / to_offered if to_offered else None,
                       "failures": dict(self.schema_failures.most_common()),
                       "kept": {"to_offered_tools": self.schema["kept_to_offered"],
                                "failed": self.schema["kept_failed"], "not_offered": self.schema["kept_not_offered"]}},
            "replay": {"conversations": self.replay_conversations, "records": self.replay_records,
                       "stops": dict(self.replay_stops.most_common())},
            "loops": {"records": self.loop_records, "patterns": {
                u: dict(c) for u, c in sorted(self.loops.items(), key=lambda kv: -kv[1]["records"])}},
            # kept classes, then rejection reasons and loops, most frequent first
            "examples": {key: self.examples[key] for key in [
                *KEPT_CLASSES, *(f"rejected {code}" for code, _ in self.reasons.most_common()),
                *(f"loop {unit}" for unit, _ in sorted(self.loops.items(), key=lambda kv: -kv[1]["records"]))]
                if self.examples.get(key)},
        }


def verdict(r: dict, gates: dict, output_dir: str = "results") -> dict:
    """``{verdict, failed, caveats, next, target, line}``. The line leads with what training will
    see, the kept records; then the gate that failed (not usable: the category's reject rate, and for
    the tool category the share of kept records that call a tool) or the caveats on the kept records
    the gates do not see (calls failing their schema or naming a tool not offered, tag loops,
    replays that stop early, broken calls kept); then the next step. ``target``: what the target did
    on every record, rejected ones included."""
    cat, records, kept, classes = r["category"], r["records"], r["kept"], r["kept_classes"]
    folder = lambda stage: posixpath.join(str(output_dir), stage)  # noqa: E731
    top = next(iter(r["rejected_by_reason"]), None)
    reasons = ", ".join(f"{code} {n}" for code, n in list(r["rejected_by_reason"].items())[:4])
    if cat == TOOL_CATEGORY and kept:
        trained = (f"you will train on {kept} {cat} records: {classes['calls']} call a tool "
                   f"({percent(r['call_share'])}), {classes['prose']} answer in prose, {classes['refusal']} refuse"
                   + (f", {classes['bad_call']} hold a broken call" if classes["bad_call"] else ""))
    else:
        trained = f"you will train on {kept} of {records} {cat} records"
    fails, caveats = [], []  # (text, next step)
    if not records:
        fails.append((f"no {cat} records", f"check that {output_dir} is the run's output folder and that its "
                                            f"prompts have {cat} ones ({folder('prompts/manifest.json')})"))
    elif not kept:
        fails.append((f"none of {records} kept ({reasons})", f"dflash inspect {folder('rejected')} --category {cat}"))
    share = gates.get("min_tool_call_share")
    if cat == TOOL_CATEGORY and kept and share is not None and r["call_share"] < share:
        fails.append((f"{percent(r['call_share'])} call a tool, under gates.min_tool_call_share {percent(share)}",
                      f"dflash inspect {folder('validated')} --category {cat}: what the kept records do instead"))
    limit = gates.get("max_category_reject_rate")
    if records and kept and limit is not None and r["reject_rate"] > limit:
        fails.append((f"{percent(r['reject_rate'])} of {records} rejected, over gates.max_category_reject_rate "
                      f"{percent(limit)} ({reasons})", f"dflash inspect {folder('rejected')} --category {cat} "
                                                       f"--reason {top}"))
    in_kept = r["schema"]["kept"]
    if in_kept["to_offered_tools"] and in_kept["failed"] > (1 - SCHEMA_PASS_CAVEAT) * in_kept["to_offered_tools"]:
        caveats.append((f"{in_kept['failed']} of their {in_kept['to_offered_tools']} calls to offered tools fail the "
                        f"tool's schema (its check set to flag)", f"dflash inspect {folder('validated')} --category "
                                                                   f"{cat} --flag tool_args_schema"))
    if in_kept["not_offered"]:
        caveats.append((f"{in_kept['not_offered']} of their calls name a tool the record does not offer",
                        f"dflash inspect {folder('validated')} --category {cat} --flag tool_unknown_name"))
    loops = r["loops"]
    kept_loops = sum(p["kept"] for p in loops["patterns"].values())
    if kept_loops:
        unit = next(u for u, p in loops["patterns"].items() if p["kept"])
        caveats.append((f"tag loops in {kept_loops} of them, most often {unit!r}",
                        f"dflash inspect {folder('validated')} --category {cat} --flag repetition_loop"))
    replay = r["replay"]
    completed = replay["stops"].get("completed", 0)
    if replay["conversations"] and completed < REPLAY_COMPLETED_CAVEAT * replay["conversations"]:
        caveats.append((f"{completed} of {replay['conversations']} replayed conversations reach their end (few "
                        f"multi-step examples)", "see how they ended (replayed conversations, below): a replay stops "
                                                 "at the first turn the target answers otherwise"))
    if classes["bad_call"] and not caveats:  # the broken calls' kind, when a caveat above did not name it
        caveats.append((f"{classes['bad_call']} of them hold a broken call",
                        "set the call checks to reject (validate.checks), or drop the ids (validate.exclude)"))
    word = "not usable" if fails else "usable with caveats" if caveats else "usable"
    named = fails + caveats
    line = (f"{word}: {trained}" + "".join(f"; {text}" for text, _ in named)
            + (f"; next: {named[0][1]}" if named else ""))
    schema = r["schema"]
    not_offered = sum(t["called_not_offered"] for t in r["tools"].values())
    target = (f"the target, on all {records} {cat} records: {percent(r['reject_rate'])} rejected"
              + (f" ({reasons})" if reasons else "")
              + (f"; {schema['passed']} of {schema['to_offered_tools']} calls to offered tools pass their schema "
                 f"({percent(schema['pass_rate'])})" if schema["pass_rate"] is not None else "")
              + (f"; {not_offered} calls name a tool not offered" if not_offered else "")
              + (f"; tag loops in {loops['records']} records" if loops["records"] else ""))
    return {"verdict": word, "failed": [t for t, _ in fails], "caveats": [t for t, _ in caveats],
            "next": named[0][1] if named else None, "target": target, "line": line}


def _is_s3(path: str) -> bool:
    return str(path).startswith("s3://")


def _join(base: str, *parts: str) -> str:
    # posixpath, not Path: it keeps the "//" of s3:// URLs
    return posixpath.join(str(base), *parts)


def shard_paths(folder: str) -> list[str] | None:
    """The record shards of a stage folder (shard-NNNNN.jsonl.zst; dot-files are resume files and
    locks, never shards), sorted; None when the folder is not there."""
    return folder_files(folder, SHARD_RE.match)


def run_shards(output_dir: str) -> dict[str, list[str]]:
    """The shards of each stage, once every prompt shard has its completions, validated and rejected
    shards; else a ValueError naming what is missing and what to run."""
    if not _is_s3(output_dir) and not Path(output_dir).is_dir():
        raise FileNotFoundError(f"{output_dir}: no such folder; give the run's output_dir "
                                f"(e.g. results, or s3://bucket/prefix/results)")
    found = {stage: shard_paths(_join(output_dir, stage)) for stage in ("prompts", *STAGES)}
    expected = {posixpath.basename(p) for p in found["prompts"] or found["completions"] or []}
    for stage in STAGES:
        have = {posixpath.basename(p) for p in found[stage] or []}
        if not expected or not have:
            raise ValueError(f"{_join(output_dir, stage)}: no shards: the run has not "
                             f"{'generated' if stage == 'completions' else 'validated'} anything yet; run snakemake "
                             f"(e.g. `snakemake --cores all`), then check again")
        missing = sorted(expected - have)
        if missing:
            raise ValueError(f"{_join(output_dir, stage)}: {len(have & expected)} of {len(expected)} shards (missing "
                             f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the run is unfinished; "
                             f"let snakemake finish (or run it again), then check again")
    return {stage: found[stage] for stage in STAGES}


def _records(path: str):
    """The records of one shard, token ids left unparsed; an s3 shard through a temp copy, its
    errors naming the URL."""
    with local_copy(path) as local:
        try:
            for _, rec in iter_jsonl_lines(local, skip_arrays=TOKEN_IDS):
                yield rec
        except ValueError as e:
            raise ValueError(str(e).replace(str(local), str(path))) from None


def check_tools(output_dir: str, gates: dict, category: str = TOOL_CATEGORY, examples: int = 3) -> dict:
    """Everything ``dflash check tools`` reports on one category of a finished run, verdict first."""
    shards = run_shards(str(output_dir).rstrip("/"))
    tally = Tally(category, examples)
    for path in shards["completions"]:
        for rec in _records(path):
            if rec.get("category") == category:
                tally.completion(rec)
    for stage in ("validated", "rejected"):
        for path in shards[stage]:
            for rec in _records(path):
                if rec.get("category") == category:
                    tally.judged(rec, stage == "validated")
    result = tally.result()
    if result["records"] != result["kept"] + result["rejected"]:
        raise ValueError(f"{output_dir}: {result['records']} {category} completion records, but {result['kept']} "
                         f"validated + {result['rejected']} rejected: the validated shards are not of these "
                         f"completions; run snakemake to validate them again, then check again")
    thresholds = {k: gates.get(k) for k in ("max_category_reject_rate", "min_tool_call_share")}
    return {**verdict(result, thresholds, str(output_dir).rstrip("/")), "output_dir": str(output_dir),
            "shards": len(shards["completions"]),
            "thresholds": thresholds, **result}


def render(r: dict) -> str:
    """The report for a terminal: the verdict line, then the counts, then the examples."""
    cat, kept = r["category"], r["kept"]
    thresholds = ", ".join(f"{k} {'off' if v is None else percent(v)}" for k, v in r["thresholds"].items())
    out = [r["line"], r["target"], "",
           f"{r['output_dir']}: category {cat}, {r['shards']} shards (gates: {thresholds})",
           f"records     {r['records']} generated, {kept} kept, {r['rejected']} rejected ({percent(r['reject_rate'])})"]
    if r["rejected_by_reason"]:
        out.append("rejected by reason (a record can have several):")
        out += [f"  {code:<24}{n:>6}" for code, n in r["rejected_by_reason"].items()]
    out.append("kept records:")
    for cls in KEPT_CLASSES:
        n = r["kept_classes"][cls]
        if n or cls != "bad_call":
            closing = (f" ({r['prose_closing_replay']} close a replayed conversation)"
                       if cls == "prose" and r["prose_closing_replay"] else "")
            out.append(f"  {CLASS_TEXT[cls]:<24}{n:>6}  {percent(n / kept) if kept else '-':>6}{closing}")
    if r["tools"]:
        width = max(24, *(len(n) + 2 for n in r["tools"]))
        columns = ("offered", "called", "kept calls", "unoffered calls")
        out.append(f"{'tool':<{width}}" + "".join(f"{c:>{len(c) + 2}}" for c in columns))
        for name, t in r["tools"].items():
            never = "  (never offered)" if name in r["never_offered"] else ""
            values = (t["offered"], t["called"], t["called_in_kept"], t["called_not_offered"])
            out.append(f"  {name:<{width - 2}}" + "".join(f"{v:>{len(c) + 2}}" for c, v in zip(columns, values))
                       + never)
        out.append("  (offered: records offering it; called: its calls in kept and rejected records; kept calls: in "
                   "the records you will train on; unoffered calls: in a record that does not offer it)")
    s = r["schema"]
    if s["calls"]:
        failures = ", ".join(f"{c} {n}" for c, n in s["failures"].items())
        out.append(f"argument schemas: {s['passed']} of {s['to_offered_tools']} calls to offered tools pass"
                   + (f" ({percent(s['pass_rate'])})" if s["pass_rate"] is not None else "")
                   + (f"; failing: {failures}" if failures else "")
                   + (f"; {s['calls'] - s['to_offered_tools']} more name a tool not offered"
                      if s["calls"] > s["to_offered_tools"] else ""))
    else:
        out.append("argument schemas: no parsed calls")
    rp = r["replay"]
    if rp["conversations"]:
        stops = ", ".join(f"{k} {n}" for k, n in rp["stops"].items())
        out.append(f"replayed conversations: {rp['conversations']} ({rp['records']} records), ended: {stops}")
    loops = r["loops"]
    out.append(f"tag loops ({LOOP_MIN_REPEATS}+ in a row): "
               + (f"{loops['records']} records" if loops["records"] else "none"))
    for unit, p in loops["patterns"].items():
        out.append(f"  {unit!r}: {p['records']} records ({p['kept']} kept), up to {p['longest']} in a row")
    if r["examples"]:
        out.append("examples:")
        for key, found in r["examples"].items():
            out.append(f"  {CLASS_TEXT.get(key, key)}:")
            for ex in found:
                out.append(f"    {ex['id']}" + (f"  [{ex['detail']}]" if ex.get("detail") else ""))
                out.append(f"      {ex['excerpt']}")
    return terminal_safe("\n".join(out))


def check_tools_command(output_dir: str, category: str, config_path: Path | None, examples: int,
                        as_json: bool) -> int:
    """``dflash check tools``: the verdict and the numbers behind it, with the gates' thresholds of
    ``config_path`` (else the schema's defaults); exit status 3 when not usable."""
    check_filters(category=[category])
    gates = load_config(config_path)["gates"] if config_path else defaults("gates")
    result = check_tools(output_dir, gates, category, examples)
    print(terminal_safe(json.dumps(result, indent=1, ensure_ascii=False), json_escapes=True) if as_json
          else render(result))
    return 3 if result["verdict"] == "not usable" else 0
