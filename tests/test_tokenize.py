import pytest
from safetensors.torch import load_file

from dflash.core.chat import split_reasoning
from dflash.core.io import read_json, write_jsonl_zst
from dflash.tokenize.stage import tokenize_shard

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def tok(target):
    return target[1]


def with_ids(tok, rid, text, finish="stop"):
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    p_ids = tok.encode(prompt, add_special_tokens=False)
    o_ids = tok.encode(text, add_special_tokens=False)
    if finish == "stop":
        o_ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
    return {"id": rid, "category": "reasoning", "messages": MESSAGES, "tools": None, "text": text,
            "finish_reason": finish, "prompt_token_ids": p_ids, "output_token_ids": o_ids,
            "generation": {"enable_thinking": True}}


def validated(rec: dict) -> dict:
    """A test record completed into a whole validated completion record, what tokenize reads."""
    reasoning, content = split_reasoning(rec["text"], True)
    sampling = {"temperature": 0, "top_p": 1, "top_k": 0, "seed": 0, "max_tokens": 256}
    return {"prompt_id": rec["id"], "source": "test", "messages": MESSAGES, "tools": None, "category": "chat",
            "reasoning": reasoning, "content": content,
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "error": None, "qa": {"flags": [], "tool_calls": []},
            **rec, "generation": {"backend": "test", "engine_version": "test", "model": "m", "sampling": sampling,
                                  "enable_thinking": True, **rec.get("generation", {})}}


def run(tmp_path, tok, recs, max_length=4096):
    write_jsonl_zst(tmp_path / "v.jsonl.zst", map(validated, recs))
    stats = tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", tok,
                           {"max_length": max_length, "retokenize_sample": 1.0})
    return stats, load_file(str(tmp_path / "t.safetensors")), read_json(tmp_path / "t.json")


def test_rows_from_ids_are_exact(tmp_path, tok):
    a = with_ids(tok, "a", "Two plus two is four.\n</think>\n\n4")
    b = with_ids(tok, "b", "Adding.\n</think>\n\nThe answer is 4.", finish="length")
    stats, t, index = run(tmp_path, tok, [a, b])
    assert t["input_ids"].dtype.is_floating_point is False and str(t["input_ids"].dtype) == "torch.int32"
    assert str(t["loss_mask"].dtype) == "torch.uint8" and str(t["offsets"].dtype) == "torch.int64"
    off = t["offsets"].tolist()
    assert off[0] == 0 and len(off) == 3 and off[-1] == len(t["input_ids"]) == len(t["loss_mask"])
    for r, rec in enumerate([a, b]):
        ids = t["input_ids"][off[r]:off[r + 1]].tolist()
        mask = t["loss_mask"][off[r]:off[r + 1]].tolist()
        assert ids == rec["prompt_token_ids"] + rec["output_token_ids"]
        assert mask == [0] * len(rec["prompt_token_ids"]) + [1] * len(rec["output_token_ids"])
    assert [(row["id"], row["trainable"]) for row in index["rows"]] == [("a", len(a["output_token_ids"])),
                                                                      ("b", len(b["output_token_ids"]))]
    assert stats["from_ids"] == 2 and stats["text_mismatch"] == 0 and stats["rows"] == 2


def test_rows_from_text_match_ids_and_append_end_of_turn_only_on_stop(tmp_path, tok):
    stop = with_ids(tok, "s", "Two plus two is four.\n</think>\n\n4")
    cut = with_ids(tok, "c", "Two plus two", finish="length")
    as_text = [{**r, "id": r["id"] + "-text", "prompt_token_ids": None, "output_token_ids": None} for r in (stop, cut)]
    stats, t, _ = run(tmp_path, tok, as_text)
    off = t["offsets"].tolist()
    assert t["input_ids"][off[0]:off[1]].tolist() == stop["prompt_token_ids"] + stop["output_token_ids"]
    assert t["input_ids"][off[1]:off[2]].tolist() == cut["prompt_token_ids"] + cut["output_token_ids"]
    assert t["input_ids"][off[1] - 1].item() == tok.convert_tokens_to_ids("<|im_end|>")
    assert t["input_ids"][off[2] - 1].item() != tok.convert_tokens_to_ids("<|im_end|>")
    assert stats["from_text"] == 2


def test_mismatch_counted_truncation_and_no_anchor_drop(tmp_path, tok):
    wrong = with_ids(tok, "w", "Four.\n</think>\n\n4")
    wrong["text"] = "Five.\n</think>\n\n5"  # ids and text disagree: reported, not hidden
    tiny = with_ids(tok, "t", "")  # only the end-of-turn token is supervised: no anchor + label pair
    long = with_ids(tok, "l", "word " * 200)
    stats, t, index = run(tmp_path, tok, [wrong, tiny, long], max_length=64)
    assert stats["text_mismatch"] == 1
    assert stats["dropped_no_anchor"] == 1 and [r["id"] for r in index["rows"]] == ["w", "l"]
    assert stats["truncated"] == 1 and index["rows"][1]["length"] == 64


