"""The ``openai`` backend against a real OpenAI-compatible server: ``transformers serve`` running
the demo target on 127.0.0.1 (started and stopped here)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.core.chat import split_reasoning
from dflash.generate.stage import generate_shard
from dflash.generate.resume import partial_path
from dflash.core.io import read_jsonl, write_jsonl_zst
from dflash.prompts.stage import read_source
from dflash.generate.server import ServerProcess, free_port
from dflash.tokenize.stage import tokenize_shard
from tests.test_tokenize import validated

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(target_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cli = Path(sys.executable).parent / "transformers"
    cmd = [str(cli), "serve", "--host", "127.0.0.1", "--port", str(port), str(target_dir)]
    with ServerProcess(cmd, f"http://127.0.0.1:{port}/health", log, ready_timeout_s=120):
        yield f"http://127.0.0.1:{port}/v1", log


def cfg(url, max_error_fraction=0.0, **server):
    return {"backend": "openai", "enable_thinking": True, "max_error_fraction": max_error_fraction,
            "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 32, "seed": 0},
            "server": {"url": url, "dialect": "openai", "model": None, "api_key_env": None, "timeout_s": 60,
                       "retries": 1, "extra_body": {}, "concurrency": 2, "max_connection_failures": 16, **server}}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, demo_sources):
    recs = list(read_source(demo_sources[0]))[:2] + list(read_source(demo_sources[3]))[:2]  # chat + tool prompts
    path = tmp_path_factory.mktemp("p") / "shard-00000.jsonl.zst"
    write_jsonl_zst(path, recs)
    return path, recs


def test_openai_backend_against_a_real_server(server, prompts, target, target_dir, tmp_path):
    path, recs = prompts
    summary = generate_shard(path, tmp_path / "c.jsonl.zst", target_dir, cfg(server[0]))
    out = read_jsonl(tmp_path / "c.jsonl.zst")
    assert summary["records"] == 4 and summary["finish_reasons"]["error"] == 0
    assert [r["id"] for r in out] == [r["id"] for r in recs]
    for rec in out:
        assert rec["finish_reason"] in ("stop", "length") and rec["error"] is None
        assert rec["generation"]["backend"] == "openai" and rec["generation"]["reconstructed"] is True
        assert rec["output_token_ids"] is None  # this server reports no ids: text rebuilt from its fields
        assert rec["usage"]["completion_tokens"] > 0 and rec["usage"]["prompt_tokens"] > 0
        assert (rec["reasoning"], rec["content"]) == split_reasoning(rec["text"], True)
    # Records without ids still tokenize, through the chat template.
    write_jsonl_zst(tmp_path / "v.jsonl.zst", map(validated, out))
    stats = tokenize_shard(tmp_path / "v.jsonl.zst", tmp_path / "t.safetensors", tmp_path / "t.json", target[1],
                           {"max_length": 4096, "retokenize_sample": 1.0})
    assert stats["from_text"] == 4


def test_unreachable_server_fails_the_job_or_gives_error_records(prompts, target_dir, tmp_path):
    path, _ = prompts
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RuntimeError, match=r"4 of 4 prompts failed \(e\.g\. record \w+: ConnectionError: http://127"):
        generate_shard(path, tmp_path / "c.jsonl.zst", target_dir, cfg(url, retries=0))
    summary = generate_shard(path, tmp_path / "c.jsonl.zst", target_dir, cfg(url, max_error_fraction=1.0, retries=0))
    out = read_jsonl(tmp_path / "c.jsonl.zst")
    assert summary["finish_reasons"]["error"] == len(out) == 4
    assert all(r["error"].startswith("ConnectionError: http://127.0.0.1:") for r in out)


def test_rejected_request_field_is_a_clear_error(server, prompts, target_dir, tmp_path):
    path, _ = prompts
    generate_shard(path, tmp_path / "c.jsonl.zst", target_dir, cfg(server[0], dialect="vllm", max_error_fraction=1.0))
    err = read_jsonl(tmp_path / "c.jsonl.zst")[0]["error"]
    assert "HTTP 422" in err and "return_token_ids" in err


def requests_seen(server_log: Path) -> int:
    return server_log.read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')


def test_killed_job_resumes_without_repeating_finished_requests(server, target_dir, demo_sources, tmp_path):
    url, server_log = server
    recs = list(read_source(demo_sources[1]))[:10]
    shard = tmp_path / "shard-00000.jsonl.zst"
    write_jsonl_zst(shard, recs)
    out = tmp_path / "out.jsonl.zst"
    settings = cfg(url, concurrency=1, retries=0)
    settings["sampling"]["max_tokens"] = 64
    job = [sys.executable, "-c", "import sys, json; from dflash.generate.stage import generate_shard; "
           "generate_shard(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))",
           str(shard), str(out), str(target_dir), json.dumps(settings)]
    proc = subprocess.Popen(job, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = partial_path(out)
    deadline = time.time() + 120
    while time.time() < deadline and (not partial.exists() or partial.read_text().count("\n") < 3):
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup, possibly mid-request
    proc.wait()
    assert not out.exists()
    time.sleep(1.0)  # let the server finish and log the request that was in flight
    before = requests_seen(server_log)
    finished = set()
    for line in partial.read_text().splitlines():
        try:
            finished.add(json.loads(line)["id"])
        except json.JSONDecodeError:  # the record being written when the job was killed
            pass
    assert 3 <= len(finished) < 10
    summary = generate_shard(shard, out, target_dir, settings)
    assert requests_seen(server_log) - before == summary["requests"] == 10 - len(finished)
    assert summary["resumed"] == len(finished)
    assert [r["id"] for r in read_jsonl(out)] == [r["id"] for r in recs]
    assert not partial.exists()
