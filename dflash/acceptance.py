"""What the eval measures, without torch: the acceptance figures of decoded samples, the eval
settings, and the eval stage's answer from its decodings (the job that joins them loads no model).

Two figures, both reported overall and per category:

- ``acceptance_length``: tokens per target forward, the prefill forward (which yields the first
  token) included; 1.0 without a drafter. What the drafter saves in target forwards.
- ``acceptance_length_per_step``: 1 + accepted draft tokens / verify steps that drafted, the
  prefill left out: the figure vLLM reports as "mean acceptance length" (``vllm:spec_decode_*``
  counters, ``metrics.speculative_decoding``) and the papers as tau. It reads higher than the
  first, most on short outputs. Compare published figures with this one.

``cfg``: the config's ``eval`` section and ``target.fast_kernels``; keys left out take the
schema's defaults (``dflash/schemas/config.schema.yaml`` documents each), unknown keys are errors.
"""
from __future__ import annotations

import logging
from itertools import zip_longest
from pathlib import Path

from dflash.config import completed, defaults

ENGINES = ("transformers", "vllm")


def per_step(drafts: int, accepted: int) -> float:
    """vLLM's mean acceptance length: 1 + accepted draft tokens per verify step that drafted."""
    return 1 + accepted / drafts if drafts else 1.0


def summarize(samples: list[dict]) -> dict:
    tokens = sum(s["tokens"] for s in samples)
    forwards = sum(s["target_forwards"] for s in samples)
    drafts, accepted = sum(s["drafts"] for s in samples), sum(s["accepted_draft_tokens"] for s in samples)
    # plain greedy decoding runs one target forward per new token
    return {"acceptance_length": tokens / forwards, "acceptance_length_per_step": per_step(drafts, accepted),
            "prompts": len(samples), "target_forwards": forwards, "tokens": tokens, "drafts": drafts,
            "accepted_draft_tokens": accepted, "plain_forwards": tokens, "forwards_saved": tokens - forwards,
            "forwards_saved_share": (tokens - forwards) / tokens if tokens else 0.0}


def settings(cfg: dict) -> dict:
    """``cfg`` checked and completed with the defaults."""
    unknown = sorted(set(cfg) - {*defaults("eval"), "fast_kernels"})
    if unknown:
        raise ValueError(f"unknown eval settings: {unknown}")
    cfg = completed({"fast_kernels": defaults("target")["fast_kernels"], **cfg}, "eval")
    # the target's fast_kernels after device and seed, where eval JSONs have always listed it
    cfg = {k: cfg[k] for k in (*list(cfg)[:4], "fast_kernels")} | cfg
    if cfg["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg['max_new_tokens']}")
    if cfg["engine"] not in ENGINES:
        raise ValueError(f"eval.engine must be one of {ENGINES}, got {cfg['engine']!r}")
    missing = [p for p in ("{model}", "{port}", "{speculative_config}") if p not in cfg["vllm"]["command"]]
    if cfg["engine"] == "vllm" and missing:
        raise ValueError(f"eval.vllm.command lacks {', '.join(missing)}: the server must serve the target with "
                         f"the drafter on the port the job gives it")
    return cfg


def summaries(samples: list[dict]) -> dict:
    categories = sorted({s["category"] for s in samples})
    return {
        "overall": summarize(samples),
        "per_category": {c: summarize([s for s in samples if s["category"] == c]) for c in categories},
        "samples": samples,
    }


def merge_parts(parts: list[dict]) -> dict:
    """One decoding from those of its ``eval.jobs`` parts (:func:`decode_heldout` with ``part``, in
    part order): the samples back in held-out order, the summaries over all of them, the server
    counters (engine vllm: one server a part) summed."""
    samples = [s for turn in zip_longest(*(p["samples"] for p in parts)) for s in turn if s is not None]
    merged = summaries(samples)
    if "server_counters" in parts[0]:
        merged["server_counters"] = {k: sum(p["server_counters"][k] for p in parts) for k in parts[0]["server_counters"]}
    return merged


def eval_result(trained: dict, untrained: dict, cfg: dict) -> dict:
    """The eval stage's answer from the two decodings (:func:`decode_heldout`), which must agree
    token for token: speculative decoding is lossless whatever the drafter."""
    if [s["output_ids"] for s in trained["samples"]] != [s["output_ids"] for s in untrained["samples"]]:
        raise RuntimeError("speculative decoding is not lossless: trained and untrained drafters decoded differently")
    cfg = settings(cfg)
    result = {
        "overall": trained["overall"],
        "per_category": trained["per_category"],
        "untrained": {"overall": untrained["overall"], "per_category": untrained["per_category"]},
        **({"server_counters": {"trained": trained["server_counters"], "untrained": untrained["server_counters"]}}
           if "server_counters" in trained else {}),
        "samples": trained["samples"],
        # the server's environment may hold secrets (a token): its names only
        "settings": {**cfg, "vllm": {**cfg["vllm"], "env": sorted(cfg["vllm"]["env"])}},
    }
    logging.getLogger(__name__).info(
        "acceptance length (tokens per target forward): trained %.3f, untrained %.3f; per verify step (as vLLM "
        "reports it): trained %.3f, untrained %.3f", trained["overall"]["acceptance_length"],
        untrained["overall"]["acceptance_length"], trained["overall"]["acceptance_length_per_step"],
        untrained["overall"]["acceptance_length_per_step"])
    return result


def write_eval(result: dict, out: Path) -> None:
    """The eval report as JSON, its samples without token ids and steps."""
    from dflash.io import write_json

    write_json(out, {**result, "samples": [{k: v for k, v in s.items() if k not in ("output_ids", "steps")}
                                           for s in result["samples"]]})
