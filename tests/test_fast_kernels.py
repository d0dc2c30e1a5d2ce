"""target.fast_kernels: a hybrid target on CUDA without flash-linear-attention and causal-conv1d stops
with one line. Tiny configs built offline; "CUDA" is only the device decision (this machine has
neither a GPU nor the kernels, so transformers' own import answer is "missing")."""
from __future__ import annotations

import importlib.util
import logging
from argparse import Namespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.eval import stage as dflash_eval
from dflash.core.config import ConfigError, check_config, defaults
from dflash.target.models import check_fast_kernels, fast_kernels_problem, kernel_choices

CUDA = torch.device("cuda")
KERNELS_HERE = any(importlib.util.find_spec(m) for m in ("fla", "causal_conv1d"))
needs_no_kernels = pytest.mark.skipif(KERNELS_HERE, reason="fla or causal_conv1d is installed here")


def hybrid():
    return AutoConfig.for_model("qwen3_5_text", vocab_size=64, hidden_size=16, intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                                linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])


def full_attention():
    return AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8)


@needs_no_kernels
def test_reads_transformers_own_kernel_decision():
    # If a transformers upgrade changes how it picks the kernels, this is {} and the check is blind.
    assert kernel_choices(hybrid()) == {"fla": False, "causal_conv1d": False}


@needs_no_kernels
@pytest.mark.parametrize("target", [hybrid, lambda: AutoConfig.for_model("qwen3_5")], ids=["text", "vl"])
def test_hybrid_on_cuda_names_what_is_missing_and_the_gpu_extra(target):
    line = fast_kernels_problem(target(), CUDA)
    assert "\n" not in line
    assert "flash-linear-attention (fla) and causal-conv1d (causal_conv1d)" in line
    assert "pip install -e '.[gpu]'" in line and "envs/gpu.yaml" in line and "target.fast_kernels: warn" in line


@needs_no_kernels
def test_a_loaded_model_is_checked_like_its_config():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid())
    assert fast_kernels_problem(model, "cuda:0") == fast_kernels_problem(hybrid(), CUDA)


def test_nothing_on_cpu_for_full_attention_or_with_the_kernels(monkeypatch):
    assert fast_kernels_problem(hybrid(), torch.device("cpu")) is None
    assert fast_kernels_problem(hybrid(), "cpu") is None
    assert fast_kernels_problem(full_attention(), CUDA) is None
    monkeypatch.setattr("dflash.target.models.kernel_choices", lambda config: {"fla": True, "causal_conv1d": True})
    assert fast_kernels_problem(hybrid(), CUDA) is None
    monkeypatch.setattr("dflash.target.models.kernel_choices", lambda config: {"fla": True, "causal_conv1d": False})
    line = fast_kernels_problem(hybrid(), CUDA)
    assert "import causal-conv1d (causal_conv1d), so" in line and "flash-linear-attention" not in line


@needs_no_kernels
def test_policy_require_raises_warn_logs(caplog):
    with pytest.raises(ValueError, match=r"pip install -e '\.\[gpu\]'"):
        check_fast_kernels(hybrid(), CUDA, "require", logging.getLogger("t"))
    with caplog.at_level(logging.WARNING, logger="t"):
        check_fast_kernels(hybrid(), CUDA, "warn", logging.getLogger("t"))
    assert [r.getMessage() for r in caplog.records] == [fast_kernels_problem(hybrid(), CUDA)]
    check_fast_kernels(hybrid(), "cpu", "require")
    with pytest.raises(ValueError, match="must be one of require, warn"):
        check_fast_kernels(hybrid(), "cpu", "ignore")


def test_config_default_is_require():
    base = {"prompts": {"sources": [{"name": "a", "path": "a.jsonl"}]}}
    assert check_config(base)["target"]["fast_kernels"] == "require"
    with pytest.raises(ConfigError, match="target.fast_kernels"):
        check_config({**base, "target": {"fast_kernels": "off"}})


@pytest.fixture
def on_cuda(monkeypatch, tmp_path):
    """A hybrid target folder (config only) that eval believes it loads onto CUDA."""
    hybrid().save_pretrained(tmp_path)
    monkeypatch.setattr(dflash_eval, "pick_device", lambda name: CUDA)
    loaded = []

    class Loaded:
        def to(self, device):
            loaded.append(device)
            return self

    monkeypatch.setattr(dflash_eval, "target_model", lambda path, dtype: Loaded())
    return tmp_path, loaded


@needs_no_kernels
def test_eval_stops_before_loading_the_target(on_cuda):
    target_dir, loaded = on_cuda
    with pytest.raises(ValueError, match=r"^hybrid target \(qwen3_5_text\) on CUDA without its fast kernels"):
        dflash_eval.evaluate(target_dir, None, [], {"device": "auto"}, tokenizer=None)  # default: require
    assert loaded == []


@needs_no_kernels
def test_eval_warns_and_loads_with_warn(on_cuda, caplog):
    target_dir, loaded = on_cuda
    with caplog.at_level(logging.WARNING, logger="dflash.eval.stage"):
        dflash_eval.load_target(target_dir, dflash_eval.settings({"fast_kernels": "warn"}))
    assert loaded == [CUDA]
    assert "target.fast_kernels: warn" in caplog.text


def test_cli_eval_passes_the_target_policy(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(dflash_eval, "run_eval", lambda *args: seen.setdefault("cfg", args[-1]) and {})
    from dflash.cli import _eval

    _eval({"eval": {"device": "cpu"}, "target": {"fast_kernels": "warn"}, "run": "r1", "output_dir": str(tmp_path),
           "train": {"steps": 10}, "tracking": {**defaults("tracking"), "tensorboard": False}},
          Namespace(checkpoint=None, target=None, heldout=None, out=None))
    assert seen["cfg"] == {"device": "cpu", "fast_kernels": "warn"}


@needs_no_kernels
def test_hidden_and_online_training_stop_before_loading_the_target(monkeypatch, tmp_path):
    """The hidden job and online training run the target too: the same line, before any weights
    are read (the target folder here holds a config and no weights)."""
    import dflash.hidden.stage
    import dflash.train.stage
    from safetensors.torch import save_file

    from dflash.hidden.stage import capture_shard

    hybrid().save_pretrained(tmp_path / "target")
    monkeypatch.setattr(dflash.hidden.stage, "pick_device", lambda name: CUDA)
    monkeypatch.setattr(dflash.train.stage, "pick_device", lambda name: CUDA)
    save_file({"input_ids": torch.tensor([1, 2, 3], dtype=torch.int32), "offsets": torch.tensor([0, 3])},
              tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match=r"^hybrid target \(qwen3_5_text\) on CUDA without its fast kernels"):
        capture_shard(tmp_path / "t.safetensors", tmp_path / "h.safetensors", tmp_path / "target",
                      {"target_layer_ids": [0, 1]})
    cfg = {"mask_token_id": 1, "num_layers": 1, "hidden_states": "online"}
    with pytest.raises(ValueError, match=r"^hybrid target \(qwen3_5_text\) on CUDA without its fast kernels"):
        dflash.train.stage.train([tmp_path / "t.safetensors"], None, tmp_path / "target", tmp_path / "out", cfg)
    assert not (tmp_path / "h.safetensors").exists() and not (tmp_path / "out").exists()
