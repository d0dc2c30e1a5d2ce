"""Shard I/O faults on real files: zstd shards cut at many points, a flipped byte, a file that is
not zstd, a full disk (a real tmpfs of a few KB in a private mount namespace), and file modes."""
import json
import os
import re
import stat
import subprocess
import sys

import pytest
import zstandard

from dflash.cli import main
from dflash.core.io import read_jsonl, write_json, write_jsonl_zst
from tests.conftest import ROOT
from tests.helpers import on_a_small_tmpfs
from tests.test_validate import GOOD


def incompressible_shard(path, n=60):
    """Records of random text: every cut lands inside real data, as in a shard of long generations."""
    recs = [{**GOOD, "id": f"r{i}", "prompt_id": f"r{i}", "text": GOOD["text"] + os.urandom(600).hex()} for i in range(n)]
    write_jsonl_zst(path, recs)
    return recs


def cli(capsys, *args):
    rc = main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def written(folder):
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def validate(shard, out):
    return ["validate", "--config", ROOT / "config.yaml", "--completions", shard, "--validated", out / "v.jsonl.zst",
            "--rejected", out / "r.jsonl.zst", "--qa", out / "qa.json", "--target", ROOT / "data/demo/target"]


def test_every_frame_carries_a_checksum(tmp_path):
    write_jsonl_zst(tmp_path / "a.jsonl.zst", [GOOD])
    assert zstandard.get_frame_parameters((tmp_path / "a.jsonl.zst").read_bytes()).has_checksum


def test_a_cut_shard_fails_every_reader_and_writes_nothing(tmp_path, capsys, target_dir):
    full = tmp_path / "full.jsonl.zst"
    recs = incompressible_shard(full)
    data = full.read_bytes()
    cut_shard, out = tmp_path / "shard-00000.jsonl.zst", tmp_path / "out"
    cuts = list(range(0, len(data), len(data) // 40))[1:]
    for n, cut in enumerate(cuts):
        cut_shard.write_bytes(data[:cut])
        rc, _, err = cli(capsys, *validate(cut_shard, out))
        read = re.fullmatch(rf"dflash validate: {cut_shard}: truncated zstd stream \((\d+) records read before the "
                            r"cut\); .*\n", err)
        assert rc == 1 and read, (cut, err)
        assert int(read.group(1)) <= len(recs)  # a cut in the checksum leaves every record whole, yet the frame open
        assert written(out) == []
        if n % 8 == 0:  # the other readers, at fewer points (each loads a tokenizer)
            rc, _, err = cli(capsys, "tokenize", "--config", ROOT / "config.yaml", "--validated", cut_shard,
                             "--target", target_dir, "--out", out / "t.safetensors", "--index", out / "t.json")
            assert rc == 1 and f"{cut_shard}: truncated zstd stream" in err and written(out) == []
            rc, shown, err = cli(capsys, "inspect", cut_shard)
            assert rc == 1 and shown == "" and f"{cut_shard}: truncated zstd stream" in err


def test_a_flipped_byte_and_a_file_that_is_not_zstd(tmp_path, capsys):
    shard, out = tmp_path / "shard-00000.jsonl.zst", tmp_path / "out"
    incompressible_shard(shard)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    rc, _, err = cli(capsys, *validate(shard, out))
    assert rc == 1 and err.startswith(f"dflash validate: {shard}: corrupt zstd stream (") and "checksum" in err
    assert "Traceback" not in err and err.count("\n") == 1 and written(out) == []
    shard.write_text(json.dumps(GOOD) + "\n")  # plain JSONL under a .zst name
    rc, _, err = cli(capsys, *validate(shard, out))
    assert rc == 1 and err == f"dflash validate: {shard}: not a zstd file (a .zst name needs zstd-compressed JSONL; " \
                              "rename a plain JSONL file to .jsonl)\n"
    (tmp_path / "empty.jsonl.zst").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.jsonl.zst: truncated zstd stream \(0 records read before the cut\)"):
        read_jsonl(tmp_path / "empty.jsonl.zst")


def test_concatenated_shards_read_as_one(tmp_path):
    write_jsonl_zst(tmp_path / "a.jsonl.zst", [{"id": "a"}])
    write_jsonl_zst(tmp_path / "b.jsonl.zst", [{"id": "b"}])
    both = tmp_path / "ab.jsonl.zst"
    both.write_bytes((tmp_path / "a.jsonl.zst").read_bytes() + (tmp_path / "b.jsonl.zst").read_bytes())
    assert read_jsonl(both) == [{"id": "a"}, {"id": "b"}]


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_outputs_get_the_mode_the_umask_gives(tmp_path, mask):
    from dflash.validate.stage import validate_shard
    from tests.test_validate import CFG

    old = os.umask(mask)
    try:
        write_jsonl_zst(tmp_path / "c.jsonl.zst", [GOOD])
        validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                       tmp_path / "qa.json", CFG)
        write_json(tmp_path / "x.json", {})
    finally:
        os.umask(old)
    for name in ("c.jsonl.zst", "v.jsonl.zst", "r.jsonl.zst", "qa.json", "x.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name


def full_disk_run(tmp_path, *argv, env=None):
    """``argv`` (a dflash command) in a private mount namespace where ``/mnt`` is a 16 KB tmpfs."""
    return on_a_small_tmpfs(f"exec {sys.executable} -m dflash.cli \"$@\"", "sh", *map(str, argv), cwd=tmp_path, env=env)


def test_a_full_disk_names_the_file_being_written(tmp_path):
    shard = tmp_path / "c.jsonl.zst"
    incompressible_shard(shard, n=30)  # ~40 KB of kept records: more than the disk holds
    argv = ["validate", "--config", ROOT / "config.yaml", "--completions", shard, "--validated", "/mnt/v.jsonl.zst",
            "--rejected", "/mnt/r.jsonl.zst", "--qa", "/mnt/qa.json", "--target", ROOT / "data/demo/target"]
    run = full_disk_run(tmp_path, *argv)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.endswith("dflash validate: /mnt/v.jsonl.zst: no space left on device while writing it; free "
                               "space there (or set output_dir to a larger disk) and re-run\n"), run.stderr
    assert "Traceback" not in run.stderr
    debug = full_disk_run(tmp_path, *argv, "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "DiskFull" in debug.stderr


def test_a_safetensors_file_has_the_same_bytes_in_every_process(tmp_path):
    """safetensors writes its metadata map in hash order, another per process: two processes
    writing the same hidden-state shard made two files until save_safetensors fixed the order."""
    code = ("import sys, torch; from dflash.core.tensors import save_safetensors; "
            "save_safetensors({'h': torch.arange(6.0), 'o': torch.ones(2, dtype=torch.int32)}, sys.argv[1], "
            "{k: k * 3 for k in ('format', 'target_layer_ids', 'hidden_size', 'dtype', 'model')})")
    files = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for path in files:
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=ROOT)
    assert len({path.read_bytes() for path in files}) == 1
    from dflash.core.tensors import load_safetensors

    assert load_safetensors(files[0])["h"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
