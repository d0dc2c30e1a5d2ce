"""Generation client overhead: our ``openai`` backend against a bare aiohttp loop sending the same
requests (same bodies, same concurrency) to the same vLLM CPU server, side by side in one run.

Target for issue 3: ratio (ours / bare) >= 0.95 in output tokens/s. The server serves a tiny
full-attention qwen3 variant of the demo target (vLLM's CPU build cannot load the hybrid), with
``ignore_eos`` so every request produces exactly ``--max-tokens`` tokens.

Usage (after ``make test`` built .venv-vllm):
    .venv/bin/pip install aiohttp
    .venv/bin/python bench/generate_client.py --prompts 96 --concurrency 16 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import tempfile
import time
from pathlib import Path

from dflash.config import load_config
from dflash.generate import OpenAIBackend, generate_shard, resolve_sampling, sample_seed
from dflash.io import write_jsonl_zst
from dflash.prompts import read_source
from dflash.server import ServerProcess, free_port, vllm_cpu_command
from dflash.target import build_target

ROOT = Path(__file__).resolve().parents[1]


async def bare_loop(url: str, bodies: list[dict], concurrency: int) -> tuple[int, float]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session, body):
        nonlocal tokens
        async with gate, session.post(f"{url}/chat/completions", json=body) as response:
            tokens += (await response.json())["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, b) for b in bodies))
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    config = load_config(ROOT / "config.yaml")
    sources = [{**s, "path": str(ROOT / s["path"])} for s in config["prompts"]["sources"]]
    prompts = [r for s in sources for r in read_source(s) if r["meta"]["split"] == "train"][: args.prompts]
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    build = copy.deepcopy(config["target"]["build"])
    build["architecture"], build["teach"]["steps"] = "qwen3", 30
    target = work / "target"
    build_target([Path(s["path"]) for s in sources], target, build)
    write_jsonl_zst(work / "shard-00000.jsonl.zst", prompts)

    port = free_port()
    cmd, env = vllm_cpu_command(args.vllm_python, target, port)
    url = f"http://127.0.0.1:{port}/v1"
    cfg = {"backend": "openai", "enable_thinking": True, "max_error_fraction": 0.0,
           "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": args.max_tokens, "seed": 0},
           "server": {"url": url, "dialect": "vllm", "model": "tiny", "api_key_env": None, "timeout_s": 600,
                      "retries": 0, "extra_body": {"ignore_eos": True}, "concurrency": args.concurrency}}
    backend = OpenAIBackend(target, cfg)
    sampling = resolve_sampling(cfg, backend.generation_config())
    bodies = [backend.request_body(p, sampling, True, sample_seed(0, p["id"])) for p in prompts]

    ours, bare = [], []
    with ServerProcess(cmd, f"http://127.0.0.1:{port}/health", work / "vllm.log", env):
        asyncio.run(bare_loop(url, bodies[: args.concurrency], args.concurrency))  # warm-up
        for _ in range(args.rounds):
            s = generate_shard(work / "shard-00000.jsonl.zst", work / "out.jsonl.zst", target, cfg)
            ours.append(s["output_tokens"] / s["seconds"])
            tokens, seconds = asyncio.run(bare_loop(url, bodies, args.concurrency))
            bare.append(tokens / seconds)

    print(f"{len(prompts)} requests x {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"vLLM CPU (tiny qwen3 variant of the demo target)")
    for i, (a, b) in enumerate(zip(ours, bare)):
        print(f"round {i + 1}: dflash client {a:8.1f} tok/s   bare aiohttp {b:8.1f} tok/s   ratio {a / b:.3f}")
    print(f"best: dflash client {max(ours):.1f} tok/s, bare aiohttp {max(bare):.1f} tok/s, "
          f"ratio {max(ours) / max(bare):.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
