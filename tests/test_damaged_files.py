"""Damaged and foreign files through the real CLI: every reader names the file (never a temp copy)
and says what to do in one line, and every output gets the mode a plain open() gives."""
import gzip
import json
import os
import re
import shutil
import stat

import pytest
import yaml
import zstandard
from safetensors.torch import load_file, save_file

from dflash.cli import main
from dflash.core.io import write_json, write_jsonl_zst
from tests.conftest import ROOT
from tests.test_tokenize import MESSAGES, validated, with_ids

REWRITE = "write or copy it again (a file the pipeline wrote: delete it and re-run the rule that writes it)"


def cut_short(line: str, path) -> bool:
    """Whether ``line`` is the line for a cut safetensors file (the parenthesis: safetensors' words)."""
    return bool(re.fullmatch(rf"{re.escape(f'{path}: not a whole safetensors file (')}.+\): cut short or damaged "
                             rf"\(an interrupted copy or write\): {re.escape(REWRITE)}", line))


def cli(capsys, *args):
    rc = main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def cut(src, dst):
    data = src.read_bytes()
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[: len(data) // 2])
    return dst


@pytest.fixture(scope="module")
def run(tmp_path_factory, target_dir):
    """A validated shard; its tokenized rows, their hidden states and a one-step checkpoint, each
    written by its `dflash` command under umask 022."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("outputs")
    tok = AutoTokenizer.from_pretrained(target_dir)
    write_jsonl_zst(work / "v.jsonl.zst", [validated(with_ids(tok, f"rec-{i}", "Two plus two is four.\n</think>\n\n4"))
                                           for i in range(3)])
    write_jsonl_zst(work / "heldout.jsonl.zst", [{"id": "0123456789abcdef", "source": "demo", "category": "chat",
                                                  "messages": MESSAGES, "tools": None, "meta": {"split": "heldout"}}])
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg.update(drafter={"num_layers": 1, "target_layer_ids": [1, 3], "block_size": 4},
               train={"steps": 1, "batch_size": 2}, eval={"max_new_tokens": 2})
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    tokenized, hidden = work / "tokenized" / "shard-00000.safetensors", work / "hidden" / "shard-00000.safetensors"
    old = os.umask(0o022)
    try:
        for argv in (["tokenize", "--validated", work / "v.jsonl.zst", "--out", tokenized,
                      "--index", tokenized.with_suffix(".json")],
                     ["hidden", "--tokenized", tokenized, "--out", hidden],
                     ["train", "--tokenized", tokenized, "--hidden", hidden, "--out", work / "ckpt"]):
            assert main([*map(str, argv), "--config", str(work / "config.yaml"), "--target", str(target_dir)]) == 0
        write_json(work / "x.json", {})
    finally:
        os.umask(old)
    return work


def test_every_output_gets_the_mode_the_umask_gives(run):
    """safetensors.save_file renames a 0600 temp file of its own onto the path it is given."""
    for name in ("tokenized/shard-00000.safetensors", "tokenized/shard-00000.json", "hidden/shard-00000.safetensors",
                 "ckpt/model.safetensors", "x.json"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o644, name


def test_a_cut_safetensors_file_is_named_by_every_reader(run, tmp_path, capsys, target_dir):
    bad = {name: cut(run / name, tmp_path / name) for name in
           ("tokenized/shard-00000.safetensors", "hidden/shard-00000.safetensors", "ckpt/model.safetensors")}
    (tmp_path / "tokenized/shard-00000.json").write_bytes((run / "tokenized/shard-00000.json").read_bytes())
    (tmp_path / "ckpt/config.json").write_bytes((run / "ckpt/config.json").read_bytes())
    tokenized, hidden, weights = bad.values()
    common = ["--config", run / "config.yaml", "--target", target_dir]
    for stage, argv, named in [
            ("hidden", ["--tokenized", tokenized, "--out", tmp_path / "h.safetensors"], tokenized),
            ("train", ["--tokenized", tokenized, "--hidden", run / "hidden/shard-00000.safetensors",
                       "--out", tmp_path / "c"], tokenized),
            ("train", ["--tokenized", run / "tokenized/shard-00000.safetensors", "--hidden", hidden,
                       "--out", tmp_path / "c"], hidden),
            ("eval", ["--checkpoint", weights.parent, "--heldout", run / "heldout.jsonl.zst",
                      "--out", tmp_path / "e.json"], weights),
            ("inspect", [], tokenized), ("inspect", [], hidden), ("inspect", [], weights)]:
        rc, out, err = cli(capsys, stage, *(argv + common if argv else [named]))
        assert rc == 1 and out == "" and "Traceback" not in err, (stage, err)
        assert cut_short(err.splitlines()[-1], f"dflash {stage}: {named}"), (stage, err)  # after any log lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hidden", "tokenized"]  # nothing written

    rc, _, err = cli(capsys, "inspect", run / "ckpt/model.safetensors")
    assert rc == 1 and err == (f"dflash inspect: {run}/ckpt/model.safetensors: no input_ids, offsets tensors: not a "
                               f"tokenized or hidden-state shard\n")


def test_checkpoint_files_that_do_not_belong_together(run, tmp_path, capsys, target_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run / "ckpt", ckpt)
    weights = load_file(ckpt / "model.safetensors")
    save_file({**weights, "norm.weight": weights["norm.weight"][:3].clone()}, ckpt / "model.safetensors")

    def evaluate(checkpoint):
        rc, _, err = cli(capsys, "eval", "--config", run / "config.yaml", "--target", target_dir, "--checkpoint",
                         checkpoint, "--heldout", run / "heldout.jsonl.zst", "--out", tmp_path / "e.json")
        assert rc == 1 and "Traceback" not in err and not (tmp_path / "e.json").exists()
        return err.splitlines()[-1]  # after the target's loading bar

    line = evaluate(ckpt)
    assert line.startswith(f"dflash eval: {ckpt}/model.safetensors: weights that do not fit {ckpt}/config.json (")
    assert "norm.weight" in line and line.endswith("): the two files are from different checkpoints; copy the "
                                                   "checkpoint folder again, whole")
    cut(run / "ckpt/config.json", ckpt / "config.json")
    assert re.fullmatch(rf"dflash eval: {ckpt}/config.json:\d+: not valid JSON \(.+\): {re.escape(REWRITE)}",
                        evaluate(ckpt))
    assert evaluate(target_dir) == (f"dflash eval: {target_dir}/config.json: no dflash_config: not the config of a "
                                    f"DFlash drafter checkpoint")


def test_token_ids_outside_the_vocabulary_name_the_row_and_record(run, tmp_path, capsys, target_dir):
    """A shard tokenized with another (larger) tokenizer."""
    rows = load_file(run / "tokenized/shard-00000.safetensors")
    rows["input_ids"][int(rows["offsets"][1]) + 3] = 5000  # the demo target has 4,096
    foreign = tmp_path / "shard-00000.safetensors"
    save_file(rows, foreign)
    (tmp_path / "shard-00000.json").write_bytes((run / "tokenized/shard-00000.json").read_bytes())
    rc, _, err = cli(capsys, "hidden", "--config", run / "config.yaml", "--tokenized", foreign, "--target", target_dir,
                     "--out", tmp_path / "h.safetensors")
    assert rc == 1 and "Traceback" not in err and err.splitlines()[-1] == (  # after the target's loading bar
        f"dflash hidden: {foreign}: row 1 (record rec-1) holds token id 5000, outside the target's vocabulary of "
        f"4096 ids (1 of the shard's {len(rows['input_ids'])} tokens are): it was tokenized with another tokenizer; "
        f"re-run tokenize with this target's")
    assert not (tmp_path / "h.safetensors").exists()


def test_a_gzip_file_and_a_cut_zstd_prompt_source(run, tmp_path, capsys, target_dir):
    text = (ROOT / "data/demo/chat.jsonl").read_bytes()
    (tmp_path / "chat.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "gzip.jsonl.zst").write_bytes(gzip.compress(text))
    whole = zstandard.ZstdCompressor(write_checksum=True).compress(text)
    (tmp_path / "chat.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    for name in ("chat.jsonl.gz", "gzip.jsonl.zst"):
        rc, _, err = cli(capsys, "inspect", tmp_path / name)
        assert rc == 1 and err == (f"dflash inspect: {tmp_path}/{name}: gzip-compressed, and gzip is not supported: "
                                   f"recompress it with zstd (.jsonl.zst) or decompress it to plain .jsonl\n")
    for name, says in [("chat.jsonl.gz", "gzip-compressed, and gzip is not supported"),
                       ("chat.jsonl.zst", "truncated zstd stream (0 records read before the cut); the file is "
                                          f"incomplete (an interrupted copy or write): {REWRITE}")]:
        cfg["prompts"]["sources"] = [{"name": "chat", "path": str(tmp_path / name), "category": "chat"}]
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
        rc, _, err = cli(capsys, "prompts", "--config", tmp_path / "config.yaml", "--out", tmp_path / "p",
                         "--target", target_dir)
        assert rc == 1 and err.startswith(f"dflash prompts: {tmp_path}/{name}: {says}") and err.count("\n") == 1, err
        assert not (tmp_path / "p").exists()


def test_inspect_of_an_absent_id_fails(run, capsys):
    shards = [run / "v.jsonl.zst", run / "tokenized/shard-00000.safetensors"]
    rc, out, _ = cli(capsys, "inspect", *shards, "--id", "rec-2", "--json")
    assert rc == 0 and [json.loads(line)["id"] for line in out.splitlines()] == ["rec-2", "rec-2"]
    rc, out, err = cli(capsys, "inspect", *shards, "--id", "rec-9")
    assert rc == 1 and out == "" and err == (f"dflash inspect: --id rec-9: in none of the shards given ({shards[0]}, "
                                             f"{shards[1]}); check the id, and that these are shards of the stage that "
                                             f"holds it\n")
    rc, out, err = cli(capsys, "inspect", run / "v.jsonl.zst", "--id", "rec-1", "--category", "code")
    assert rc == 0 and out == "" and err == "0 of 0 shown\n"  # there, but not of that category


def test_a_damaged_s3_object_is_named_by_its_url(run, s3, capsys):
    """Not the temp copy inspect reads: that is gone, and deleting it would mend nothing."""
    url = "s3://drafter/run1/tokenized/shard-00000"
    s3.put_object(Bucket="drafter", Key="run1/tokenized/shard-00000.safetensors",
                  Body=(run / "tokenized/shard-00000.safetensors").read_bytes()[:300])
    s3.upload_file(str(run / "tokenized/shard-00000.json"), "drafter", "run1/tokenized/shard-00000.json")
    whole = (run / "v.jsonl.zst").read_bytes()
    s3.put_object(Bucket="drafter", Key="run1/validated/shard-00000.jsonl.zst", Body=whole[: len(whole) // 2])

    def inspect(url):
        rc, _, err = cli(capsys, "inspect", url)
        assert rc == 1 and "dflash-s3-" not in err
        return err.splitlines()[-1]  # after the S3 server's log lines

    assert cut_short(inspect(f"{url}.safetensors"), f"dflash inspect: {url}.safetensors")
    assert inspect("s3://drafter/run1/validated/shard-00000.jsonl.zst").startswith(
        "dflash inspect: s3://drafter/run1/validated/shard-00000.jsonl.zst: truncated zstd stream (")
    s3.upload_file(str(run / "tokenized/shard-00000.safetensors"), "drafter", "run1/tokenized/shard-00000.safetensors")
    s3.put_object(Bucket="drafter", Key="run1/tokenized/shard-00000.json", Body=b'{"rows": [')
    assert inspect(f"{url}.safetensors") == f"dflash inspect: {url}.json:1: not valid JSON (Expecting value): {REWRITE}"
