"""Quality gates: thresholds over every shard's QA and token statistics, checked before any
GPU-heavy job (docs/design.md: 87% of a training set was ``OK.`` and nobody noticed until hidden states
had been extracted). The gate rule writes the QA summary only when every gate passes; hidden-state
and training jobs need that file, so a failed gate stops them all with the gate's name, its
threshold and the measured value.
"""
from __future__ import annotations

import logging
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from dflash.core.io import read_json, write_json
from dflash.core.shapes import cache_plan
from dflash.core.units import human_bytes, percent
from dflash.core.vocabulary import EXAMPLES_PER_REASON, LENGTH_BINS, TOOL_CATEGORY, length_stats
from dflash.core.workflow import to_console

log = logging.getLogger(__name__)


class GateError(RuntimeError):
    pass


def _merge_lengths(total: dict, part: dict) -> None:
    if not part["n"]:
        return
    if not total.get("n"):
        total.update(n=0, sum=0, max=0, histogram=[0] * len(part["histogram"]))
    total["n"] += part["n"]
    total["sum"] += part["sum"]
    total["max"] = max(total["max"], part["max"])
    total["histogram"] = [a + b for a, b in zip(total["histogram"], part["histogram"])]
    total["mean"] = round(total["sum"] / total["n"], 1)


def qa_summary(qa_paths: list[Path], index_paths: list[Path]) -> dict:
    """Every shard's QA counts, lengths and examples, and the tokenized rows' statistics, summed:
    the QA summary of the run that the gates, the QA page and the report read."""
    records = kept = rejected = 0
    by_check: dict[str, Counter] = defaultdict(Counter)
    actions: dict[str, str] = {}
    categories: dict[str, Counter] = defaultdict(Counter)
    lengths: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    examples: dict[str, list] = defaultdict(list)
    bins = None
    for path in qa_paths:
        qa = read_json(path)
        records, kept, rejected = records + qa["records"], kept + qa["kept"], rejected + qa["rejected"]
        for code, hit in qa["checks"].items():
            actions[code] = hit["action"]
            by_check[code].update(hit["by_category"])
        for cat, counts in qa["categories"].items():
            categories[cat].update(counts)
        bins = qa.get("length_bins", bins)
        for cat, kinds in qa.get("lengths", {}).items():
            for name, part in kinds.items():
                _merge_lengths(lengths[cat][name], part)
        for code, found in qa.get("examples", {}).items():
            examples[code].extend(found[:max(0, EXAMPLES_PER_REASON - len(examples[code]))])
    tokenized: Counter = Counter()
    trainable = defaultdict(list)
    for path in index_paths:
        index = read_json(path)
        tokenized.update({k: v for k, v in index["stats"].items() if isinstance(v, int)})
        for row in index["rows"]:
            trainable[row["category"]].append(row["trainable"])
    every = [n for rows in trainable.values() for n in rows]
    return {
        "shards": len(qa_paths), "records": records, "kept": kept, "rejected": rejected,
        "reject_rate": rejected / records if records else 0.0,
        "checks": {code: {"action": actions[code], "total": sum(c.values()), "by_category": dict(c),
                          "rate": sum(c.values()) / records if records else 0.0} for code, c in by_check.items()},
        "categories": {cat: {**c, "reject_rate": c["rejected"] / c["records"] if c["records"] else 0.0}
                       for cat, c in sorted(categories.items())},
        "length_bins": bins or LENGTH_BINS,
        "lengths": {cat: dict(kinds) for cat, kinds in sorted(lengths.items())},
        "examples": dict(examples),
        "tokenized": dict(tokenized),
        "trainable_tokens": {"rows": len(every), "total": sum(every),
                             "median": statistics.median(every) if every else 0,
                             "by_category": {c: {"rows": len(v), "total": sum(v), "median": statistics.median(v),
                                                 "histogram": length_stats(v)["histogram"]}
                                             for c, v in sorted(trainable.items())}},
    }


def write_qa_summary(qa_paths: list[Path], index_paths: list[Path], out_path: Path) -> dict:
    summary = qa_summary(qa_paths, index_paths)
    write_json(out_path, summary)
    log.info("QA summary: %d records, %d kept, %d rejected over %d shards; %d tokenized rows",
             summary["records"], summary["kept"], summary["rejected"], summary["shards"],
             summary["trainable_tokens"]["rows"])
    return summary


