"""Every stage has a CLI twin that runs the rule's package function on explicit paths."""
import subprocess
import sys

from dflash.cli import main
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from tests.conftest import ROOT

STAGES = ["prompts", "target", "generate", "validate", "tokenize", "hidden", "train", "eval", "report", "inspect"]


def test_help_lists_every_stage():
    out = subprocess.run([sys.executable, "-m", "dflash.cli", "--help"], capture_output=True, text=True).stdout
    for stage in STAGES:
        assert f"    {stage} " in out


def test_validate_twin_on_one_shard(tmp_path):
    from tests.test_validate import record

    rec = record("x\n</think>\n\nOK.", rid="a")
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [rec])
    rc = main(["validate", "--config", str(ROOT / "config.yaml"), "--completions", str(tmp_path / "c.jsonl.zst"),
               "--validated", str(tmp_path / "v.jsonl.zst"), "--rejected", str(tmp_path / "r.jsonl.zst"),
               "--qa", str(tmp_path / "qa.json"), "--target", str(ROOT / "data/demo/target")])
    assert rc == 0
    assert read_jsonl(tmp_path / "r.jsonl.zst")[0]["qa"]["reasons"] == ["trivial"]
    assert read_json(tmp_path / "qa.json")["rejected"] == 1
    (tmp_path / "drop.jsonl").write_text('{"id": "a", "reason": "by hand"}\n')
    assert main(["validate", "--config", str(ROOT / "config.yaml"), "--completions", str(tmp_path / "c.jsonl.zst"),
                 "--validated", str(tmp_path / "v.jsonl.zst"), "--rejected", str(tmp_path / "r.jsonl.zst"),
                 "--qa", str(tmp_path / "qa.json"), "--exclude", str(tmp_path / "drop.jsonl"),
                 "--target", str(ROOT / "data/demo/target")]) == 0
    assert read_jsonl(tmp_path / "r.jsonl.zst")[0]["qa"]["details"] == {"excluded": "by hand"}


def test_prompts_twin_and_clear_errors(tmp_path, capsys, monkeypatch, target_dir):
    monkeypatch.chdir(ROOT)  # the config's source paths are relative to the working directory
    assert main(["prompts", "--config", "config.yaml", "--out", str(tmp_path / "p"), "--target", str(target_dir)]) == 0
    assert read_json(tmp_path / "p" / "manifest.json")["prompts"] >= 150
    monkeypatch.chdir(tmp_path)
    assert main(["prompts", "--config", str(ROOT / "config.yaml"), "--out", str(tmp_path / "q"),
                 "--target", str(target_dir)]) == 1
    assert "data/demo/chat.jsonl: no such file" in capsys.readouterr().err
    assert main(["prompts", "--config", str(ROOT / "config.yaml"), "--out", str(tmp_path / "q")]) == 1
    assert ("results/target: no such model folder (its tokenizer and template screen the prompts): build the demo "
            "target first (snakemake results/target), or give --target") in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("prompts: {sources: [{name: a, path: a.jsonl}]}\nrun_name: x\n")
    assert main(["validate", "--config", str(bad), "--completions", "c", "--validated", "v", "--rejected", "r", "--qa", "q"]) == 2
    assert "unknown key 'run_name'" in capsys.readouterr().err


def test_the_real_run_page_commands_parse_and_the_readme_stays_short():
    """docs/real-run.md's `dflash` commands are ones the CLI takes, flags and all; the README (at
    most 250 lines, the depth in docs/) links the page."""
    import shlex

    from dflash.cli import parser

    page = (ROOT / "docs" / "real-run.md").read_text()
    commands = [line.split("#")[0].strip() for block in page.split("```")[1::2]
                for line in block.splitlines() if line.startswith("dflash ")]
    assert len(commands) >= 6, commands
    for command in commands:
        parser().parse_args(shlex.split(command)[1:])  # argparse exits on a flag it does not know
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250 and "(docs/real-run.md)" in readme
