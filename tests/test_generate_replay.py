"""Replay of tool conversations, with the transformers backend and a scripted decode.

The tiny target cannot be relied on to call the right tool, so each test scripts what it says:
the real model runs in the real (batched) decoding loop on the real rendered prompts, its scores
overwritten to leave only the next token of a scripted reply chosen from what each prompt holds
(how many tool results came back so far). Rendering, tokenization, parsing of the calls and the
feeding of cached results are the pipeline's own.
"""
import json

import pytest

from dflash.generate import backends
from dflash.generate.backends import TransformersBackend, resolve_sampling
from dflash.generate.stage import generate_shard
from dflash.generate.replay import generate_conversation
from dflash.generate.resume import partial_path
from dflash.core.io import read_json, read_jsonl, write_jsonl_zst
from dflash.prompts.stage import read_source
from tests.helpers import record_errors

CFG = {"backend": "transformers", "enable_thinking": True, "max_error_fraction": 0.0,
       "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 200, "seed": 0}}


def xml_call(name: str, **args) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


RATE = "I need the EUR to GBP rate first.\n</think>\n\n" + xml_call("get_exchange_rate", base="EUR", quote="GBP")
CONVERT = "Rate is 0.8391; now convert 300 EUR.\n</think>\n\n" + xml_call(
    "convert_currency", amount=300, from_currency="EUR", to_currency="GBP")
ANSWER = "Both results agree.\n</think>\n\n300 euros is about 251.73 pounds at 0.8391."


def scripted(backend: TransformersBackend, replies: list[str]) -> TransformersBackend:
    """Make ``backend`` say ``replies[k]`` when its prompt holds k tool results."""
    tok, model = backend.tokenizer, backend.model
    real = type(model).forward.__get__(model)  # the class's, not an earlier script's
    end = tok.convert_tokens_to_ids("<|im_end|>")
    scripts = []  # what each row of the batch has still to say

    def forward(input_ids, past_key_values=None, **kwargs):
        out = real(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        if past_key_values is None:  # a new batch: one script a prompt
            scripts[:] = [tok.encode(replies[min(tok.decode(row).count("<tool_response>"), len(replies) - 1)],
                                     add_special_tokens=False) + [end] for row in input_ids]
        else:  # a row that said its last token has left the batch
            scripts[:] = [script for script in scripts if script]
        out.logits[:, -1] = float("-inf")
        for row, script in enumerate(scripts):
            out.logits[row, -1, script.pop(0)] = 0
        return out

    model.forward = forward
    return backend


@pytest.fixture(scope="module")
def exchange_prompt(demo_sources):
    """The demo's two-step conversation: get_exchange_rate, then convert_currency, then the answer."""
    tool_source = next(s for s in demo_sources if s["name"] == "demo-tool")
    prompt = next(r for r in read_source(tool_source)
                  if [s["calls"] for s in r["meta"].get("replay", [])] == [["get_exchange_rate"], ["convert_currency"]])
    assert [m["role"] for m in prompt["messages"]] == ["user"]
    return prompt


@pytest.fixture(scope="module")
def backend(target_dir):
    return TransformersBackend(target_dir, CFG)


def run(backend, prompt, replies):
    scripted(backend, replies)
    return generate_conversation(prompt, backend, resolve_sampling(CFG, backend.generation_config()), True)


def test_two_step_conversation_is_replayed_with_cached_results(backend, exchange_prompt):
    tok = backend.tokenizer
    recs = run(backend, exchange_prompt, [RATE, CONVERT, ANSWER])
    pid = exchange_prompt["id"]
    assert [r["id"] for r in recs] == [pid, f"{pid}-g1", f"{pid}-g2"]
    assert {r["prompt_id"] for r in recs} == {pid}
    assert [(r["replay"]["step"], r["replay"]["steps"], r["replay"]["stop"]) for r in recs] == [
        (0, 2, None), (1, 2, None), (2, 2, "completed")]
    assert [r["text"] for r in recs] == [RATE, CONVERT, ANSWER]
    steps = exchange_prompt["meta"]["replay"]
    first, second, third = recs
    # each generation's conversation = the previous one + the model's turn + the cached results
    assert second["messages"][:-2] == first["messages"] and second["messages"][-1] == steps[0]["results"][0]
    turn = second["messages"][-2]
    assert turn["reasoning_content"] == first["reasoning"]
    assert turn["tool_calls"] == [{"type": "function", "function": {
        "name": "get_exchange_rate", "arguments": {"base": "EUR", "quote": "GBP"}}}]
    assert third["messages"][:-2] == second["messages"] and third["messages"][-1] == steps[1]["results"][0]
    for rec in recs:
        assert record_errors("completion", rec) == []
        rendered = tok.apply_chat_template(rec["messages"], tools=rec["tools"], add_generation_prompt=True,
                                           enable_thinking=True, tokenize=False)
        assert rec["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
        assert rec["text"] == tok.decode(rec["output_token_ids"][:-1], skip_special_tokens=False)
    last_prompt = tok.decode(third["prompt_token_ids"])
    # the template keeps the reasoning of agent-loop turns and shows the model its own calls
    assert "<think>\nI need the EUR to GBP rate first.\n</think>" in last_prompt
    assert xml_call("convert_currency", amount=300, from_currency="EUR", to_currency="GBP") in last_prompt
    assert last_prompt.count("<tool_response>") == 2 and '"result": 251.73' in last_prompt


@pytest.mark.parametrize("replies, stop, detail", [
    ([CONVERT], "other_tool", "called convert_currency; the source called get_exchange_rate"),
    (["Let me guess.\n</think>\n\nAbout 250 pounds."], "no_call",
     "answered without a tool call; the source called get_exchange_rate"),
    (["Both.\n</think>\n\n" + xml_call("get_exchange_rate", base="EUR", quote="GBP") + "\n"
      + xml_call("convert_currency", amount=300, from_currency="EUR", to_currency="GBP")],
     "parallel_calls", "called get_exchange_rate, convert_currency; the source called get_exchange_rate"),
])
def test_a_mismatch_stops_the_conversation_with_the_reason(backend, exchange_prompt, replies, stop, detail):
    recs = run(backend, exchange_prompt, replies)
    assert len(recs) == 1 and recs[0]["id"] == exchange_prompt["id"]
    assert recs[0]["replay"] == {"step": 0, "steps": 2, "stop": stop, "detail": detail}


def test_a_call_after_the_last_cached_result_stops_the_conversation(backend, exchange_prompt):
    recs = run(backend, exchange_prompt, [RATE, CONVERT, RATE])
    assert [r["replay"]["stop"] for r in recs] == [None, None, "extra_call"]
    assert recs[-1]["replay"]["detail"] == "called get_exchange_rate after the last cached result"


def test_truncated_generation_stops_the_conversation(backend, exchange_prompt, monkeypatch):
    monkeypatch.setitem(CFG["sampling"], "max_tokens", 5)
    recs = run(backend, exchange_prompt, [RATE, CONVERT, ANSWER])
    assert len(recs) == 1 and recs[0]["finish_reason"] == "length"
    assert recs[0]["replay"]["stop"] == "finish_length"


def test_shard_with_replays_resumes_whole_conversations(tmp_path, target_dir, exchange_prompt, demo_sources,
                                                        monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "transformers",
                        lambda target, cfg, repetition: scripted(TransformersBackend(target, cfg), [RATE, CONVERT, ANSWER]))
    chat = next(read_source(next(s for s in demo_sources if s["name"] == "demo-chat")))
    shard, out = tmp_path / "shard-00000.jsonl.zst", tmp_path / "out.jsonl.zst"
    write_jsonl_zst(shard, [exchange_prompt, chat])
    cfg = {**CFG, "batch_size": 2}  # the conversation's steps decoded beside the chat prompt
    summary = generate_shard(shard, out, target_dir, cfg, tmp_path / "summary.json")
    full = read_jsonl(out)
    pid = exchange_prompt["id"]
    assert [r["id"] for r in full] == [pid, f"{pid}-g1", f"{pid}-g2", chat["id"]]
    assert summary["prompts"] == 2 and summary["records"] == summary["requests"] == 4
    assert read_json(tmp_path / "summary.json")["replay_stops"] == {"completed": 1}

    # killed while writing the conversation: its records are incomplete, so it is generated again
    partial_path(out).write_text(json.dumps(full[3]) + "\n" + json.dumps(full[0]) + "\n" + json.dumps(full[1])[:50])
    out.unlink()
    summary = generate_shard(shard, out, target_dir, cfg)
    assert summary["resumed"] == 1 and summary["requests"] == 3
    assert read_jsonl(out) == full
