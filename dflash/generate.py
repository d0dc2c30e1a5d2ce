"""Generate stage: prompt shard -> completion records (DESIGN.md "completion record").

Backend ``transformers`` runs the target in-process (CPU demo). Every record keeps the exact
prompt and output token ids; ``text`` is the decoding of the output ids without the final stop
token, special tokens kept, so later stages never have to re-tokenize to know what the model saw.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dflash.io import iter_jsonl, write_jsonl_zst
from dflash.workflow import progress

log = logging.getLogger(__name__)

THINK_CLOSE = "</think>"


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a raw generation.

    Split at the first ``</think>``, nothing stripped (as SGLang's qwen3 parser does); with
    thinking on and no ``</think>`` everything is reasoning (a truncated or broken think block).
    """
    if not thinking:
        return None, text
    if THINK_CLOSE not in text:
        return text.removeprefix("<think>"), ""
    reasoning, content = text.split(THINK_CLOSE, 1)
    return reasoning.removeprefix("<think>"), content


def resolve_sampling(cfg: dict, generation_config) -> dict:
    """Sampling params from config, unset ones taken from the model's generation_config."""
    s = dict(cfg["sampling"])
    for key in ("temperature", "top_p", "top_k"):
        if s.get(key) is None:
            s[key] = getattr(generation_config, key, None)
    if s["temperature"] is None:
        s["temperature"] = 1.0
    return s


def stop_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return ids or [tokenizer.convert_tokens_to_ids("<|im_end|>")]


class TransformersBackend:
    """In-process generation with a transformers causal LM (the CPU backend)."""

    name = "transformers"

    def __init__(self, target_dir: str | Path):
        import transformers

        from dflash.target import load_target

        self.model, self.tokenizer = load_target(target_dir)
        self.model_name = Path(target_dir).name
        self.engine_version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self.stop = stop_ids(self.model, self.tokenizer)

    def render(self, prompt: dict, thinking: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(prompt["messages"], tools=prompt.get("tools"),
                                                  add_generation_prompt=True, enable_thinking=thinking,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], sampling: dict, seed: int) -> tuple[list[int], str]:
        """(output ids incl. the stop token when emitted, finish reason)."""
        torch.manual_seed(seed)
        greedy = sampling["temperature"] == 0
        out = self.model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=sampling["max_tokens"],
            do_sample=not greedy,
            temperature=None if greedy else sampling["temperature"],
            top_p=None if greedy else sampling["top_p"],
            top_k=None if greedy else sampling["top_k"],
            eos_token_id=self.stop,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        ids = out[0, len(prompt_ids):].tolist()
        if ids and ids[-1] in self.stop:
            return ids, "stop"
        return ids, "length"

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def sample_seed(base: int, prompt_id: str) -> int:
    """Per-sample seed: the same sample draws the same tokens whatever shard it lands in."""
    return (base * 1_000_003 + int(prompt_id[:12], 16)) % (2**63)


def completion_record(prompt: dict, backend, sampling: dict, thinking: bool) -> dict:
    base = {k: prompt[k] for k in ("source", "category", "messages", "tools")}
    record = {"id": prompt["id"], "prompt_id": prompt["id"], **base}
    generation = {"backend": backend.name, "engine_version": backend.engine_version, "model": backend.model_name,
                  "sampling": sampling, "enable_thinking": thinking}
    prompt_ids = None
    try:
        prompt_ids = backend.render(prompt, thinking)
        output_ids, finish = backend.complete(prompt_ids, sampling, sample_seed(sampling["seed"], prompt["id"]))
    except Exception as e:  # one bad prompt must not cost the shard: it becomes an error record
        log.warning("prompt %s failed: %s: %s", prompt["id"], type(e).__name__, e)
        return {**record, "text": "", "reasoning": None, "content": "", "finish_reason": "error",
                "prompt_token_ids": prompt_ids, "output_token_ids": None,
                "usage": {"prompt_tokens": len(prompt_ids or []), "completion_tokens": 0},
                "generation": generation, "error": f"{type(e).__name__}: {e}"}
    text = backend.decode(output_ids[:-1] if finish == "stop" else output_ids)
    reasoning, content = split_reasoning(text, thinking)
    return {**record, "text": text, "reasoning": reasoning, "content": content, "finish_reason": finish,
            "prompt_token_ids": prompt_ids, "output_token_ids": output_ids,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids)},
            "generation": generation, "error": None}


def generate_shard(prompts_path: Path, out_path: Path, target_dir: Path, cfg: dict) -> dict:
    """Generate one completion per prompt of the shard; returns a summary."""
    if cfg["backend"] != "transformers":
        raise NotImplementedError(f"generate.backend {cfg['backend']!r} is not available yet; use 'transformers'")
    prompts = list(iter_jsonl(prompts_path))
    backend = TransformersBackend(target_dir)
    sampling = resolve_sampling(cfg, backend.model.generation_config)
    thinking = cfg["enable_thinking"]
    t0 = time.time()
    records, tokens = [], 0
    bar = progress(prompts, desc=f"generate {Path(prompts_path).name}", unit="prompt")
    for prompt in bar:
        rec = completion_record(prompt, backend, sampling, thinking)
        records.append(rec)
        tokens += rec["usage"]["completion_tokens"]
        bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}", refresh=False)
    write_jsonl_zst(out_path, records)
    seconds = time.time() - t0
    summary = {
        "records": len(records),
        "finish_reasons": {r: sum(x["finish_reason"] == r for x in records) for r in ("stop", "length", "error")},
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
    }
    log.info("generate %s: %s", Path(prompts_path).name, summary)
    return summary