def test_retokenization_and_prompt_boundary_are_reported(tmp_path, tok):
    canonical = with_ids(tok, "c", "Two plus two is four.\n</think>\n\n4")
    # the same text from other tokens, as a sampler may pick them: decodes equal, re-encodes differently
    split = with_ids(tok, "s", "Two plus two is four.\n</think>\n\n4")
    pieces = [tok.encode(ch, add_special_tokens=False) for ch in "Two"]
    split["output_token_ids"] = [t for p in pieces for t in p] + tok.encode(
        " plus two is four.\n</think>\n\n4", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(split["output_token_ids"][:-1]) == split["text"]
    as_text = {**canonical, "id": "t", "prompt_token_ids": None, "output_token_ids": None,
               "reasoning": "Two plus two is four.\n", "content": "\n\n4"}
    # an empty think block: the template renders that turn without the <think> the prompt ends with
    empty = {**as_text, "id": "e", "text": "</think>\n\n4", "reasoning": "", "content": "\n\n4"}
    stats, _, _ = run(tmp_path, tok, [canonical, split, as_text, empty])
    assert stats["text_mismatch"] == 0 and stats["retokenize_differs"] == 1
    assert stats["boundary_checked"] == 2 and stats["boundary_unstable"] == 1


def test_tool_call_replay_rows_are_token_exact_on_both_paths(tmp_path, tok):
    """A replayed tool conversation (one record per assistant generation, the history as the
    generate stage feeds it back): rows from ids and rows from text agree token for token, and the
    template drops the reasoning of turns before the last user query while keeping the agent loop's."""
    from dflash.generate.replay import assistant_turn
    from tests.test_adopt import PARIS, TOOLS, emitted, turn

    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
               {"role": "user", "content": "Weather in Paris?"}]
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def record(rid, messages, answer):
        text = emitted(tok, messages, answer)
        prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        reasoning, content = text.split("</think>", 1)
        return {"id": rid, "category": "tool", "messages": messages, "tools": TOOLS, "text": text,
                "reasoning": reasoning, "content": content, "finish_reason": "stop",
                "prompt_token_ids": tok.encode(prompt, add_special_tokens=False),
                "output_token_ids": tok.encode(text, add_special_tokens=False) + [end],
                "generation": {"enable_thinking": True}}

    step0 = record("r", history, turn("Need the tool.", "", PARIS))
    result = {"role": "tool", "content": '{"temp": 21}'}
    step1 = record("r-g1", history + [assistant_turn(step0), result], turn("It is 21C.", "21C in Paris."))
    assert "<tool_call>\n<function=get_weather>" in step0["text"]
    as_text = [{**r, "id": r["id"] + "-text", "prompt_token_ids": None, "output_token_ids": None} for r in (step0, step1)]
    stats, t, index = run(tmp_path, tok, [step0, step1, *as_text])
    off = t["offsets"].tolist()
    rows = [t["input_ids"][off[i]:off[i + 1]].tolist() for i in range(4)]
    assert rows[0] == rows[2] and rows[1] == rows[3] and rows[0] != rows[1]
    prompt1 = tok.decode(step1["prompt_token_ids"])
    assert "Greet." not in prompt1 and "Need the tool." in prompt1 and prompt1.count("<tool_call>") == 3  # 2 in the tools instructions
    assert stats["retokenize_differs"] == 0 and stats["boundary_unstable"] == 0 and stats["text_mismatch"] == 0
    assert [r["trainable"] for r in index["rows"]] == [len(step0["output_token_ids"]), len(step1["output_token_ids"])] * 2


@pytest.mark.parametrize("thinking", [True, False])
def test_windowed_boundary_check_agrees_with_encoding_the_whole_conversation(tok, thinking):
    from dflash.core.chat import render_conversation, render_prompt
    from dflash.tokenize.stage import Encoder

    enc = Encoder(tok)
    starts = ["Two plus two.", "\nA newline first.", "\n\nTwo newlines.", " A space.", "   \n  mixed", "123 digits",
              "😀 emoji", "\u0301combining", "", "word" * 100, "\n" * 300 + "many newlines", "Über"]
    verdicts = []
    for start in starts:
        rec = {"messages": MESSAGES, "tools": None, "generation": {"enable_thinking": thinking},
               "reasoning": start if thinking else None, "content": "4" if thinking else start}
        prompt, full = render_prompt(rec, tok), render_conversation(rec, tok)
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
        whole = tok.encode(full, add_special_tokens=False)[:len(prompt_ids)] == prompt_ids
        assert enc.boundaries_stable([prompt], [prompt_ids], [full]) == [whole], repr(start)
        verdicts.append(whole)
    # the template trims what it renders; with thinking on, an empty think block is the unstable case
    assert all(verdicts) if not thinking else (True in verdicts and False in verdicts)


