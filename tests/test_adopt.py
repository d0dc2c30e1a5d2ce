"""Adopting logged SGLang/vLLM chat completions: ``text`` is rebuilt exactly as the model emitted it.

What the model emits is taken from the real chat template: the tokens after the generation
prompt in the rendered conversation, up to the end of turn. The responses are hand-written as
each server returns them for that output: SGLang 0.5.23 (qwen3 + qwen3_coder/qwen25 parsers, see
``dflash/generate/adopt.py``) and vLLM 0.32.0 (qwen3 + qwen3_coder/hermes; the vLLM fields were read off
its own parser run on these outputs).
"""
import json

import pytest
from safetensors.torch import load_file

from dflash.generate.adopt import adopted_record
from dflash.core.chat import rebuild_text, render_call
from dflash.generate.stage import generate_shard
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from dflash.prompts.stage import build_prompts
from tests.helpers import record_errors
from dflash.core.chat import render_prompt
from dflash.tokenize.stage import tokenize_shard
from tests.test_tokenize import validated

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "opts": {"type": "object"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
ROME = {"name": "get_weather", "arguments": {"city": "Rome", "opts": {"a": None, "b": True}}}


def wire(*calls):
    """Tool calls as a server returns them: arguments as a JSON string."""
    return [{"id": f"call_{i}", "index": i, "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def emitted(tok, messages, turn, thinking=True, tools=TOOLS):
    """What the model writes for ``turn`` when it follows its template: the rendered conversation
    after the generation prompt, without the end of turn."""
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, enable_thinking=thinking,
                                     tokenize=False)
    full = tok.apply_chat_template(messages + [turn], tools=tools, enable_thinking=thinking, tokenize=False)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    return full[len(prompt):-len("<|im_end|>\n")]


def turn(reasoning, content, *calls):
    t = {"role": "assistant", "content": content, "tool_calls": [{"type": "function", "function": c} for c in calls]}
    return {**t, "reasoning_content": reasoning} if reasoning is not None else t


# (name, assistant turn for the template, thinking, {server: message as that server returns it})
CASES = [
    ("plain answer", turn("Two and two.", "It is 4."), True, {
        "sglang": {"role": "assistant", "content": "\n\nIt is 4.", "reasoning_content": "Two and two.\n"},
        "vllm": {"role": "assistant", "content": "\n\nIt is 4.", "reasoning": "Two and two.\n"}}),
    ("call only", turn("Need the tool.", "", PARIS), True, {
        "sglang": {"role": "assistant", "content": "\n\n", "reasoning_content": "Need the tool.\n",
                   "tool_calls": wire(PARIS)},
        "vllm": {"role": "assistant", "content": None, "reasoning": "Need the tool.\n", "tool_calls": wire(PARIS)}}),
    ("text then two calls", turn("Two cities.", "Let me check both.", PARIS, ROME), True, {
        "sglang": {"role": "assistant", "content": "\n\nLet me check both.\n\n", "reasoning_content": "Two cities.\n",
                   "tool_calls": wire(PARIS, ROME)},
        "vllm": {"role": "assistant", "content": "Let me check both.", "reasoning": "Two cities.\n",
                 "tool_calls": wire(PARIS, ROME)}}),
    ("thinking off", turn(None, "It is 4."), False, {
        "sglang": {"role": "assistant", "content": "It is 4.", "reasoning_content": None},
        "vllm": {"role": "assistant", "content": "It is 4.", "reasoning": None}}),
    ("thinking off, call only", turn(None, "", PARIS), False, {
        "sglang": {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": wire(PARIS)},
        "vllm": {"role": "assistant", "content": None, "reasoning": None, "tool_calls": wire(PARIS)}}),
    ("thinking off, text then call", turn(None, "Checking.", PARIS), False, {
        "sglang": {"role": "assistant", "content": "Checking.\n\n", "reasoning_content": None,
                   "tool_calls": wire(PARIS)},
        "vllm": {"role": "assistant", "content": "Checking.", "reasoning": None, "tool_calls": wire(PARIS)}}),
]


@pytest.fixture
def tok(target):
    return target[1]


@pytest.mark.parametrize("server", ["sglang", "vllm"])
@pytest.mark.parametrize("name,assistant,thinking,responses", CASES, ids=[c[0] for c in CASES])
def test_rebuilt_text_is_what_the_template_renders(tok, server, name, assistant, thinking, responses):
    raw = emitted(tok, ASK, assistant, thinking)
    text, verbatim = rebuild_text(responses[server], thinking, "stop", server)
    assert text == raw
    # SGLang's qwen3_coder keeps every character; vLLM strips the text before calls, restored by rule
    restored = server == "vllm" and assistant["tool_calls"] and (thinking or assistant["content"])
    assert verbatim == (not restored)


def test_call_rendering_matches_the_template_for_every_value_type(tok):
    call = {"name": "f", "arguments": {"s": "multi\nline", "i": 3, "x": 1.5, "b": False, "n": None, "l": [1, "a"],
                                       "o": {"k": "ü"}}}
    raw = emitted(tok, ASK, turn("R", "", call), tools=None)
    assert raw.endswith(render_call({"type": "function", "function": {**call, "arguments": json.dumps(call["arguments"])}},
                                    "xml"))


def test_hermes_calls_and_stripped_text():
    """Qwen3's Hermes format (DESIGN reference: SGLang qwen25 strips the text, vLLM hermes keeps it)."""
    calls = wire(PARIS, ROME)
    expected = ('R\n</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
                '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "opts": '
                '{"a": null, "b": true}}}\n</tool_call>')
    vllm = {"content": "\n\nSure.\n", "reasoning": "R\n", "tool_calls": calls}
    assert rebuild_text(vllm, True, "stop", "vllm", "hermes") == (expected, True)
    sglang = {"content": "Sure.", "reasoning_content": "R\n", "tool_calls": calls}
    assert rebuild_text(sglang, True, "stop", "sglang", "hermes") == (expected, False)


def test_length_cut_inside_reasoning_gets_no_think_close():
    assert rebuild_text({"content": "", "reasoning_content": "Still thin"}, True, "length") == ("Still thin", True)
    assert rebuild_text({"content": None, "reasoning": "Still thin"}, True, "length", "vllm") == ("Still thin", True)
    assert rebuild_text({"content": "\n\nIt is", "reasoning_content": "R\n"}, True, "length") == ("R\n</think>\n\nIt is", True)
    with pytest.raises(ValueError, match="thinking off"):
        rebuild_text({"content": "x", "reasoning_content": "R"}, False)


def sglang_response(message, finish="stop", **extra):
    return {"id": "x", "object": "chat.completion", "model": "Qwen/Qwen3.6-27B", "choices": [
        {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "matched_stop": None, **extra}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}


def vllm_response(message, finish="stop"):
    return {"id": "x", "object": "chat.completion", "model": "Qwen/Qwen3.6-27B", "choices": [
        {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None,
         "token_ids": None}], "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}


def request(messages, tools=TOOLS, thinking=True):
    return {"model": "Qwen/Qwen3.6-27B", "messages": messages, "tools": tools, "temperature": 0.6, "top_p": 0.95,
            "top_k": 20, "max_tokens": 4096, "chat_template_kwargs": {"enable_thinking": thinking}}


# An agent loop in the request: an earlier question with its answer (reasoning dropped by the
# template) and the current query's tool call with reasoning (kept) and its result, all on the wire.
HISTORY = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": wire(PARIS)},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21}'},
]


def exchanges(tok):
    """(logged line, the model's raw output) pairs covering both servers and the line layouts."""
    cases = {name: (assistant, thinking, responses) for name, assistant, thinking, responses in CASES}
    out = []
    for server, respond in (("sglang", sglang_response), ("vllm", vllm_response)):
        for name in ("plain answer", "text then two calls", "thinking off, call only"):
            assistant, thinking, responses = cases[name]
            finish = "tool_calls" if assistant["tool_calls"] else "stop"
            out.append(({"request": request(ASK, thinking=thinking), "response": respond(responses[server], finish),
                         "category": "tool"}, emitted(tok, ASK, assistant, thinking)))
    final = turn("It is 21C there.", "21C in Paris.")
    raw = emitted(tok, [{**m, "reasoning_content": m.pop("reasoning")} if "reasoning" in m else m
                        for m in (dict(m, tool_calls=[{"type": "function", "function": PARIS}]) if m.get("tool_calls")
                                  else dict(m) for m in HISTORY)], final)
    batch = {"custom_id": "req-7", "method": "POST", "url": "/v1/chat/completions", "body": request(HISTORY),
             "response": {"status_code": 200, "request_id": "r7", "body": vllm_response(
                 {"role": "assistant", "content": "\n\n21C in Paris.", "reasoning": "It is 21C there.\n"})}}
    out.append((batch, raw))
    cut = {"request": request(ASK), "response": sglang_response(
        {"role": "assistant", "content": "", "reasoning_content": "Paris first, then"}, "length")}
    out.append((cut, "Paris first, then"))
    return out


def adopt(tmp_path, tok, target_dir, lines, path=None, max_error_fraction=0.0):
    src = tmp_path / "logged.jsonl.zst"
    write_jsonl_zst(src, lines)
    build_prompts([{"name": "logged", "path": path or str(src), "format": "chat_completions", "split": "train"}],
                  tmp_path / "prompts", shard_size=100)
    cfg = {"backend": "openai", "enable_thinking": True, "server": {"concurrency": 1},
           "max_error_fraction": max_error_fraction}
    summary = generate_shard(tmp_path / "prompts/shard-00000.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, cfg)
    return summary, read_jsonl(tmp_path / "c.jsonl.zst")


def test_imported_exchanges_become_exact_records_and_rows(tmp_path, tok, target_dir):
    pairs = exchanges(tok)
    summary, records = adopt(tmp_path, tok, target_dir, [line for line, _ in pairs])
    assert summary["adopted"] == len(pairs) and summary["requests"] == 0
    by_text = {r["text"]: r for r in records}
    for line, raw in pairs:  # records are in shard order: match them by the text they must carry
        assert raw in by_text, f"no record with {raw!r}"
        rec = by_text[raw]
        assert record_errors("completion", rec) == []
        assert rec["generation"]["reconstructed"] and rec["generation"]["backend"] == "imported"
    cut = by_text["Paris first, then"]
    assert cut["finish_reason"] == "length" and cut["reasoning"] == "Paris first, then" and cut["content"] == ""
    assert sum(not r["generation"]["verbatim"] for r in records) == 1  # vLLM's stripped text before calls
    off = next(r for r in records if not r["generation"]["enable_thinking"])
    assert off["reasoning"] is None and off["content"].startswith("<tool_call>")

    # rows from text: the prompt as the template renders the request (history reasoning dropped,
    # the agent loop's kept), the text as the continuation, end of turn only after a stop
    write_jsonl_zst(tmp_path / "v.jsonl.zst", map(validated, records))
    stats = tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", tok,
                           {"max_length": 4096, "retokenize_sample": 1.0})
    assert stats["from_text"] == len(records) and stats["boundary_unstable"] == 0
    t, rows = load_file(str(tmp_path / "t.safetensors")), read_json(tmp_path / "t.json")["rows"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for r, row in enumerate(rows):
        rec = next(x for x in records if x["id"] == row["id"])
        ids = t["input_ids"][t["offsets"][r]:t["offsets"][r + 1]].tolist()
        prompt = render_prompt(rec, tok)
        if len(rec["messages"]) > 1:
            assert "Greet back." not in prompt and "Need the tool." in prompt
        expected = tok.encode(prompt + rec["text"] + ("<|im_end|>" if rec["finish_reason"] == "stop" else ""),
                              add_special_tokens=False)
        assert ids == expected and (ids[-1] == end) == (rec["finish_reason"] == "stop")


def test_token_ids_in_the_response_are_kept(tmp_path, tok, target_dir):
    raw = emitted(tok, ASK, turn("Two cities.", "Let me check both.", PARIS, ROME))
    prompt_ids = tok.encode(tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    out_ids = tok.encode(raw, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    message = CASES[2][3]["sglang"]
    line = {"request": request(ASK), "response": {**sglang_response(message, "tool_calls", response_token_ids=out_ids),
                                                  "prompt_token_ids": prompt_ids}}
    _, [rec] = adopt(tmp_path, tok, target_dir, [line])
    assert rec["output_token_ids"] == out_ids and rec["prompt_token_ids"] == prompt_ids
    assert rec["text"] == raw and not rec["generation"]["reconstructed"]


def test_logged_call_cut_at_the_cap_is_a_length_finish(tmp_path, tok, target_dir):
    """A logged reply whose ids stop at max_tokens without a stop token is cut, though the server
    said tool_calls (vLLM does so whenever its parser found a call); without ids, a tool_calls
    reply that used up max_tokens is taken as cut too."""
    raw = emitted(tok, ASK, turn("Two cities.", "Let me check both.", PARIS, ROME))
    prompt_ids = tok.encode(tok.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
    cut_ids = tok.encode(raw, add_special_tokens=False)[:-3]
    capped = {**request(ASK), "max_tokens": len(cut_ids)}
    message = CASES[2][3]["vllm"]
    with_ids = {"request": capped, "response": {**vllm_response(message, "tool_calls"), "prompt_token_ids": prompt_ids}}
    with_ids["response"]["choices"][0]["token_ids"] = cut_ids
    without = {"request": {**request(ASK), "max_tokens": 9}, "response": vllm_response(CASES[1][3]["vllm"], "tool_calls")}
    summary, recs = adopt(tmp_path, tok, target_dir, [with_ids, without])
    assert [r["finish_reason"] for r in recs] == ["length", "length"] and summary["finish_reasons"]["length"] == 2
    (cut,) = [r for r in recs if r["output_token_ids"]]
    assert cut["output_token_ids"] == cut_ids and cut["text"] == tok.decode(cut_ids, skip_special_tokens=False)


def test_a_logged_reply_without_a_finish_reason_is_no_stop_record(tmp_path, tok, target_dir):
    """finish_reason null (a stream the logger saw cut): a failed record, unless a stop token ends
    its output ids, which proves the stop."""
    unfinished = {"request": request(ASK), "response": vllm_response(CASES[0][3]["vllm"], None)}
    raw = emitted(tok, ASK, turn("Two cities.", "Let me check both.", PARIS, ROME))
    out_ids = tok.encode(raw, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    proven = {"request": request(ASK), "response": vllm_response(CASES[2][3]["vllm"], None)}
    proven["response"]["prompt_token_ids"] = tok.encode(tok.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    proven["response"]["choices"][0]["token_ids"] = out_ids
    summary, recs = adopt(tmp_path, tok, target_dir, [unfinished, proven], max_error_fraction=1.0)
    assert sorted(r["finish_reason"] for r in recs) == ["error", "stop"] and summary["errors"] == 1
    failed = next(r for r in recs if r["finish_reason"] == "error")
    assert failed["error"].startswith("ValueError: the logged reply has finish_reason null and no stop token ends its "
                                      "output: an unfinished generation (a dropped stream?), never a stop record")


def test_adopted_from_s3(tmp_path, tok, target_dir, s3):
    line, raw = exchanges(tok)[0]
    write_jsonl_zst(tmp_path / "up.jsonl.zst", [line])
    s3.upload_file(str(tmp_path / "up.jsonl.zst"), "drafter", "logs/day1.jsonl.zst")
    _, [rec] = adopt(tmp_path, tok, target_dir, [], path="s3://drafter/logs/day1.jsonl.zst")
    assert rec["text"] == raw


@pytest.mark.parametrize("line,message", [
    ({"request": request(ASK)}, "logged.jsonl.zst:1: missing field 'response'"),
    ({"request": request(ASK), "response": {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}},
     "logged.jsonl.zst:1: cannot tell whether SGLang or vLLM answered"),
    ({"request": request(ASK, thinking=False), "response": sglang_response({"content": "x", "reasoning_content": "R"})},
     "logged.jsonl.zst:1: reasoning in a reply generated with thinking off"),
    ({"request": request([*ASK, {"role": "system", "content": "late"}]), "response": sglang_response({"content": "x"})},
     "source logged, line 1\\): the chat template cannot render the conversation \\(TemplateError: The system "
     "message must be the first message"),
])
def test_bad_lines_name_file_and_line(tmp_path, tok, target_dir, line, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        adopt(tmp_path, tok, target_dir, [line])


def test_adopted_record_restores_the_think_tag_a_qwen3_model_writes_itself(tok):
    """Qwen3 hybrid templates end the generation prompt at the assistant header: the model opens
    <think> itself and the servers' reasoning parsers drop the tag."""
    import copy

    qwen3 = copy.deepcopy(tok)
    qwen3.chat_template = tok.chat_template.replace("{{- '<think>\\n' -}}", "")
    prompt = {"id": "0123456789abcdef", "source": "s", "category": "chat", "messages": ASK, "tools": None,
              "meta": {"imported": {"server": "sglang", "tool_format": "hermes", "model": "m", "enable_thinking": True,
                                    "sampling": {"temperature": None, "top_p": None, "top_k": None, "seed": None,
                                                 "max_tokens": None},
                                    "message": {"content": "\n\nC", "reasoning_content": "\nR\n"},
                                    "finish_reason": "stop", "usage": {}, "prompt_token_ids": None,
                                    "output_token_ids": None}}}
    assert qwen3.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False).endswith("assistant\n")
    rec = adopted_record(prompt, qwen3, set())
    assert (rec["text"], rec["reasoning"], rec["content"]) == ("<think>\nR\n</think>\n\nC", "\nR\n", "\n\nC")
    assert adopted_record(prompt, tok, set())["text"] == "\nR\n</think>\n\nC"  # Qwen3.6 opened it in the prompt


def test_adopted_record_splits_reasoning_and_content(tok):
    prompt = {"id": "0123456789abcdef", "source": "s", "category": "chat", "messages": ASK, "tools": None,
              "meta": {"imported": {"server": "sglang", "tool_format": "xml", "model": "m", "enable_thinking": True,
                                    "sampling": {"temperature": None, "top_p": None, "top_k": None, "seed": None,
                                                 "max_tokens": None},
                                    "message": {"content": "\n\nC", "reasoning_content": "R\n"}, "finish_reason": "stop",
                                    "usage": {}, "prompt_token_ids": None, "output_token_ids": None}}}
    rec = adopted_record(prompt, tok, set())
    assert (rec["text"], rec["reasoning"], rec["content"]) == ("R\n</think>\n\nC", "R\n", "\n\nC")


@pytest.mark.slow
def test_pipeline_adopts_a_log_instead_of_generating(tmp_path, tok, target_dir):
    """Snakemake on a chat_completions source: no generation, the QA page counts the adopted rows."""
    import yaml

    from tests.test_pipeline import ROOT, snakemake

    pairs = exchanges(tok)
    write_jsonl_zst(tmp_path / "logged.jsonl.zst", [line for line, _ in pairs])
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    # every logged exchange adopted for training: none drawn into a held-out set (prompts.heldout_share)
    config["prompts"] = {"shard_size": 4, "heldout_share": 0, "sources": [
        {"name": "logged", "path": str(tmp_path / "logged.jsonl.zst"), "format": "chat_completions"}]}
    config["target"]["path"] = str(target_dir)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(tmp_path, "--cores", "2", "results/report/qa.html")
    res = tmp_path / "results"
    summaries = [read_json(p) for p in sorted((res / "completions").glob("*.summary.json"))]
    assert [s["adopted"] for s in summaries] == [4, 4] and sum(s["requests"] for s in summaries) == 0
    texts = {r["text"] for p in sorted((res / "completions").glob("*.jsonl.zst")) for r in read_jsonl(p)}
    assert texts == {raw for _, raw in pairs}
    summary = read_json(res / "qa" / "summary.json")
    # the calls rendered back pass every tool-call check; the short demo answers are trivial
    assert all(c["total"] == 0 for name, c in summary["checks"].items() if name.startswith("tool_"))
    assert summary["tokenized"]["from_text"] == summary["kept"] == 4 and (res / "report" / "qa.html").exists()


def test_adopt_command(tmp_path, tok, target_dir, capsys):
    from dflash.cli import main

    pairs = exchanges(tok)
    write_jsonl_zst(tmp_path / "day1.jsonl.zst", [line for line, _ in pairs])
    assert main(["adopt", str(tmp_path / "day1.jsonl.zst"), "--target", str(target_dir), "--out",
                 str(tmp_path / "c.jsonl.zst"), "--category", "chat"]) == 0
    records = read_jsonl(tmp_path / "c.jsonl.zst")
    assert sorted(r["text"] for r in records) == sorted(raw for _, raw in pairs)
    assert {r["category"] for r in records} == {"tool", "chat"}  # the line's own category wins
    assert "8 completion records; finish_length 1, finish_stop 7, whitespace_restored 1, with_ids 0" in capsys.readouterr().err
    write_jsonl_zst(tmp_path / "bad.jsonl.zst", [{"request": request(ASK)}])
    assert main(["adopt", str(tmp_path / "bad.jsonl.zst"), "--target", str(target_dir), "--out",
                 str(tmp_path / "d.jsonl.zst")]) == 1
    assert "bad.jsonl.zst:1: missing field 'response'" in capsys.readouterr().err
    assert not (tmp_path / "d.jsonl.zst").exists()  # nothing half-written
