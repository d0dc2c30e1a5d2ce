"""Validation quality on the labelled cases of issue 43 (tests/labelled_cases.py): every shape of
real Qwen3.6 data the issue lists, each bad record with its good twin, plus ordinary records of
each category, validated as one shard with the running code's default validate config.

Per shape and overall: recall (bad records rejected with one of their expected codes), bad records
rejected for another code or only flagged, precision (rejected records that are bad) and the share
of good records kept. It runs on older code too: the config comes from the running code's schema,
and a code that code does not have simply never fires. The cases module is found by this file's
path, so the code measured is whatever ``dflash`` the path gives:

    cd /old/checkout && PYTHONPATH=$PWD python /this/checkout/bench/validation_quality.py

Usage: python bench/validation_quality.py [--json] [--wrong]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import dflash

CASES = Path(__file__).resolve().parents[1] / "tests" / "labelled_cases.py"


def load_cases_module():
    spec = importlib.util.spec_from_file_location("labelled_cases", CASES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--wrong", action="store_true", help="also list every case judged wrong, with its codes")
    args = ap.parse_args()
    lc = load_cases_module()
    cases = lc.cases()
    judged = lc.verdicts(cases)
    figures = lc.scores(cases, judged)
    if args.json:
        print(json.dumps({"dflash": str(Path(dflash.__file__).parent), "cases": len(cases), "figures": figures}))
        return
    print(f"dflash measured: {Path(dflash.__file__).parent}; {len(cases)} cases")
    head = f"{'shape':26} {'bad':>4} {'caught':>6} {'other':>5} {'flag':>4} {'miss':>4} {'good':>4} {'kept':>4}" \
           f" {'recall':>7} {'precis.':>7} {'kept%':>7}"
    print(head)
    print("-" * len(head))
    for shape, f in [*((s, f) for s, f in figures.items() if s != "overall"), ("overall", figures["overall"])]:
        if shape == "overall":
            print("-" * len(head))
        print(f"{shape:26} {f['bad']:>4} {f['caught']:>6} {f['other_code']:>5} {f['flagged']:>4} {f['missed']:>4} "
              f"{f['good']:>4} {f['kept']:>4} {pct(f['recall']):>7} {pct(f['precision']):>7} {pct(f['good_kept']):>7}")
    if args.wrong:
        print("\nwrong:")
        for shape, label, codes, rec in cases:
            reasons, flags = judged[rec["id"]]
            result = lc.outcome(label, codes, reasons, flags)
            if result not in ("caught", "kept"):
                print(f"  {rec['id']}: {result}; expected {list(codes) or 'kept'}, rejected {reasons}, flagged {flags}")


if __name__ == "__main__":
    sys.exit(main())