def evaluate_gates(summary: dict, gates: dict, cache: dict | None = None) -> list[dict]:
    """One verdict per configured gate: ``{gate, threshold, value, passed, message}``. ``cache``
    (the offline hidden-state cache: ``cache_plan`` plus ``max_bytes``) adds ``max_cache_bytes``."""
    verdicts = []

    def verdict(gate: str, value: float, passed: bool, message: str, threshold=None) -> None:
        verdicts.append({"gate": gate, "threshold": gates[gate] if threshold is None else threshold, "value": value,
                         "passed": passed, "message": f"gate {gate}: {message}"})

    if cache and cache["max_bytes"] is not None:
        verdict("max_cache_bytes", cache["bytes"], cache["bytes"] <= cache["max_bytes"],
                f"the hidden-state cache would take {cache['text']} (hidden.max_cache_bytes "
                f"{human_bytes(cache['max_bytes'])})"
                + ("" if cache["bytes"] <= cache["max_bytes"] else
                   "; set train.hidden_states: online to run the target inside the trainer instead, "
                   "or hidden.dtype: float8_e4m3fn to halve it"), threshold=cache["max_bytes"])

    if gates["max_reject_rate"] is not None:
        value = summary["reject_rate"]
        verdict("max_reject_rate", value, value <= gates["max_reject_rate"],
                f"{percent(value)} of {summary['records']} records rejected (limit {percent(gates['max_reject_rate'])})")
    if gates["max_category_reject_rate"] is not None:
        worst = max(summary["categories"].items(), key=lambda kv: kv[1]["reject_rate"], default=(None, None))
        value = worst[1]["reject_rate"] if worst[0] else 0.0
        verdict("max_category_reject_rate", value, value <= gates["max_category_reject_rate"],
                f"{percent(value)} of category {worst[0]!r} rejected (limit {percent(gates['max_category_reject_rate'])})")
    if gates["min_tool_call_share"] is not None and TOOL_CATEGORY in summary["categories"]:
        counts = summary["categories"][TOOL_CATEGORY]
        calling, kept = counts.get("kept_calling_tool", 0), counts.get("kept", 0)
        value = calling / kept if kept else 0.0
        verdict("min_tool_call_share", value, value >= gates["min_tool_call_share"],
                f"{calling} of {kept} kept {TOOL_CATEGORY!r} records call a tool ({percent(value)}, minimum "
                f"{percent(gates['min_tool_call_share'])})")
    if gates["max_trivial_share"] is not None:
        trivial = summary["checks"].get("trivial", {"total": 0})["total"]
        value = trivial / summary["records"] if summary["records"] else 0.0
        verdict("max_trivial_share", value, value <= gates["max_trivial_share"],
                f"{percent(value)} of records are trivial, {trivial} of {summary['records']} "
                f"(limit {percent(gates['max_trivial_share'])})")
    if gates["min_median_trainable_tokens"] is not None:
        value = summary["trainable_tokens"]["median"]
        verdict("min_median_trainable_tokens", value, value >= gates["min_median_trainable_tokens"],
                f"median trainable tokens per row is {value} (minimum {gates['min_median_trainable_tokens']})")
    return verdicts


def run_gates(summary_path: Path, out_path: Path, gates: dict, cache: dict | None = None) -> list[dict]:
    """The gates' verdicts on the QA summary, written only when every gate passes."""
    verdicts = evaluate_gates(read_json(summary_path), gates, cache)
    for v in verdicts:
        (log.info if v["passed"] else log.error)("%s: %s", "pass" if v["passed"] else "FAIL", v["message"])
    failed = [v["message"] for v in verdicts if not v["passed"]]
    if failed:
        output_dir = Path(summary_path).parent.parent
        tools = any(v["gate"] == "min_tool_call_share" or TOOL_CATEGORY in v["message"]
                    for v in verdicts if not v["passed"])
        raise GateError("quality gate failed, no hidden-state or training job will run:\n  " + "\n  ".join(failed)
                        + (f"\n  `dflash check tools {output_dir}` shows what the tool records do" if tools else "")
                        + f"\n(thresholds: config gates; counts and examples per check: {summary_path}, "
                        f"or the page `snakemake {output_dir / 'report' / 'qa.html'}`)")
    write_json(out_path, {"gates": verdicts})
    return verdicts


def gate_job(config: dict, summary_path: Path, target_dir: str | Path, out_path: Path) -> list[dict]:
    """The gate rule's job: the config's gates on the QA summary and, with a hidden-state cache to
    write (``train.hidden_states: offline``), its planned size against ``hidden.max_cache_bytes``.
    A failed gate ends the job (exit 1) with its verdicts in the log and on the terminal, where the
    run stops."""
    cache = None
    if config["train"]["hidden_states"] == "offline":
        tokens = read_json(summary_path)["tokenized"].get("tokens", 0)
        cache = {**cache_plan(config, target_dir, tokens), "max_bytes": config["hidden"]["max_cache_bytes"]}
    try:
        return run_gates(summary_path, out_path, config["gates"], cache)
    except GateError as e:
        to_console(f"\n{e}\n")
        raise SystemExit(1) from None
