"""The demo as a new user runs it: the repository's config.yaml, its data and its shipped target,
through Snakemake up to the gates. The counts must be the README's: a user comparing their run
with the README sees the same records kept and rejected, the same tool calls, the same tokens.
(Training and the eval, the rest of `make demo`, are timed by bench/demo_time.py.)"""
import re
import subprocess
import sys

import pytest

from dflash.cli import main
from dflash.io import read_json
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
    why = README[README.index("| records kept |"):].split("\n")[0]  # the row's explanation names the reasons
    for check in ("tool_unknown_name", "tool_args_schema", "tool_missing_required", "finish_length", "repetition_loop"):
        assert f"`{check}` {qa['checks'][check]['total']}" in why, check
    tool = categories["tool"]
    assert readme_row("kept tool records that call a tool").startswith(f"{tool['kept_calling_tool']} of {tool['kept']}")
    tokens = qa["trainable_tokens"]
    assert readme_row("trainable tokens").startswith(
        f"{tokens['total']:,} in {tokens['rows']} rows (median {tokens['median']:.0f} per row)")


def test_the_readme_quotes_the_demos_tool_verdict(demo, capsys):
    main(["check", "tools", str(demo)])
    verdict = capsys.readouterr().out.splitlines()[0]
    assert f"\n{verdict}\n" in README
