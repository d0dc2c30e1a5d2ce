"""Error paths of the ``openai`` backend. A 500, a hang, a malformed body and an error body that
echoes the request's key cannot be had from a real inference server on demand, so a small local
HTTP server fakes exactly those faults (and only those); a dead server is a real closed port, and
everything else is tested against real servers (test_generate_server, test_generate_vllm)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash.generate import generate_shard
from dflash.io import read_jsonl, write_jsonl_zst
from dflash.prompts import read_source


class Faults(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - the http.server hook name
        self.rfile.read(int(self.headers["Content-Length"]))
        fault = self.path.split("/")[1]
        if fault == "slow":
            time.sleep(1.5)
        echo = json.dumps({"error": f"invalid key {self.headers.get('Authorization')}"}).encode()
        status, body = {"500": (500, b'{"error": "boom"}'), "garbage": (200, b"<html>not json</html>"),
                        "nochoices": (200, b'{"object": "chat.completion"}'), "slow": (200, b"{}"),
                        "echo": (401, echo)}[fault]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fault_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Faults)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def settings(url, **server):
    return {"backend": "openai", "enable_thinking": True, "max_error_fraction": 0.0,
            "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 8, "seed": 0},
            "server": {"url": url, "dialect": "openai", "model": "m", "api_key_env": None, "timeout_s": 0.5,
                       "retries": 1, "extra_body": {}, "concurrency": 1, "max_connection_failures": 16, **server}}


@pytest.mark.parametrize("fault,message,retries", [
    ("500", 'RuntimeError: HTTP 500 from http://127.0.0.1:', 2),
    ("slow", "ConnectionError: http://127.0.0.1:", 2),
    ("garbage", "ValueError: malformed response from http://127.0.0.1:", 0),
    ("nochoices", "ValueError: malformed response from http://127.0.0.1:", 0),
])
def test_fault_becomes_error_records_or_a_clear_failure(fault_server, fault, message, retries, tmp_path,
                                                        target_dir, demo_sources):
    write_jsonl_zst(tmp_path / "p.jsonl.zst", list(read_source(demo_sources[0]))[:2])
    cfg = settings(f"{fault_server}/{fault}/v1")
    with pytest.raises(RuntimeError, match=f"2 of 2 prompts failed \\(e.g. {message}"):
        generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, cfg)
    summary = generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir,
                             {**cfg, "max_error_fraction": 1.0}, summary_path=tmp_path / "s.json")
    recs = read_jsonl(tmp_path / "c.jsonl.zst")
    assert [r["finish_reason"] for r in recs] == ["error", "error"] and all(r["error"].startswith(message) for r in recs)
    assert summary["errors"] == 2 and summary["retries"] == retries
    assert json.loads((tmp_path / "s.json").read_text())["errors"] == 2


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
    from dflash.resume import partial_path
    from dflash.server import free_port

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
