import copy
import json
from pathlib import Path

import pytest
import torch

from dflash.core.io import read_json
from dflash.target.stage import build_target, prebuilt_problem, target_job, teaching_digests
from tests.conftest import ROOT

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                              "days": {"type": "integer"}},
                                                            "required": ["city"]}}}


def render(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_template_reproduces_the_qwen36_agent_turn(target):
    """The rendering of reference/qwen-formats.md section 5, made there with the real Qwen3.6 tokenizer."""
    _, tok = target
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "reasoning_content": "Got it.", "content": "It is 21C."},
    ]
    expected = (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGot it.\n</think>\n\nIt is 21C.<|im_end|>\n"
    )
    assert render(tok, messages) == expected


def test_template_drops_history_reasoning_and_ends_in_think(target):
    _, tok = target
    messages = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "<think>\nold\n</think>\n\nHello."},
                {"role": "user", "content": "Again"}]
    assert render(tok, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert render(tok, messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_puts_tools_first_in_the_system_turn(target):
    _, tok = target
    text = render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}], tools=[WEATHER],
                  add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>\n\nIf you choose to call a function")
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nParis?<|im_end|>\n" in text


def test_template_errors_are_clear(target):
    _, tok = target
    with pytest.raises(Exception, match="No user query"):
        render(tok, [{"role": "system", "content": "x"}])
    with pytest.raises(Exception, match="must be a mapping"):
        render(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}])


def test_tokenizer_has_qwen_special_and_tag_tokens(target):
    _, tok = target
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>", "<|mask|>"]:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t
    ids = tok.encode("<think>\nhm\n</think>\n\nOK.<|im_end|>", add_special_tokens=False)
    # Tags are non-special (kept by skip_special_tokens, as the parsers need); <|im_end|> is special.
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\n\nOK."
    assert tok.decode(ids) == "<think>\nhm\n</think>\n\nOK.<|im_end|>"
    text = "Fährt 3.5 km/h → 東京 naïve café\n\tx"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_target_is_hybrid_qwen35_and_was_taught(target, target_dir):
    model, tok = target
    cfg = model.config
    assert cfg.model_type == "qwen3_5_text"
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.vocab_size >= len(tok) and cfg.vocab_size % 64 == 0
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"),
                                                    tok.convert_tokens_to_ids("<|endoftext|>")]
    summary = read_json(target_dir / "build_summary.json")
    assert summary["teaching_rows"] >= 190
    assert summary["teach_final_loss"] < summary["teach_first_loss"] - 1.0
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)])).logits
    assert logits.shape[-1] == cfg.vocab_size and torch.isfinite(logits).all()


def test_the_shipped_target_is_what_the_demo_would_teach(demo_config, demo_sources):
    """data/demo/target was made by `make demo-target` from the demo's build config, sources and
    teaching code as they are now, and is intact: the demo's target stage copies it instead of
    teaching for minutes. (Teaching again is not bit-for-bit the same on another CPU: what makes it
    trustworthy is what it was made from, and its files' digests.)"""
    cfg = demo_config["target"]["build"]
    shipped = ROOT / cfg["prebuilt"]
    digests = teaching_digests([Path(s["path"]) for s in demo_sources], cfg)
    assert prebuilt_problem(shipped, digests) is None, (
        f"{prebuilt_problem(shipped, digests)}: run `make demo-target` and commit data/demo/target")
    provenance = read_json(shipped / "provenance.json")
    assert provenance["made_by"] == "dflash target --threads 2 --out data/demo/target --teach"  # make demo-target
    assert set(provenance["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "build_summary.json"}
    size = sum((shipped / name).stat().st_size for name in provenance["files"])
    assert size < 16 * 2**20, f"the shipped target is {size / 2**20:.1f} MiB"


def test_a_prebuilt_target_of_another_config_or_changed_is_taught_instead(tmp_path, demo_config, demo_sources, caplog):
    cfg = {**copy.deepcopy(demo_config["target"]["build"]), "prebuilt": str(ROOT / demo_config["target"]["build"]["prebuilt"])}
    sources = [Path(s["path"]) for s in demo_sources]
    cfg["teach"]["steps"] = 2
    summary = build_target(sources, tmp_path / "target", cfg, made_by="a test")
    assert "not using the prebuilt target" in caplog.text and "made from another build config than this run's" in caplog.text
    assert summary["history"][-1]["step"] == 1  # taught, 2 steps
    provenance = read_json(tmp_path / "target" / "provenance.json")
    assert provenance["made_by"] == "a test" and provenance["digests"] == teaching_digests(sources, cfg)
    # what a taught target records lets the stage copy it next time, until a file of it changes
    assert prebuilt_problem(tmp_path / "target", teaching_digests(sources, cfg)) is None
    tokenizer = tmp_path / "target" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace("<think>", "<thing>", 1))
    assert prebuilt_problem(tmp_path / "target", teaching_digests(sources, cfg)) == (
        f"{tokenizer} is missing or changed since the target was made")
    assert "sources" in prebuilt_problem(tmp_path / "target", teaching_digests(sources[:2], cfg))


def test_the_target_job_stops_a_drafter_the_target_cannot_carry(tmp_path, demo_config, demo_sources):
    """The demo's target is made by the run itself: its job is the first that can read its config.json,
    so it says what the plan could not (target_layer_ids beyond its 4 layers), before any generate job."""
    build = {**demo_config["target"]["build"], "prebuilt": str(ROOT / demo_config["target"]["build"]["prebuilt"])}
    config = {**demo_config, "target": {**demo_config["target"], "build": build},
              "prompts": {**demo_config["prompts"], "sources": demo_sources},
              "drafter": {**demo_config["drafter"], "target_layer_ids": [1, 4]}}
    with pytest.raises(ValueError) as refused:
        target_job(config, tmp_path / "target")
    assert str(refused.value) == (f"drafter.target_layer_ids: [1, 4] names layer(s) [4] of a target with 4 layers (ids 0 "
                                  f"to 3): pick layers the target has ({tmp_path}/target/config.json)")