@pytest.mark.parametrize("answer", ["\nmerges with the prompt's newline", "\r\nCRLF", "plain", " \n mixed", "\n" * 200 + "x",
                                    "<|im_end|>right away", "\n<tool_call>\n", "'s contraction", "1234"])
def test_windowed_boundary_check_on_raw_continuations(tok, answer):
    from dflash.tokenize.stage import Encoder

    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    full = prompt + answer
    whole = tok.encode(full, add_special_tokens=False)[:len(prompt_ids)] == prompt_ids
    assert Encoder(tok).boundaries_stable([prompt], [prompt_ids], [full]) == [whole]


OPENAI_CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def history(arguments) -> list[dict]:
    """A replayed conversation as an OpenAI-format source holds it: the call's arguments are whatever
    the source wrote (the wire's JSON string, or a mapping)."""
    call = {**OPENAI_CALL, "function": {**OPENAI_CALL["function"], "arguments": arguments}}
    return [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": '{"temp": 21}'}]


def test_openai_style_history_with_string_arguments_renders_as_mappings(tmp_path, tok, capsys):
    from tests.test_adopt import TOOLS

    def rec(rid, arguments):
        text = "It is 21C.\n</think>\n\n21C in Paris."
        return {"id": rid, "category": "tool", "messages": history(arguments), "tools": TOOLS, "text": text,
                "reasoning": "It is 21C.\n", "content": "\n\n21C in Paris.", "finish_reason": "stop",
                "prompt_token_ids": None, "output_token_ids": None, "generation": {"enable_thinking": True}}

    stats, t, index = run(tmp_path, tok, [rec("wire", '{"city": "Paris"}'), rec("mapping", {"city": "Paris"})])
    off = t["offsets"].tolist()
    assert stats["rows"] == 2 and t["input_ids"][off[0]:off[1]].tolist() == t["input_ids"][off[1]:off[2]].tolist()
    assert "<parameter=city>\nParis\n</parameter>" in tok.decode(t["input_ids"][off[0]:off[1]].tolist())
    # arguments that are not JSON: the record is named, nothing is written
    write_jsonl_zst(tmp_path / "bad.jsonl.zst", map(validated, [rec("fine", {"city": "Paris"}), rec("bad", '{"city": ')]))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/bad.jsonl.zst: record bad: tool call 'get_weather': "
                                         r"arguments are not valid JSON \(Expecting value\)"):
        tokenize_shard(tmp_path / "bad.jsonl.zst", tmp_path / "b.safetensors", tmp_path / "b.json", tok,
                       {"max_length": 4096, "retokenize_sample": 1.0})
    assert not (tmp_path / "b.safetensors").exists() and not (tmp_path / "b.json").exists()
    # the CLI twin says so in one line
    from dflash.cli import main
    from tests.conftest import ROOT

    capsys.readouterr()
    rc = main(["tokenize", "--config", str(ROOT / "config.yaml"), "--validated", str(tmp_path / "bad.jsonl.zst"),
               "--target", tok.name_or_path, "--out", str(tmp_path / "b.safetensors"), "--index", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith(f"dflash tokenize: {tmp_path}/bad.jsonl.zst: record bad: tool call")
    assert not any("Traceback" in line for line in err), err


def test_a_duplicated_id_is_refused(tmp_path, tok):
    a = with_ids(tok, "a", "Two plus two is four.\n</think>\n\n4")
    write_jsonl_zst(tmp_path / "v.jsonl.zst", map(validated, [a, with_ids(tok, "b", "Four.\n</think>\n\n4"), a]))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/v.jsonl.zst: record id a appears twice"):
        tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", tok,
                       {"max_length": 4096, "retokenize_sample": 1.0})
    assert not (tmp_path / "t.safetensors").exists() and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("part", ["prompt", "output"])
def test_an_id_outside_the_vocabulary_is_refused_with_its_record(tmp_path, tok, part):
    """Decoding drops such an id without a word; the hidden stage would blame another tokenizer."""
    bad = with_ids(tok, "b", "Four.\n</think>\n\n4")
    bad[f"{part}_token_ids"] = bad[f"{part}_token_ids"][:2] + [len(tok)] + bad[f"{part}_token_ids"][2:]
    write_jsonl_zst(tmp_path / "v.jsonl.zst", map(validated, [with_ids(tok, "a", "Four."), bad]))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/v.jsonl.zst: record b: {part} id {len(tok)} outside the "
                                         rf"target's vocabulary of {len(tok)}: generated by another model or "
                                         rf"tokenizer than this target's; generate it again with this target$"):
        tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", tok,
                       {"max_length": 4096, "retokenize_sample": 1.0})
    assert not (tmp_path / "t.safetensors").exists() and not (tmp_path / "t.json").exists()
