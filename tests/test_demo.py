"""The demo as a new user runs it: the repository's config.yaml, its data and its shipped target,
through Snakemake up to the gates. The counts must be the README's: a user comparing their run
with the README sees the same records kept and rejected, the same tool calls, the same tokens.
(Training and the eval, the rest of `make demo`, are timed by bench/demo_time.py.)"""
import re
import subprocess
import sys

import pytest

from dflash.cli import main
from dflash.core.io import read_json
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo")
    (work / "data").symlink_to(ROOT / "data")  # config.yaml's paths are relative to the run's folder
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-d", str(work), "--configfile",
           str(ROOT / "config.yaml"), "--cores", "2", "results/qa/gates.json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    assert "target: copied data/demo/target" in run.stderr  # the shipped target, not a new one
    return work / "results"


def readme_row(figure: str) -> str:
    """The demo cell of the README's figures table."""
    row = re.search(rf"^\| {re.escape(figure)} \| (.*?) \|", README, re.M)
    assert row, f"README.md has no row '{figure}' in its demo figures table"
    return row.group(1)


def test_the_readme_states_the_demos_counts(demo):
    qa = read_json(demo / "qa" / "summary.json")
    categories = qa["categories"]
    per_category = ", ".join(f"{c} {v['reject_rate']:.0%}" for c, v in sorted(categories.items()))
    assert readme_row("records kept").startswith(
        f"{qa['kept']} of {qa['records']} ({qa['reject_rate']:.1%} rejected; a replayed tool conversation gives a "
        f"record per turn); {per_category} rejected")
    why = README[README.index("| records kept |"):].split("\n")[0]  # the row's explanation names every reason
    for check, counts in qa["checks"].items():
        assert (f"`{check}` {counts['total']}" in why) == bool(counts["total"]), check
    aborts = [read_json(p)["loop_aborts"] for p in sorted((demo / "completions").glob("*.summary.json"))]
    assert (f"`generate.loop_abort` cut {sum(a['records'] for a in aborts)} of them as soon as they certainly looped, "
            f"{sum(a['tokens_saved'] for a in aborts)} tokens not generated") in why
    tool = categories["tool"]
    assert readme_row("kept tool records that call a tool").startswith(f"{tool['kept_calling_tool']} of {tool['kept']}")
    tokens = qa["trainable_tokens"]
    assert readme_row("trainable tokens").startswith(
        f"{tokens['total']:,} in {tokens['rows']} rows (median {tokens['median']:.0f} per row)")


def test_the_readme_quotes_the_demos_tool_verdict(demo, capsys):
    """README's verdict and target lines, and docs/quality.md's sample of the whole report (its
    lines the demo's, "..." where it leaves some out), are what the check prints on the demo."""
    main(["check", "tools", str(demo)])
    out = capsys.readouterr().out.replace(str(demo), "results").splitlines()
    assert f"\n{out[0]}\n{out[1]}\n" in README
    quality = (ROOT / "docs" / "quality.md").read_text()
    sample = quality[quality.index("The demo's (`dflash check tools results`"):].split("```")[1].strip("\n").splitlines()
    assert sample[:2] == out[:2] and [line for line in sample if line.strip() != "..." and line not in out] == []


def test_the_docs_examples_name_the_demos_shards_and_ids(demo, capsys):
    """Every `dflash inspect` or `snakemake` example of the README and docs/quality.md that names a
    demo shard names one the demo has, and an --id it gives is in that shard."""
    docs = README + (ROOT / "docs" / "quality.md").read_text()
    examples = re.findall(r"(?:dflash inspect|snakemake) (results/[\w/-]*shard-\d{5}[\w.]*)([^\n`]*)", docs)
    assert len(examples) >= 4, examples
    for path, rest in examples:
        shards = sorted(demo.parent.glob(path))
        assert shards, f"{path}: the demo has no such shard"
        if found := re.search(r"--id (\w+)", rest):
            assert main(["inspect", *map(str, shards), "--id", found.group(1), "--limit", "1"]) == 0, path
            capsys.readouterr()
