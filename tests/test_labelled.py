"""The labelled cases of issue 43 (tests/labelled_cases.py) judged by the validate stage: recall and
precision of at least 99% over all of them. bench/validation_quality.py prints the same figures per
shape (`--wrong` lists the cases judged wrong)."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from dflash.core.records import record_problem
from tests.labelled_cases import cases, scores, verdicts

CASES = cases()


def test_the_cases_are_sound():
    """Valid completion records, every bad case with its good twin, 5 to 20 pairs a shape, and no
    completion twice but where duplicate_completion means it."""
    assert not [(rec["id"], p) for *_, rec in CASES if (p := record_problem("completion", rec))]
    twins = defaultdict(set)
    for shape, label, codes, rec in CASES:
        assert (label == "bad") == bool(codes), rec["id"]
        twins[rec["id"].rsplit("-", 1)[0]].add(label)
    assert all("good" in labels for labels in twins.values())  # and good cases of their own beside a rule
    per_shape = Counter(shape for shape, label, *_ in CASES if label == "bad")
    assert all(5 <= n <= 20 for n in per_shape.values()), per_shape
    texts = Counter(rec["text"] for shape, *_, rec in CASES if shape != "duplicate_completion")
    assert texts.most_common(1)[0][1] == 1
    assert cases() == CASES  # deterministic


def test_recall_and_precision_on_the_labelled_cases():
    figures = scores(CASES, verdicts(CASES))
    overall = figures["overall"]
    assert overall["recall"] >= 0.99 and overall["precision"] >= 0.99, {
        shape: (f["recall"], f["precision"], f["good_kept"]) for shape, f in figures.items()}
