"""The feature guards: a target whose features are NaN, all zero, constant or off in scale stops
the hidden stage or the training with one line naming the shard, the row or layer and the
statistic. The broken targets are the real tiny hybrid target with weights set as a broken run
would leave them (a real part: its real forward makes the features)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dflash.hidden.feature_guard import FeatureError
from dflash.hidden.stage import capture_shard
from dflash.train.stage import train
from tests.test_train import LAYER_IDS, TRAIN_CFG, _rewrite, make_target, write_shards

CFG = {**TRAIN_CFG, "steps": 4, "log_every": 2}


@pytest.fixture(scope="module")
def good_target(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("guard") / "target")


def broken(good: Path, out: Path, how: str) -> Path:
    """The target with weights set as a broken capture or model would leave its features."""
    model = AutoModelForCausalLM.from_pretrained(good)
    state = model.state_dict()
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        if how == "zero":  # nothing flows: every layer's output is zero
            embed.zero_()
        elif how == "nan":  # from layer 1 on
            model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
        elif how == "constant":  # one vector for every token, and no mixing across positions
            embed.copy_(embed[0].expand_as(embed))
            for name, p in state.items():
                if name.endswith(("o_proj.weight", "out_proj.weight")):
                    p.zero_()
        elif how == "scaled":  # the residual stream 1000x: another model's scale
            embed.mul_(1000.0)
    model.save_pretrained(out)
    return out


def tokenized(good: Path, out: Path, prefix: str, seed: int) -> Path:
    """A tokenized shard of four rows whose ids start with ``prefix``."""
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randint(8, 256, (n,), generator=g).tolist(), [0] * 8 + [1] * (n - 8)) for n in (30, 26, 34, 28)]
    target = AutoModelForCausalLM.from_pretrained(good).eval()
    tok, _ = write_shards(target, out, rows, LAYER_IDS)
    index = json.loads(tok.with_suffix(".json").read_text())
    for row in index["rows"]:
        row["id"] = f"{prefix}{row['id']}"
    tok.with_suffix(".json").write_text(json.dumps(index))
    return tok


@pytest.mark.parametrize("how, message", [
    ("zero", r"t/tokenized/shard-00000\.safetensors: row 0 \(record a-r0\): target layer 1: the features are all "
             r"zero \(rms 0\)"),
    ("nan", r"row 0 \(record a-r0\): target layer 1: \d+ feature values are NaN or infinite"),
    ("constant", r"h\.safetensors: target layer 1: the features are constant across 118 tokens"),
])
def test_the_hidden_stage_stops_on_features_a_drafter_cannot_learn_from(good_target, tmp_path, how, message):
    tok = tokenized(good_target, tmp_path / "t", "a-", 0)
    target = broken(good_target, tmp_path / how, how)
    with pytest.raises(FeatureError, match=message):
        capture_shard(tok, tmp_path / "h.safetensors", target, {"target_layer_ids": LAYER_IDS})
    assert not (tmp_path / "h.safetensors").exists() and not list(tmp_path.glob("*.tmp*"))


def test_the_cache_keeps_per_layer_statistics_and_training_reports_them(good_target, tmp_path):
    tok = tokenized(good_target, tmp_path / "t", "a-", 0)
    summary = capture_shard(tok, tmp_path / "h.safetensors", good_target, {"target_layer_ids": LAYER_IDS})
    with safe_open(tmp_path / "h.safetensors", "pt") as f:
        kept = json.loads(f.metadata()["feature_stats"])
    assert kept["tokens"] == 118 and [s["layer"] for s in kept["layers"]] == LAYER_IDS
    assert summary["features"] == kept["layers"]
    assert all(s["rms"] > 0 and s["spread"] > 0 and s["max_abs"] >= s["rms"] for s in kept["layers"])
    train([tok], [tmp_path / "h.safetensors"], good_target, tmp_path / "out", CFG)
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    layers = state["data"]["features"]["layers"]
    assert [(s["layer"], s["rms_min"], s["rms_max"]) for s in layers] == [
        (s["layer"], s["rms"], s["rms"]) for s in kept["layers"]]


def test_training_stops_before_a_step_on_a_shard_of_another_scale(good_target, tmp_path):
    tok_a, tok_b = tokenized(good_target, tmp_path / "a", "a-", 0), tokenized(good_target, tmp_path / "b", "b-", 1)
    capture_shard(tok_a, tmp_path / "a.safetensors", good_target, {"target_layer_ids": LAYER_IDS})
    capture_shard(tok_b, tmp_path / "b.safetensors", broken(good_target, tmp_path / "scaled", "scaled"),
                  {"target_layer_ids": LAYER_IDS})
    with pytest.raises(FeatureError, match=r"b\.safetensors: target layer 1: rms [\d.e+]+, [\d.e+]+x that of "
                                           r".*a\.safetensors \([\d.e+-]+\), outside train\.feature_rms_range \(10\)"):
        train([tok_a, tok_b], [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], good_target,
              tmp_path / "out", CFG)
    assert not (tmp_path / "out").exists()
    # the setting is the way out when the data really differ
    train([tok_a, tok_b], [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], good_target, tmp_path / "out",
          {**CFG, "feature_rms_range": 0})


def test_a_cache_zeroed_after_capture_stops_training_at_its_first_row(good_target, tmp_path):
    """The issue's case: the demo's hidden shard with every feature set to zero trained 250 steps
    and exited 0. The statistics the hidden stage kept say nothing of a later write: each drawn row
    is checked too."""
    tok = tokenized(good_target, tmp_path / "t", "a-", 0)
    capture_shard(tok, tmp_path / "h.safetensors", good_target, {"target_layer_ids": LAYER_IDS})
    with safe_open(tmp_path / "h.safetensors", "pt") as f:
        zeros = torch.zeros_like(f.get_tensor("hidden_states"))
    _rewrite(tmp_path / "h.safetensors", tmp_path / "zeroed.safetensors", {"hidden_states": zeros})
    with pytest.raises(FeatureError, match=r"zeroed\.safetensors: row \d \(record a-r\d\): target layer 1: the "
                                           r"features are all zero"):
        train([tok], [tmp_path / "zeroed.safetensors"], good_target, tmp_path / "out", CFG)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how, message", [
    ("zero", r"row \d \(record a-r\d\): target layer 1: the features are all zero"),
    ("constant", r"shard-00000\.safetensors \(the first 4 rows drawn\): target layer 1: the features are constant "
                 r"across 64 tokens"),
])
def test_online_training_stops_on_broken_features(good_target, tmp_path, how, message):
    tok = tokenized(good_target, tmp_path / "t", "a-", 0)
    target = broken(good_target, tmp_path / how, how)
    with pytest.raises(FeatureError, match=message):
        train([tok], None, target, tmp_path / "out", {**CFG, "hidden_states": "online"})
    assert not (tmp_path / "out").exists()
