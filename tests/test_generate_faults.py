"""Error paths of the ``openai`` backend. A 500, a hang, a malformed body, an error body that
echoes the request's key, a stream dropped mid-answer (chunked or not), an empty stream, keep-alive
comments that never end, ``finish_reason: null``, another model's reply, a truncated prompt and
output ids outside the target's vocabulary cannot be had from a real inference server on demand, so
a small local HTTP server fakes exactly those faults (and only those); a dead server is a real closed
port, and everything else is tested against real servers (test_generate_server, test_generate_vllm)."""
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash.core.chat import render
from dflash.generate.stage import generate_shard
from dflash.core.io import read_jsonl, write_jsonl_zst
from dflash.prompts.stage import read_source


class Faults(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server hook name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fault = self.path.split("/")[1]
        if fault in STREAMS:
            return self.stream(fault, request)
        if fault in REPLIES:
            return self.send(200, json.dumps(self.reply(fault, request)).encode())
        if fault == "cutbody":  # the connection drops mid-reply: the body ends short of its Content-Length
            body = json.dumps(self.reply("reply", request)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return self.wfile.write(body[:len(body) // 2])
        if fault == "slow":
            time.sleep(1.5)
        echo = json.dumps({"error": f"invalid key {self.headers.get('Authorization')}"}).encode()
        self.send(*{"500": (500, b'{"error": "boom"}'), "garbage": (200, b"<html>not json</html>"),
                    "nochoices": (200, b'{"object": "chat.completion"}'), "slow": (200, b"{}"),
                    "echo": (401, echo)}[fault])

    def send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def prompt_ids(self, request):
        """The prompt's ids as vLLM renders them: the same template and tokenizer as ours."""
        tok = self.server.tokenizer
        text = render(request["messages"], request.get("tools"), tok, request["chat_template_kwargs"]["enable_thinking"])
        return tok.encode(text, add_special_tokens=False)

    def reply(self, fault, request):
        """A whole reply of vLLM's shape, the fault in it."""
        prompt, ids = self.prompt_ids(request), self.server.output_ids
        choice = {"index": 0, "message": {"role": "assistant", "content": "Four."}, "finish_reason": "stop",
                  "token_ids": ids}
        reply = {"model": request["model"], "prompt_token_ids": prompt, "choices": [choice],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
        if fault == "nullfinish":
            choice["finish_reason"] = None
        elif fault == "othermodel":
            reply["model"] = "other-model-7b"
        elif fault == "revision":  # `transformers serve` names the revision it loaded
            reply["model"] = f"{request['model']}@main"
        elif fault == "truncated":  # a server that cut the prompt to its context
            reply["prompt_token_ids"] = prompt[:-3]
        elif fault == "oov":
            choice["token_ids"] = [ids[0], 1_000_000, *ids[1:]]
        return reply

    def stream(self, fault, request):
        """An SSE stream of vLLM's shape (prompt ids first, an id or two a chunk, the finish reason
        on the last), cut or padded as ``fault`` says."""
        chunked = fault == "cut-chunked"
        if chunked:  # a real server's stream (uvicorn): HTTP/1.1, chunked
            self.protocol_version, self.close_connection = "HTTP/1.1", True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def write(data: bytes):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.wfile.flush()

        if fault == "ping":  # keep-alive comments and nothing else, for up to 30 s
            for _ in range(600):
                write(b": ping\n\n")
                time.sleep(0.05)
            return
        ids = self.server.output_ids
        chunks = [{"model": request["model"], "prompt_token_ids": self.prompt_ids(request),
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}]
        chunks += [{"model": request["model"], "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [i],
                                                            "finish_reason": None}]} for i in ids]
        if fault == "othermodel-stream":
            for c in chunks:
                c["model"] = "other-model-7b"
        if fault == "oov-stream":
            chunks[2]["choices"][0]["token_ids"] = [1_000_000]
        if fault in ("cut", "cut-chunked"):
            chunks = chunks[:3]  # the connection drops mid-answer: no finish reason, no [DONE]
        elif fault == "empty":
            chunks = []
        else:
            chunks[-1]["choices"][0]["finish_reason"] = "stop"
        for c in chunks:
            write(b"data: " + json.dumps(c).encode() + b"\n\n")
        if fault not in ("cut", "cut-chunked"):
            write(b"data: [DONE]\n\n")
            if chunked:
                write(b"")

    def log_message(self, *args):
        pass


STREAMS = ("stream", "cut", "cut-chunked", "empty", "ping", "oov-stream", "othermodel-stream")
REPLIES = ("reply", "nullfinish", "othermodel", "revision", "truncated", "oov")


@pytest.fixture(scope="module")
def fault_server(target_dir):
    from transformers import AutoTokenizer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Faults)
    server.daemon_threads = True  # a ping stream the client gave up on must not hold the shutdown
    server.tokenizer = tok = AutoTokenizer.from_pretrained(target_dir)
    server.output_ids = tok.encode("Four.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def settings(url, **server):
    return {"backend": "openai", "enable_thinking": True, "max_error_fraction": 0.0,
            "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 8, "seed": 0},
            "server": {"url": url, "dialect": "openai", "model": "m", "api_key_env": None, "timeout_s": 0.5,
                       "retries": 1, "extra_body": {}, "concurrency": 1, "max_connection_failures": 16, **server}}


VLLM, STREAMED = {"dialect": "vllm", "stream": False}, {"dialect": "vllm", "stream": True}
UNFINISHED = "ConnectionError: http://127.0.0.1:\\d+/{}/v1: the stream ended after {} tokens without a finish reason"


@pytest.mark.parametrize("fault,server,message,retries", [
    ("500", {}, "RuntimeError: HTTP 500 from http://127.0.0.1:", 2),
    ("slow", {}, "ConnectionError: http://127.0.0.1:", 2),
    ("garbage", {}, "ValueError: malformed response from http://127.0.0.1:", 0),
    ("nochoices", {}, "ValueError: malformed response from http://127.0.0.1:", 0),
    # never a stop record of a cut answer: the request failed, is retried, and ends as an error record
    ("cut", STREAMED, UNFINISHED.format("cut", 2), 2),
    ("cut-chunked", STREAMED, UNFINISHED.format("cut-chunked", 2), 2),
    ("empty", STREAMED, UNFINISHED.format("empty", 0), 2),
    ("cutbody", VLLM, "ConnectionError: http://127.0.0.1:\\d+/cutbody/v1: the reply ended \\d+ bytes short of its "
                      "Content-Length", 2),
    ("nullfinish", VLLM, "ConnectionError: http://127.0.0.1:\\d+/nullfinish/v1: the reply has finish_reason null: "
                         "the server never said the generation finished", 2),
    ("ping", STREAMED, "ConnectionError: http://127.0.0.1:\\d+/ping/v1: no complete reply within "
                       "generate.server.timeout_s \\(0.5 s\\)", 2),
    ("truncated", VLLM, "ValueError: the server's prompt ids differ from ours at position (\\d+) \\(server \\1 ids, "
                        "ours \\d+\\): a prompt the server truncated", 0),
    ("oov", VLLM, "ValueError: output id 1000000 outside the target's vocabulary of 4096: the server runs another "
                  "model or tokenizer", 0),
    ("oov-stream", STREAMED, "ValueError: output id 1000000 outside the target's vocabulary of 4096", 0),
])
def test_fault_becomes_error_records_or_a_clear_failure(fault_server, fault, server, message, retries, tmp_path,
                                                        target_dir, demo_sources):
    write_jsonl_zst(tmp_path / "p.jsonl.zst", list(read_source(demo_sources[0]))[:2])
    cfg = settings(f"{fault_server}/{fault}/v1", **server)
    t0 = time.time()
    with pytest.raises(RuntimeError, match=f"2 of 2 prompts failed \\(e.g. record [0-9a-f]+: {message}"):
        generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, cfg)
    assert time.time() - t0 < 10  # the keep-alive stream too: timeout_s bounds each try
    summary = generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir,
                             {**cfg, "max_error_fraction": 1.0}, summary_path=tmp_path / "s.json")
    recs = read_jsonl(tmp_path / "c.jsonl.zst")
    assert [r["finish_reason"] for r in recs] == ["error", "error"] and all(re.match(message, r["error"]) for r in recs)
    assert summary["errors"] == 2 and summary["retries"] == retries
    assert json.loads((tmp_path / "s.json").read_text())["errors"] == 2


@pytest.mark.parametrize("fault,server", [("reply", VLLM), ("stream", STREAMED), ("revision", VLLM)])
def test_the_fake_servers_whole_answer_is_a_stop_record(fault_server, fault, server, tmp_path, target_dir,
                                                        demo_sources):
    """The fake's faults are faults: its whole answer, streamed or not, passes every check; so does
    one naming the model with the revision it loaded (``m@main``), as ``transformers serve`` does."""
    write_jsonl_zst(tmp_path / "p.jsonl.zst", list(read_source(demo_sources[0]))[:1])
    generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir,
                   settings(f"{fault_server}/{fault}/v1", **server))
    (rec,) = read_jsonl(tmp_path / "c.jsonl.zst")
    assert rec["finish_reason"] == "stop" and rec["text"] == "Four." and rec["prompt_token_ids"]


