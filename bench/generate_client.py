"""Generation client cost: client CPU-seconds per 1,000 requests of our ``openai`` generate client
against a bare aiohttp loop doing the same work, both against the same instant fake server.

Against a real CPU vLLM server the server is the bottleneck and both clients wait on it; this
bench measures the client alone. The server is a fake by necessity: a minimal OpenAI-compatible
aiohttp server that answers every POST /v1/chat/completions at once with one of 8 canned
responses (picked by the request's seed), shaped as vLLM 0.32's ChatCompletionResponse with the
exact token ids the stage asks for (``dialect: vllm`` sends ``return_token_ids`` and
``skip_special_tokens: false``; ids come back as ``prompt_token_ids`` and ``choices[0].token_ids``):
the point is to measure the client, not a model. Its prompt ids are the request's own prompt's,
rendered and encoded before it starts (ours checks them against its own rendering, as it checks a
real server's). It runs in its own process, pinned to CPU 0;
each client runs in its own process, pinned to CPU 1 (when the machine has 2+ cores), and its
process CPU time (all threads, user + system) is what is compared.

- ours: ``generate_shard`` per prompt shard, as the stage's generate job runs it (OpenAIBackend:
  urllib in a ``concurrency``-thread pool, each record appended and flushed to the resume file,
  the shard written as zstd JSONL, the resume file removed), the tokenizer loaded per shard as
  each job does;
- bare: one asyncio loop, one aiohttp session, ``concurrency`` requests in flight per shard, each
  response parsed, its output ids decoded, the same record built and the shard written as the
  same zstd JSONL (the same bytes, checked). It gets its request bodies prebuilt (untimed) and
  loads the tokenizer once: a floor does the least it can.

Prompts: the demo's, repeated under fresh ids into shards of ``--shard-size`` (the real config's
500), without tool replays (the bare loop would need the stage's replay logic). Each side warms
up on one shard (untimed), then runs the same shards in the same order until ``--seconds`` have
passed (it stops at a shard boundary); rounds alternate which side runs first. The figure is the
median of the per-round ratios of CPU-seconds per 1,000 requests (ours / bare: 1.0 = no
overhead). Requests/s are printed too, but on a loaded machine they say how much CPU the client
got, not what it can do.

Usage (``.venv/bin/pip install aiohttp`` first):
    .venv/bin/python bench/generate_client.py [--rounds 5] [--seconds 30] [--concurrency 21]
        [--output-tokens 1024]
(about 2 x rounds x (seconds + 15) seconds plus a minute of setup: 9 minutes at the defaults)
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANNED = 8


def pin(cpu: int) -> str:
    """Pin this process to ``cpu`` when the machine has a spare one; says what it did."""
    if len(os.sched_getaffinity(0)) < 2:
        return "not pinned (1 CPU)"
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu}"


# ---------------------------------------------------------------------------------------------
# The fake server
# ---------------------------------------------------------------------------------------------

def canned_responses(tokenizer, conversations: list[dict], mean_tokens: int, model: str) -> list[dict]:
    """``CANNED`` vLLM 0.32 chat responses: the demo's assistant turns (think block + answer),
    tiled to 0.5x..1.5x ``mean_tokens`` output ids ending in <|im_end|>, with the message split as
    vLLM's qwen3 reasoning parser reports it; the server puts in each request's prompt ids."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(CANNED):
        conv = conversations[i * 7 % len(conversations)]
        turn = next(m for m in reversed(conv["messages"]) if m["role"] == "assistant")
        text = f"<think>\n{turn.get('reasoning_content') or ''}\n</think>\n\n{turn.get('content') or ''}"
        ids = tokenizer.encode(text, add_special_tokens=False)
        n = round(mean_tokens * (0.5 + i / (CANNED - 1)))
        ids = (ids * math.ceil(n / len(ids)))[: n - 1] + [end]
        reasoning, _, content = tokenizer.decode(ids[:-1], skip_special_tokens=False).partition("</think>")
        out.append({
            "id": f"chatcmpl-{i:032x}", "object": "chat.completion", "created": 1764600000, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content.lstrip("\n"), "refusal": None,
                                                 "annotations": None, "audio": None, "function_call": None,
                                                 "tool_calls": [], "reasoning": reasoning.removeprefix("<think>\n")},
                         "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": ids,
                         "routed_experts": None}],
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": None, "total_tokens": None, "completion_tokens": len(ids),
                      "prompt_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})
    return out


def request_key(body: dict) -> str:
    """What the fake server knows a request's prompt by: its messages and tools as sent."""
    return json.dumps([body["messages"], body.get("tools")], sort_keys=True)


