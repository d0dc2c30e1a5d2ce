import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash.core.shapes import cache_bytes
from dflash.hidden.stage import cached_features, capture_shard, forward_features
from dflash.core.io import write_jsonl_zst
from dflash.tokenize.stage import tokenize_shard
from tests.test_tokenize import validated


def test_features_equal_hidden_states_of_a_plain_forward(target):
    model, tok = target
    ids = torch.tensor([tok.encode("<|im_start|>user\nHello there<|im_end|>\n", add_special_tokens=False)])
    logits, feats = forward_features(model, ids, [0, 1, 3])
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    assert feats.shape == (1, ids.shape[1], 3, model.config.hidden_size)
    for j, layer in enumerate([0, 1, 3]):
        assert torch.equal(feats[:, :, j], ref.hidden_states[layer + 1])
    assert torch.equal(logits, ref.logits)


def test_out_of_range_layer_is_a_clear_error(target):
    model, _ = target
    with pytest.raises(ValueError, match=r"out of range: the target has 4 decoder layers"):
        forward_features(model, torch.tensor([[1, 2]]), [4])


def tokenized_shard(tmp_path, tok):
    """A two-row tokenized shard (prompt + a short thinking answer) with the demo tokenizer."""
    recs = []
    for i, q in enumerate(["Hi", "What is the tallest mountain on Earth?"]):
        p = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)
        o = tok.encode("Let me think.\n</think>\n\nAnswer.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        recs.append({"id": f"r{i}", "category": "chat", "text": "", "finish_reason": "stop",
                     "prompt_token_ids": p, "output_token_ids": o})
    write_jsonl_zst(tmp_path / "v.jsonl.zst", map(validated, recs))
    tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", tok, {"max_length": 4096, "retokenize_sample": 1.0})


def test_capture_shard(tmp_path, target, target_dir):
    model, tok = target
    tokenized_shard(tmp_path, tok)
    # A misconfigured cache must never reach training silently: the metadata records what was captured.
    summary = capture_shard(tmp_path / "t.safetensors", tmp_path / "h.safetensors", target_dir, {"target_layer_ids": [1, 3]})
    rows, h = load_file(str(tmp_path / "t.safetensors")), load_file(str(tmp_path / "h.safetensors"))
    assert h["hidden_states"].dtype == torch.bfloat16
    assert h["hidden_states"].shape == (len(rows["input_ids"]), 2, model.config.hidden_size)
    assert torch.equal(h["input_ids"], rows["input_ids"]) and torch.equal(h["offsets"], rows["offsets"])
    off = rows["offsets"].tolist()
    _, feats = forward_features(model, rows["input_ids"][off[1]:off[2]].long().unsqueeze(0), [1, 3])
    assert torch.equal(h["hidden_states"][off[1]:off[2]], feats[0].to(torch.bfloat16))
    with safe_open(str(tmp_path / "h.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["target_layer_ids"]) == [1, 3] and meta["hidden_size"] == str(model.config.hidden_size)
    assert meta["format"] == "dflash-hidden-v2"
    # the target's greedy next token after every position: the labels of train.loss.labels: target
    logits, _ = forward_features(model, rows["input_ids"][off[1]:off[2]].long().unsqueeze(0), [1, 3])
    assert h["target_argmax"].dtype == torch.int32
    assert torch.equal(h["target_argmax"][off[1]:off[2]].long(), logits[0].argmax(-1))
    assert summary["rows"] == 2 and summary["bytes"] == h["hidden_states"].numel() * 2 + 4 * len(rows["input_ids"])


def test_fp8_cache_keeps_per_token_scales(tmp_path, target, target_dir):
    model, tok = target
    tokenized_shard(tmp_path, tok)
    summary = capture_shard(tmp_path / "t.safetensors", tmp_path / "h.safetensors", target_dir,
                            {"target_layer_ids": [1, 3]}, "float8_e4m3fn")
    rows = load_file(str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "h.safetensors"), "pt") as f:
        raw, scales = f.get_tensor("hidden_states"), f.get_tensor("scales")
        restored = cached_features(f, 0, len(rows["input_ids"]))
    assert raw.dtype == torch.float8_e4m3fn and scales.shape == (len(rows["input_ids"]), 2)
    exact = torch.cat([forward_features(model, rows["input_ids"][a:b][None].long(), [1, 3])[1][0]
                       for a, b in zip(rows["offsets"][:-1].tolist(), rows["offsets"][1:].tolist())])
    # e4m3 keeps 3 mantissa bits: at most 1/16 of each token's largest value off, per element
    err = (restored - exact).abs() / exact.abs().amax(dim=-1, keepdim=True)
    assert err.max() <= 1 / 16 and restored.dtype == torch.float32
    expected = cache_bytes(len(rows["input_ids"]), 2, model.config.hidden_size, "float8_e4m3fn")
    assert summary["bytes"] == raw.numel() + 4 * scales.numel() + 4 * len(rows["input_ids"]) == expected


def test_cache_size_of_the_real_run(tmp_path, capsys):
    """The planning figure of docs/design.md: 1.64e9 tokens x 5 layers x 5120 x 2 B for Qwen3.6-27B, and
    4 B per token for the target's greedy token."""
    from dflash.cli import main

    (tmp_path / "q36").mkdir()
    (tmp_path / "q36" / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 5120,
        "num_hidden_layers": 64, "vocab_size": 248320, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "intermediate_size": 17408}))
    (tmp_path / "c.yaml").write_text("prompts: {sources: [{name: a, path: a.jsonl}]}\n"
                                     "drafter: {num_layers: 5, target_layer_ids: null}\n")
    assert main(["cache-size", "--config", str(tmp_path / "c.yaml"), "--tokens", "1.64e9",
                 "--target", str(tmp_path / "q36")]) == 0
    out = capsys.readouterr().out
    assert "1.64e+09 tokens x (5 layers x 5120 x 2 B + 4 B greedy token) = 84.0 TB" in out
    assert "above hidden.max_cache_bytes (20.0 TB)" in out and "train.hidden_states: online" in out
    # its config.json alone will do; a hub name not on this machine is one line, offline
    assert main(["cache-size", "--config", str(tmp_path / "c.yaml"), "--tokens", "1.64e9",
                 "--target", str(tmp_path / "q36" / "config.json")]) == 0
    assert "= 84.0 TB" in capsys.readouterr().out
    assert main(["cache-size", "--config", str(tmp_path / "c.yaml"), "--tokens", "1.64e9",
                 "--target", "Qwen/Qwen3.6-27B"]) != 0
    err = capsys.readouterr().err
    assert "Qwen/Qwen3.6-27B: no model folder, config.json or cached hub model" in err and "Traceback" not in err
