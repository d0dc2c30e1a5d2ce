"""Error paths of the ``openai`` backend. A 500, a hang and a malformed body cannot be had from a
real inference server on demand, so a small local HTTP server fakes exactly those faults (and only
those); everything else is tested against real servers (test_generate_server, test_generate_vllm)."""
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
        status, body = {"500": (500, b'{"error": "boom"}'), "garbage": (200, b"<html>not json</html>"),
                        "nochoices": (200, b'{"object": "chat.completion"}'), "slow": (200, b"{}")}[fault]
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


@pytest.mark.parametrize("fault,message,retries", [
    ("500", 'RuntimeError: HTTP 500 from http://127.0.0.1:', 2),
    ("slow", "ConnectionError: http://127.0.0.1:", 2),
    ("garbage", "ValueError: malformed response from http://127.0.0.1:", 0),
    ("nochoices", "ValueError: malformed response from http://127.0.0.1:", 0),
])
def test_fault_becomes_error_records_or_a_clear_failure(fault_server, fault, message, retries, tmp_path,
                                                        target_dir, demo_sources):
    write_jsonl_zst(tmp_path / "p.jsonl.zst", list(read_source(demo_sources[0]))[:2])
    cfg = {"backend": "openai", "enable_thinking": True, "max_error_fraction": 0.0,
           "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 8, "seed": 0},
           "server": {"url": f"{fault_server}/{fault}/v1", "dialect": "openai", "model": "m", "api_key_env": None,
                      "timeout_s": 0.5, "retries": 1, "extra_body": {}, "concurrency": 1}}
    with pytest.raises(RuntimeError, match=f"2 of 2 prompts failed \\(e.g. {message}"):
        generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir, cfg)
    summary = generate_shard(tmp_path / "p.jsonl.zst", tmp_path / "c.jsonl.zst", target_dir,
                             {**cfg, "max_error_fraction": 1.0}, summary_path=tmp_path / "s.json")
    recs = read_jsonl(tmp_path / "c.jsonl.zst")
    assert [r["finish_reason"] for r in recs] == ["error", "error"] and all(r["error"].startswith(message) for r in recs)
    assert summary["errors"] == 2 and summary["retries"] == retries
    assert json.loads((tmp_path / "s.json").read_text())["errors"] == 2