def prompt_ids_by_request(target: Path, cfg: dict, prompts: list[dict]) -> dict[str, list[int]]:
    """The prompt ids of each prompt's request, as the stage renders and encodes them."""
    from dflash.generate.backends import OpenAIBackend, resolve_sampling
    from dflash.core.chat import render

    backend = OpenAIBackend(target, cfg)
    sampling, thinking = resolve_sampling(cfg, backend.generation_config()), cfg["enable_thinking"]
    return {request_key(backend.request_body(p, sampling, thinking, 0)): backend.tokenizer.encode(
        render(p["messages"], p.get("tools"), backend.tokenizer, thinking), add_special_tokens=False) for p in prompts}


def serve(port: int, canned_path: Path, prompt_ids_path: Path) -> None:
    from aiohttp import web

    print(f"fake server {pin(0)}", file=sys.stderr, flush=True)
    canned = json.loads(canned_path.read_text())
    prompt_ids = json.loads(prompt_ids_path.read_text())

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        reply, ids = canned[body["seed"] % CANNED], prompt_ids[request_key(body)]
        usage = {**reply["usage"], "prompt_tokens": len(ids), "total_tokens": len(ids) + reply["usage"]["completion_tokens"]}
        return web.Response(body=json.dumps({**reply, "prompt_token_ids": ids, "usage": usage}).encode(),
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------------------------------------
# The two clients
# ---------------------------------------------------------------------------------------------

def run_ours(shards: list[Path], out: Path, target: Path, cfg: dict, seconds: float) -> int:
    """Shard after shard until ``seconds`` have passed; returns the requests sent."""
    from dflash.generate.stage import generate_shard

    t0, requests = time.perf_counter(), 0
    for shard in shards:
        summary = generate_shard(shard, out / shard.name, target, cfg)
        if summary["errors"]:
            sys.exit(f"ours: {summary['errors']} errors in {shard}")
        requests += summary["requests"]
        if time.perf_counter() - t0 >= seconds:
            break
    return requests


def run_bare(shards: list[Path], out: Path, bodies: dict[str, dict], prompts: dict[str, list[dict]],
             tokenizer, stop: set[int], cfg: dict, generation: dict, seconds: float) -> int:
    """As run_ours, with one aiohttp session for all the shards."""
    import aiohttp
    import zstandard

    from dflash.core.chat import finish_reason, split_reasoning

    url, concurrency = cfg["server"]["url"], cfg["server"]["concurrency"]
    thinking, max_tokens = cfg["enable_thinking"], cfg["sampling"]["max_tokens"]

    def record(prompt: dict, response: dict) -> dict:
        choice = response["choices"][0]
        ids, usage = choice["token_ids"], response["usage"]
        text = tokenizer.decode(ids[:-1] if ids and ids[-1] in stop else ids, skip_special_tokens=False)
        reasoning, content = split_reasoning(text, thinking)
        return {"id": prompt["id"], "prompt_id": prompt["id"], "source": prompt["source"],
                "category": prompt["category"], "messages": prompt["messages"], "tools": prompt["tools"],
                "text": text, "reasoning": reasoning, "content": content,
                "finish_reason": finish_reason(choice["finish_reason"], max_tokens, stop, ids,
                                               usage["completion_tokens"]),
                "prompt_token_ids": response["prompt_token_ids"], "output_token_ids": ids,
                "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]},
                "generation": generation, "error": None}

    def write(path: Path, records: list[dict]) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as raw, zstandard.ZstdCompressor(level=3, write_checksum=True).stream_writer(raw) as sink:
            for rec in records:
                sink.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
        tmp.rename(path)

    async def main() -> int:
        t0, requests = time.perf_counter(), 0
        gate = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def one(prompt: dict) -> dict:
                async with gate, session.post(f"{url}/chat/completions", json=bodies[prompt["id"]]) as response:
                    response.raise_for_status()
                    return record(prompt, await response.json())

            for shard in shards:
                records = await asyncio.gather(*(one(p) for p in prompts[shard.name]))
                write(out / shard.name, records)
                requests += len(records)
                if time.perf_counter() - t0 >= seconds:
                    break
        return requests

    return asyncio.run(main())


def client(side: str, work: Path, warmup: Path, shards: list[Path], out: Path, seconds: float) -> None:
    """One timed run of one side (its own process): setup and a warm-up shard untimed, then
    shard after shard until ``seconds`` have passed; prints CPU seconds, wall seconds and
    requests as one JSON line."""
    where = pin(1)
    from dflash.core.io import iter_jsonl

    cfg = json.loads((work / "cfg.json").read_text())
    target = work / "target"
    out.mkdir(parents=True, exist_ok=True)
    if side == "ours":
        def run(batch: list[Path], seconds: float) -> int:
            return run_ours(batch, out, target, cfg, seconds)
    else:
        from transformers import AutoTokenizer

        from dflash.core.chat import stop_token_ids
        from dflash.generate.backends import OpenAIBackend, resolve_sampling
        from dflash.generate.replay import sample_seed
        from dflash.generate.resume import settings_digest

        backend = OpenAIBackend(target, cfg)  # only to prebuild the bodies the stage sends
        sampling = resolve_sampling(cfg, backend.generation_config())
        generation = {"backend": "openai", "engine_version": backend.engine_version, "model": backend.model_name,
                      "sampling": sampling, "enable_thinking": cfg["enable_thinking"],
                      "settings": settings_digest(cfg, target)}
        prompts = {s.name: list(iter_jsonl(s)) for s in [warmup, *shards]}
        bodies = {p["id"]: backend.request_body(p, sampling, cfg["enable_thinking"],
                                                sample_seed(sampling["seed"], p["id"]))
                  for ps in prompts.values() for p in ps}
        tokenizer = AutoTokenizer.from_pretrained(target)
        stop = stop_token_ids(tokenizer, backend.generation_config())

        def run(batch: list[Path], seconds: float) -> int:
            return run_bare(batch, out, bodies, prompts, tokenizer, stop, cfg, generation, seconds)
    run([warmup], 0.0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    requests = run(shards, seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "requests": requests, "where": where}), flush=True)


