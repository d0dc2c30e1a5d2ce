"""Quality gates: thresholds over every shard's QA and token statistics, checked before any
GPU-heavy job (DESIGN.md: 87% of a training set was ``OK.`` and nobody noticed until hidden states
had been extracted). The gate rule writes the QA summary only when every gate passes; hidden-state
and training jobs need that file, so a failed gate stops them all with the gate's name, its
threshold and the measured value.
"""
from __future__ import annotations

import logging
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from dflash.io import read_json, write_json

log = logging.getLogger(__name__)


class GateError(RuntimeError):
    pass


def qa_summary(qa_paths: list[Path], index_paths: list[Path]) -> dict:
    """Every shard's QA counts and tokenized statistics summed (the QA summary of the run)."""
    records = kept = rejected = 0
    by_check: dict[str, Counter] = defaultdict(Counter)
    actions: dict[str, str] = {}
    categories: dict[str, Counter] = defaultdict(Counter)
    for path in qa_paths:
        qa = read_json(path)
        records, kept, rejected = records + qa["records"], kept + qa["kept"], rejected + qa["rejected"]
        for code, hit in qa["checks"].items():
            actions[code] = hit["action"]
            by_check[code].update(hit["by_category"])
        for cat, counts in qa["categories"].items():
            categories[cat].update(counts)
    trainable = defaultdict(list)
    for path in index_paths:
        for row in read_json(path)["rows"]:
            trainable[row["category"]].append(row["trainable"])
    every = [n for rows in trainable.values() for n in rows]
    return {
        "shards": len(qa_paths), "records": records, "kept": kept, "rejected": rejected,
        "reject_rate": rejected / records if records else 0.0,
        "checks": {code: {"action": actions[code], "total": sum(c.values()), "by_category": dict(c),
                          "rate": sum(c.values()) / records if records else 0.0} for code, c in by_check.items()},
        "categories": {cat: {**c, "reject_rate": c["rejected"] / c["records"] if c["records"] else 0.0}
                       for cat, c in sorted(categories.items())},
        "trainable_tokens": {"rows": len(every), "total": sum(every),
                             "median": statistics.median(every) if every else 0,
                             "median_by_category": {c: statistics.median(v) for c, v in sorted(trainable.items())}},
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def evaluate_gates(summary: dict, gates: dict) -> list[dict]:
    """One verdict per configured gate: ``{gate, threshold, value, passed, message}``."""
    verdicts = []

    def verdict(gate: str, value: float, passed: bool, message: str) -> None:
        verdicts.append({"gate": gate, "threshold": gates[gate], "value": value, "passed": passed,
                         "message": f"gate {gate}: {message}"})

    if gates["max_reject_rate"] is not None:
        value = summary["reject_rate"]
        verdict("max_reject_rate", value, value <= gates["max_reject_rate"],
                f"{_pct(value)} of {summary['records']} records rejected (limit {_pct(gates['max_reject_rate'])})")
    if gates["max_category_reject_rate"] is not None:
        worst = max(summary["categories"].items(), key=lambda kv: kv[1]["reject_rate"], default=(None, None))
        value = worst[1]["reject_rate"] if worst[0] else 0.0
        verdict("max_category_reject_rate", value, value <= gates["max_category_reject_rate"],
                f"{_pct(value)} of category {worst[0]!r} rejected (limit {_pct(gates['max_category_reject_rate'])})")
    if gates["max_trivial_share"] is not None:
        trivial = summary["checks"].get("trivial", {"total": 0})["total"]
        value = trivial / summary["records"] if summary["records"] else 0.0
        verdict("max_trivial_share", value, value <= gates["max_trivial_share"],
                f"{_pct(value)} of records are trivial, {trivial} of {summary['records']} "
                f"(limit {_pct(gates['max_trivial_share'])})")
    if gates["min_median_trainable_tokens"] is not None:
        value = summary["trainable_tokens"]["median"]
        verdict("min_median_trainable_tokens", value, value >= gates["min_median_trainable_tokens"],
                f"median trainable tokens per row is {value} (minimum {gates['min_median_trainable_tokens']})")
    return verdicts


def run_gates(qa_paths: list[Path], index_paths: list[Path], out_path: Path, gates: dict) -> dict:
    """The QA summary with the gates' verdicts, written only when every gate passes."""
    summary = qa_summary(qa_paths, index_paths)
    summary["gates"] = evaluate_gates(summary, gates)
    for v in summary["gates"]:
        (log.info if v["passed"] else log.error)("%s: %s", "pass" if v["passed"] else "FAIL", v["message"])
    failed = [v["message"] for v in summary["gates"] if not v["passed"]]
    if failed:
        raise GateError("quality gate failed, no hidden-state or training job will run:\n  " + "\n  ".join(failed)
                        + "\n(thresholds: config gates; per-check counts: results/qa/shard-N.json)")
    write_json(out_path, summary)
    return summary
