import ast
import re
import subprocess
import sys

import pytest
import yaml

from dflash.core.config import ConfigError, check_config, load_config
from tests.conftest import ROOT


def test_shipped_config_is_valid_and_gets_defaults():
    cfg = load_config(ROOT / "config.yaml")
    assert cfg["prompts"]["shard_size"] == 104
    assert cfg["validate"]["checks"]["trivial"] == "reject"
    assert cfg["train"]["grad_clip"] == 1.0  # not in config.yaml: filled from the schema
    assert cfg["target"]["path"] is None


def test_the_schema_is_the_one_source_of_defaults():
    """No module keeps a table of defaults beside the schema's: the trainer, the eval and the
    generate backends complete the part of a section they are handed from the schema."""
    import ast

    from dflash.eval.acceptance import settings
    from dflash.core.config import completed, defaults
    from dflash.train.stage import resolve_cfg, trainer_defaults

    for path in sorted((ROOT / "dflash").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # a mapping named for defaults (DEFAULT_SITE is a path)
            names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
            table = isinstance(getattr(node, "value", None), ast.Dict)
            assert not [n for n in names if "DEFAULT" in n.upper() and table], f"{path.relative_to(ROOT)}: {names}"
    schema = yaml.safe_load((ROOT / "dflash" / "schemas" / "config.schema.yaml").read_text())["properties"]
    assert settings({})["max_new_tokens"] == schema["eval"]["properties"]["max_new_tokens"]["default"] == 256
    assert settings({})["vllm"] == defaults("eval")["vllm"] and settings({})["fast_kernels"] == "require"
    resolved = resolve_cfg({"mask_token_id": 5, "loss": {"labels": "data"}})
    assert resolved == {**trainer_defaults(), "mask_token_id": 5, "loss": {**defaults("train")["loss"], "labels": "data"}}
    assert resolved["steps"] == schema["train"]["properties"]["steps"]["default"] and "gpus" not in resolved
    with pytest.raises(ValueError, match="mask_token_id"):
        resolve_cfg({})
    part = completed({"batch_size": 4, "server": {"url": "http://h/v1"}}, "generate")
    assert part["batch_size"] == 4 and part["server"]["url"] == "http://h/v1"
    assert part["server"]["retries"] == defaults("generate")["server"]["retries"] and part["loop_abort"] is True


def test_a_server_dialect_is_one_entry_in_dialects_and_its_schema_enums():
    """dflash.core.dialects holds each server dialect; the schema's enums name exactly those, and each
    names a conda environment that exists."""
    from dflash.core.dialects import DIALECTS, LOGGING_SERVERS, detect_server

    schema = yaml.safe_load((ROOT / "dflash" / "schemas" / "config.schema.yaml").read_text())["properties"]
    assert sorted(schema["generate"]["properties"]["server"]["properties"]["dialect"]["enum"]) == sorted(DIALECTS)
    source = schema["prompts"]["properties"]["sources"]["items"]["properties"]["server"]
    assert source["enum"] == ["auto", *LOGGING_SERVERS] == ["auto", "sglang", "vllm"]
    assert all((ROOT / "envs" / d.env).is_file() for d in DIALECTS.values())
    assert detect_server({"matched_stop": 151645}, {}) == "sglang" and detect_server({}, {"reasoning": "r"}) == "vllm"
    assert detect_server({}, {"reasoning_content": "r", "reasoning": "r"}) == "sglang"  # as before: SGLang first
    assert detect_server({}, {"content": "x"}) is None


def test_every_schema_names_the_same_categories_splits_and_reason_codes():
    from dflash.core.reasons import REASONS
    from dflash.validate.stage import CHECKS
    from dflash.core.vocabulary import CATEGORIES, SPLITS

    def properties(name):
        return yaml.safe_load((ROOT / "dflash" / "schemas" / f"{name}.schema.yaml").read_text())["properties"]

    source = properties("config")["prompts"]["properties"]["sources"]["items"]["properties"]
    assert source["category"]["enum"] == properties("prompt")["category"]["enum"] == list(CATEGORIES)
    assert properties("completion")["category"]["enum"] == list(CATEGORIES)
    assert properties("prompt")["meta"]["properties"]["split"]["enum"] == list(SPLITS)
    checks = properties("config")["validate"]["properties"]["checks"]["properties"]
    assert set(checks) == set(CHECKS)
    # the config loader's defaults (the schema's) are the declarations'
    assert {code: check["default"] for code, check in checks.items()} == {r.code: r.default for r in REASONS}


def test_validate_finds_each_declared_reason_code_in_its_order():
    """A reason code is declared once (dflash/core/reasons.py): validate runs one check per code in
    the declarations' order (a record's reasons and a QA report's checks keep it), and the codes
    check_tool_calls gives are the declared tool-call ones (any other would never reach a record)."""
    from dflash.core.reasons import REASONS, TOOL_CODES
    from dflash.validate.stage import CHECKS

    assert list(CHECKS) == [r.code for r in REASONS]
    tree = ast.parse((ROOT / "dflash" / "core" / "toolcalls.py").read_text(encoding="utf-8"))
    given = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
             and isinstance(node.value, str) and re.fullmatch(r"tool_[a-z_]+|text_after_tool_call", node.value)}
    assert given == set(TOOL_CODES)