# ---------------------------------------------------------------------------------------------
# The orchestrator
# ---------------------------------------------------------------------------------------------

def prompt_shards(work: Path, sources: list[dict], shard_size: int, count: int, tag: str) -> list[Path]:
    """``count`` shards of demo prompts under fresh hex ids (no replays)."""
    from dflash.core.io import write_jsonl_zst
    from dflash.prompts.stage import read_source

    base = [r for s in sources for r in read_source(s)]
    shards = []
    for k in range(count):
        recs = []
        for j in range(shard_size):
            p = base[(k * shard_size + j) % len(base)]
            pid = hashlib.sha256(f"{tag}-{k}-{j}".encode()).hexdigest()[:16]
            recs.append({**p, "id": pid, "meta": {"split": p["meta"]["split"]}})
        path = work / "prompts" / f"{tag}-{k:05d}.jsonl.zst"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl_zst(path, recs)
        shards.append(path)
    return shards


def run_client(side: str, work: Path, warmup: Path, shards: list[Path], seconds: float) -> dict:
    out = work / f"out-{side}"
    shutil.rmtree(out, ignore_errors=True)
    code = ("import sys; from pathlib import Path; sys.path.insert(0, {bench!r}); from generate_client import client; "
            "client({side!r}, Path({work!r}), Path({warmup!r}), [Path(p) for p in {shards!r}], Path({out!r}), "
            "{seconds!r})")
    proc = subprocess.run([sys.executable, "-c", code.format(bench=str(ROOT / "bench"), side=side, work=str(work),
                                                             warmup=str(warmup), shards=[str(s) for s in shards],
                                                             out=str(out), seconds=seconds)],
                          check=False, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{side} client failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def same_output(work: Path, shards: list[Path]) -> None:
    """The shards both clients wrote hold the same bytes once decompressed."""
    import zstandard

    for s in shards:
        if not all((work / f"out-{side}" / s.name).exists() for side in ("ours", "bare")):
            continue  # one of them stopped before this shard
        a, b = ((work / f"out-{side}" / s.name).read_bytes() for side in ("ours", "bare"))
        da, db = (zstandard.ZstdDecompressor().stream_reader(x).read() for x in (a, b))
        if da != db:
            sys.exit(f"the two clients wrote different records for {s.name}")


def versions() -> str:
    import importlib.metadata as m

    return ", ".join(f"{p} {m.version(p)}" for p in ("aiohttp", "transformers", "tokenizers", "zstandard")) + \
        f", Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=30.0, help="least wall time of each side's timed run")
    ap.add_argument("--concurrency", type=int, default=21, help="requests in flight (the real config's 21)")
    ap.add_argument("--shard-size", type=int, default=500)
    ap.add_argument("--output-tokens", type=int, default=1024, help="mean output ids per canned response")
    args = ap.parse_args()
    if importlib.util.find_spec("aiohttp") is None:  # else the server dies unseen and the bench waits for it
        sys.exit(f"aiohttp is not installed: the fake server and the bare client need it "
                 f"({sys.executable} -m pip install aiohttp)")

    from dflash.core.config import load_config
    from dflash.target.stage import build_target
    from dflash.target.teach import load_conversations

    config = load_config(ROOT / "config.yaml")
    sources = [{**s, "path": str(ROOT / s["path"])} for s in config["prompts"]["sources"]]
    work = Path(tempfile.mkdtemp(prefix="bench-generate-client-"))
    build = copy.deepcopy(config["target"]["build"])
    build["teach"].update(steps=1, batch_size=1, max_length=64)  # only its tokenizer and generation config are used
    build_target([Path(s["path"]) for s in sources], work / "target", build)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "target")
    conversations = load_conversations([Path(s["path"]) for s in sources], split="train")
    (work / "canned.json").write_text(json.dumps(canned_responses(tokenizer, conversations, args.output_tokens,
                                                                  "tiny")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    cfg = {"backend": "openai", "enable_thinking": True, "max_error_fraction": 0.0,
           "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 4096, "seed": 0},
           "server": {"url": url, "dialect": "vllm", "model": "tiny", "api_key_env": None, "timeout_s": 600,
                      "retries": 0, "extra_body": {}, "concurrency": args.concurrency,
                      "max_connection_failures": 16, "stream": False}}  # the bare client reads whole JSON replies
    (work / "cfg.json").write_text(json.dumps(cfg))
    from dflash.prompts.stage import read_source

    (work / "prompt_ids.json").write_text(json.dumps(prompt_ids_by_request(
        work / "target", cfg, [r for s in sources for r in read_source(s)])))

    serve_code = (f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); from generate_client import serve; "
                  f"from pathlib import Path; serve({port}, Path({str(work / 'canned.json')!r}), "
                  f"Path({str(work / 'prompt_ids.json')!r}))")
    server = subprocess.Popen([sys.executable, "-c", serve_code], cwd=ROOT)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            sys.exit("the fake server did not start")
        warmup = prompt_shards(work, sources, args.shard_size, 1, "warmup")[0]
        calib = prompt_shards(work, sources, args.shard_size, 1, "calib")
        rates = [r["requests"] / r["wall_s"] for r in (run_client(side, work, warmup, calib, 0.0)
                                                       for side in ("ours", "bare"))]
        # Room for a faster round than the calibration's: a run stops at the first shard boundary
        # past --seconds, and one that runs out of shards first is flagged.
        shards = prompt_shards(work, sources, args.shard_size,
                               math.ceil(max(rates) * args.seconds * 3 / args.shard_size), "timed")
        print(f"each run: shards of {args.shard_size} prompts until {args.seconds:.0f} s have passed (of {len(shards)} "
              f"shards), concurrency {args.concurrency}, canned vLLM-shaped responses of ~{args.output_tokens} "
              f"output ids (demo tokenizer); {versions()}", flush=True)
        per_round, runs = [], {"ours": [], "bare": []}
        for r in range(args.rounds):
            order = ("ours", "bare") if r % 2 == 0 else ("bare", "ours")
            res = {side: run_client(side, work, warmup, shards, args.seconds) for side in order}
            if r == 0:
                same_output(work, shards)
            for side, x in res.items():
                x["cpu_per_1k"] = 1000 * x["cpu_s"] / x["requests"]
                x["req_per_s"] = x["requests"] / x["wall_s"]
                runs[side].append(x)
            per_round.append(res["ours"]["cpu_per_1k"] / res["bare"]["cpu_per_1k"])
            print(f"round {r + 1} ({order[0]} first): " + "; ".join(
                f"{name} {res[side]['cpu_per_1k']:.3f} CPU-s/1k req, {res[side]['requests']} req in "
                f"{res[side]['wall_s']:.0f} s ({res[side]['req_per_s']:.0f} req/s)"
                for side, name in (("ours", "ours"), ("bare", "bare aiohttp"))) + f"; ratio {per_round[-1]:.3f}",
                  flush=True)
            for side, x in res.items():
                if x["wall_s"] < args.seconds:
                    print(f"  {side} ran out of shards after {x['wall_s']:.0f} s", flush=True)
        med = {side: {k: statistics.median(x[k] for x in xs) for k in ("cpu_per_1k", "req_per_s")}
               for side, xs in runs.items()}
        print(f"clients {runs['ours'][0]['where']}, the fake server in its own process (on CPU 0 when pinned); "
              f"records checked identical")
        print(f"median: ours {med['ours']['cpu_per_1k']:.3f} CPU-s per 1,000 requests, {med['ours']['req_per_s']:.0f} "
              f"req/s; bare aiohttp {med['bare']['cpu_per_1k']:.3f}, {med['bare']['req_per_s']:.0f} req/s")
        print(f"ours / bare, CPU-seconds per 1,000 requests: {statistics.median(per_round):.3f} (median of "
              f"{args.rounds} rounds, {min(per_round):.3f} to {max(per_round):.3f})")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