@pytest.mark.parametrize("fault,server", [("othermodel", VLLM), ("othermodel-stream", STREAMED)])
def test_another_models_answer_fails_the_job(fault_server, fault, server, tmp_path, target_dir, demo_sources, capsys):
    """Every record would be the other model's: the job stops at the first reply, one line naming
    the shard, the record and both models, and keeps no record of it."""
    from dflash.cli import main
    from dflash.generate.resume import partial_path

    prompts = list(read_source(demo_sources[0]))[:3]
    write_jsonl_zst(tmp_path / "p.jsonl.zst", prompts)
    cfg = settings(f"{fault_server}/{fault}/v1", **server)
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"prompts": {"sources": [{"name": "x", "path": "x.jsonl"}]}, "generate": cfg}))
    rc = main(["generate", "--config", str(config), "--prompts", str(tmp_path / "p.jsonl.zst"), "--target",
               str(target_dir), "--out", str(tmp_path / "c.jsonl.zst")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 1 and err[-1] == (
        f"dflash generate: p.jsonl.zst: record {prompts[0]['id']}: server {fault_server}/{fault}/v1 answered with model "
        f"other-model-7b, asked for m: every record would be another model's; point generate.server.url at the "
        f"target's server, or set generate.server.model to the name that server gives the target (the 0 finished "
        f"prompts are kept in {partial_path(tmp_path / 'c.jsonl.zst')})")
    assert not (tmp_path / "c.jsonl.zst").exists() and partial_path(tmp_path / "c.jsonl.zst").read_text() == ""


def test_a_failed_job_writes_no_summary(fault_server, tmp_path, target_dir, demo_sources):
    write_jsonl_zst(tmp_path / "p.jsonl.zst", list(read_source(demo_sources[0]))[:2])
    with pytest.raises(RuntimeError, match="2 of 2 prompts failed"):
        generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir,
                       settings(f"{fault_server}/500/v1"), summary_path=tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "c.jsonl.zst").exists()


def test_a_dead_server_fails_the_job_at_once_keeping_what_finished(tmp_path, target_dir, demo_sources, capsys):
    """A port nothing listens on (the OS refuses every connection, as after a server crash): 50
    prompts, 64 in flight, 3 retries each with backoff. The job stops after 16 refusals in a row
    instead of retrying all 50 prompts for about a minute."""
    from dflash.cli import main
    from dflash.generate.resume import partial_path
    from dflash.generate.server import free_port

    prompts = [r for src in demo_sources for r in read_source(src)][:50]
    write_jsonl_zst(tmp_path / "p.jsonl.zst", prompts)
    cfg = settings(f"http://127.0.0.1:{free_port()}/v1", retries=3, concurrency=64, timeout_s=5)
    t0 = time.time()
    with pytest.raises(ConnectionError) as failure:
        generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, cfg,
                       summary_path=tmp_path / "s.json")
    assert time.time() - t0 < 10
    assert "16 connection failures in a row and no reply since (last: [Errno 111] Connection refused)" in str(failure.value)
    assert f"The 0 finished prompts of p.jsonl.zst are kept in {partial_path(tmp_path / 'c.jsonl.zst')}: start the " \
           "server and re-run to resume" in str(failure.value)
    assert partial_path(tmp_path / "c.jsonl.zst").exists()
    assert not (tmp_path / "c.jsonl.zst").exists() and not (tmp_path / "s.json").exists()
    # the CLI twin: one line
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"prompts": {"sources": [{"name": "x", "path": "x.jsonl"}]}, "generate": cfg}))
    capsys.readouterr()
    rc = main(["generate", "--config", str(config), "--prompts", str(tmp_path / "p.jsonl.zst"), "--target",
               str(target_dir), "--out", str(tmp_path / "c.jsonl.zst")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 1 and err[-1].startswith("dflash generate: http://127.0.0.1:") and "re-run to resume" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_the_api_key_never_reaches_a_record_or_a_log(fault_server, tmp_path, target_dir, demo_sources, monkeypatch,
                                                     caplog):
    monkeypatch.setenv("DFLASH_TEST_KEY", "sk-secret-123")
    write_jsonl_zst(tmp_path / "p.jsonl.zst", list(read_source(demo_sources[0]))[:2])
    cfg = {**settings(f"{fault_server}/echo/v1", api_key_env="DFLASH_TEST_KEY"), "max_error_fraction": 1.0}
    generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, cfg)
    errors = [r["error"] for r in read_jsonl(tmp_path / "c.jsonl.zst")]
    assert errors == ["RuntimeError: HTTP 401 from " + f'{fault_server}/echo/v1: {{"error": "invalid key Bearer [API key]"}}'] * 2
    assert "sk-secret-123" not in caplog.text and "[API key]" in caplog.text


def test_a_duplicated_prompt_id_is_named(tmp_path, target_dir, demo_sources):
    recs = list(read_source(demo_sources[0]))[:2]
    write_jsonl_zst(tmp_path / "p.jsonl.zst", [recs[0], recs[1], recs[0]])
    with pytest.raises(ValueError, match=f"p.jsonl.zst: prompt id {recs[0]['id']} appears more than once"):
        generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, settings("http://127.0.0.1:9/v1"))