def test_the_docs_name_every_reason_code():
    """A reason code a user meets in a manifest or a QA report is explained where the docs say:
    the validate codes in docs/quality.md, the prompts stage's per-record drops in docs/stages.md."""
    from dflash.core.reasons import ACTIONS, REASONS
    from dflash.prompts.stage import QUIRKS, UNREADABLE
    from dflash.validate.stage import CHECKS

    quality, stages = ((ROOT / "docs" / name).read_text(encoding="utf-8") for name in ("quality.md", "stages.md"))
    assert [code for code in CHECKS if f"`{code}`" not in quality] == []
    assert [code for code in (*QUIRKS, *UNREADABLE) if f"`{code}`" not in stages] == []
    # the table of checks: a row per code, its default action last
    rows = re.findall(rf"^\| `(\w+)` \|.*\| ({'|'.join(ACTIONS)}) \|$", quality, re.M)
    assert dict(rows) == {r.code: r.default for r in REASONS} and len(rows) == len(REASONS)


def test_misspelled_key_names_key_file_and_suggestion(tmp_path):
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    raw["generate"]["samplng"] = raw["generate"].pop("sampling")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "unknown key 'samplng'" in msg and "did you mean 'sampling'" in msg
    assert "at generate" in msg


def test_a_renamed_key_names_its_new_name():
    cfg = {"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}]}, "generate": {"save_every": {"records": 5}}}
    with pytest.raises(ConfigError, match=r"x\.yaml: at generate: 'save_every' is now generate\.mirror_every"):
        check_config(cfg, source="x.yaml")
    assert check_config({**cfg, "generate": {"mirror_every": {"records": 5}}})["generate"]["mirror_every"] == \
        {"records": 5, "seconds": 300}


def test_wrong_type_names_the_key_path():
    cfg = {"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}], "shard_size": "fifty"}}
    with pytest.raises(ConfigError, match=r"x\.yaml: at prompts\.shard_size: 'fifty' is not of type 'integer'"):
        check_config(cfg, source="x.yaml")


def test_bad_enum_value_is_rejected():
    cfg = {"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}]}, "validate": {"checks": {"trivial": "drop"}}}
    with pytest.raises(ConfigError, match="validate.checks.trivial"):
        check_config(cfg)


def test_snakemake_refuses_a_misspelled_key_before_any_job(tmp_path):
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    raw["prompts"]["shard_sise"] = raw["prompts"].pop("shard_size")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(raw))
    snakemake = [sys.executable, "-m", "snakemake"]
    run = subprocess.run(snakemake + ["-n", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path), "--configfile", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "unknown key 'shard_sise'" in out and "did you mean 'shard_size'" in out
    assert str(path) in out
    assert not (tmp_path / "results").exists()


def test_the_workflow_passes_snakemakes_lint(tmp_path):
    """`snakemake --lint`: the Snakefile holds includes, config checks and targets; functions live
    in rules/common.smk; every rule has a log and an environment."""
    run = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "-s", str(ROOT / "Snakefile"), "-d", str(tmp_path),
                          "--configfile", str(ROOT / "config.yaml")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Congratulations" in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]


def dry_run(work, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"), "-d", str(work), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_block_of_one_token_is_refused():
    with pytest.raises(ConfigError, match=r"at drafter.block_size: 1 is less than the minimum of 2"):
        check_config({"prompts": {"sources": [{"name": "in", "path": "in.jsonl"}]}, "drafter": {"block_size": 1}})


def test_a_drafter_the_target_cannot_carry_stops_the_plan(tmp_path, target_dir):
    """target_layer_ids beyond the target's layers (or too many layers for the default spacing) are
    said by `-n`, from the target's config.json, not by the hidden job after every generate job."""
    from dflash.core.shapes import drafter_target_problems, text_config

    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    raw["target"]["path"] = str(target_dir)  # the tests' 4-layer target
    for drafter, line in [
        ({"target_layer_ids": [1, 9]}, "at drafter.target_layer_ids: [1, 9] names layer(s) [9] of a target with 4 layers "
                                       "(ids 0 to 3): pick layers the target has"),
        ({"target_layer_ids": None, "num_layers": 5}, "at drafter.target_layer_ids: the default target layers for 5 "
                                                      "draft layers on a 4-layer target are"),
    ]:
        raw["drafter"] = {**raw["drafter"], **drafter}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
        run = dry_run(tmp_path, "--configfile", str(tmp_path / "c.yaml"))
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"{tmp_path}/c.yaml: {line}"), run.stderr
        assert lines[0].endswith(f"({target_dir}/config.json)")
    text = text_config(target_dir)
    assert drafter_target_problems({"target_layer_ids": [0, 3], "num_layers": 1, "mask_token_id": None}, text) == []
    assert drafter_target_problems({"target_layer_ids": [0], "num_layers": 1, "mask_token_id": text["vocab_size"]},
                                   text) == [("drafter.mask_token_id", f"{text['vocab_size']} is outside the target's "
                                                                       f"vocabulary of {text['vocab_size']}")]


def test_a_yaml_template_config_is_refused(tmp_path):
    """Snakemake runs a --configfile's ?-expressions as Python when it sets __use_yte__ (before the
    workflow can see the file): the run stops before any job, as `dflash plan` refuses the file."""
    path = tmp_path / "yte.yaml"
    path.write_text("prompts:\n  sources: [{name: in, path: in.jsonl}]\n__use_yte__: true\nrun: ?'demo'\n")
    line = (f"{path}:3: __use_yte__ makes Snakemake run this file's ?-expressions as Python code; a pipeline config "
            f"holds plain values: remove the key and write the values out")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == line
    run = dry_run(tmp_path, "--configfile", str(path))
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [line], run.stderr


def test_an_output_dir_outside_the_storage_prefix_is_refused(tmp_path):
    """With outputs in S3 the keys are <prefix>/<output_dir>/...: a '..' would put them in another
    run's keys, and safe_to_destroy would check a prefix it never wrote to."""
    from dflash.core.storage import safe_to_destroy, stored_root

    assert stored_root("s3://b/run1", "results") == ("b", "run1/results")
    assert stored_root("s3://b/run1/", "./sub/../results") == ("b", "run1/results")
    assert stored_root("s3://b", "results") == ("b", "results")
    for out in ("../x", "sub/../../x", "a/../../run1x/results"):
        with pytest.raises(ValueError, match=rf"^output_dir: '{out}' puts the outputs outside the storage prefix s3://b/run1 "):
            safe_to_destroy(tmp_path, out, "s3://b/run1")
    with pytest.raises(ValueError, match="outside the storage prefix s3://b "):
        stored_root("s3://b", "../x")
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    raw["output_dir"] = "../x"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    # no S3 is reached: the check comes before the storage is asked anything
    run = dry_run(tmp_path, "--configfile", str(tmp_path / "c.yaml"), "--default-storage-provider", "s3",
                  "--default-storage-prefix", "s3://b/run1",
                  env={**__import__("os").environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
                       "AWS_SECRET_ACCESS_KEY": "x"})
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        f"{tmp_path}/c.yaml: at output_dir: '../x' puts the outputs outside the storage prefix s3://b/run1 (its keys "
        f"would be s3://b/x/..., another run's): give a folder below the working directory without '..', such as "
        f"results"], run.stderr
