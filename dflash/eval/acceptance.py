"""What the eval measures, without torch: the acceptance figures of decoded samples, the eval
settings, and the eval stage's answer from its decodings (the job that joins them loads no model).

Two figures, both reported overall and per category:

- ``acceptance_length``: tokens per target forward, the prefill forward (which yields the first
  token) included; 1.0 without a drafter. What the drafter saves in target forwards.
- ``acceptance_length_per_step``: 1 + accepted draft tokens / verify steps that drafted, the
  prefill left out: the figure vLLM reports as "mean acceptance length" (``vllm:spec_decode_*``
  counters, ``metrics.speculative_decoding``) and the papers as tau. It reads higher than the
  first, most on short outputs. Compare published figures with this one.

And, per category, what a user compares drafters by (speculators and ModelOpt report them):

- ``acceptance_rate_per_position``: for draft position k (the k-th drafted token of a block), the
  share of the verify steps that drafted it in which it was accepted (it and every token before
  it matched the target's). vLLM's per-position counters divided by its drafts, where every step
  drafts a whole block; here the steps cut short by ``max_new_tokens`` count only where drafted.
- ``accepted_length_histogram``: verify steps by accepted draft tokens, index n = steps that
  accepted n (and so yielded n + 1 tokens), 0 to block size - 1.

``METHODS`` says each figure's method in words; the eval JSON carries it.

``cfg``: the config's ``eval`` section and ``target.fast_kernels``; keys left out take the
schema's defaults (``dflash/schemas/config.schema.yaml`` documents each), unknown keys are errors.
"""
from __future__ import annotations

import logging
from itertools import zip_longest
from pathlib import Path

from dflash.core.config import completed, defaults
from dflash.core.io import write_json

ENGINES = ("transformers", "vllm")
METHODS = {
    "acceptance_length": "tokens per target forward, the prefill forward included (1.0 without a drafter)",
    "acceptance_length_per_step": "1 + accepted draft tokens / verify steps that drafted, the prefill left out "
                                  "(vLLM's mean acceptance length, the papers' tau)",
    "acceptance_rate_per_position": "per draft position k: verify steps that accepted position k / verify steps "
                                    "that drafted it",
    "accepted_length_histogram": "verify steps by accepted draft tokens: index n = steps that accepted n drafted "
                                 "tokens (n + 1 tokens yielded)",
    "thinking_off": "the trained drafter on the same held-out prompts rendered with enable_thinking false (the "
                    "template's empty think block), figures as above",
}


def per_step(drafts: int, accepted: int) -> float:
    """vLLM's mean acceptance length: 1 + accepted draft tokens per verify step that drafted."""
    return 1 + accepted / drafts if drafts else 1.0


def position_figures(samples: list[dict]) -> dict:
    """The per-position acceptance rates and the accepted-length histogram of the samples' verify
    steps ((drafted, accepted) each)."""
    steps = [step for s in samples for step in s["steps"]]
    width = max((drafted for drafted, _ in steps), default=0)
    drafted_at, accepted_at, histogram = [0] * width, [0] * width, [0] * (width + 1)
    for drafted, accepted in steps:
        for k in range(drafted):
            drafted_at[k] += 1
        for k in range(accepted):
            accepted_at[k] += 1
        histogram[accepted] += 1
    return {"acceptance_rate_per_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
            "accepted_length_histogram": histogram}


def summarize(samples: list[dict]) -> dict:
    tokens = sum(s["tokens"] for s in samples)
    forwards = sum(s["target_forwards"] for s in samples)
    drafts, accepted = sum(s["drafts"] for s in samples), sum(s["accepted_draft_tokens"] for s in samples)
    # plain greedy decoding runs one target forward per new token
    return {"acceptance_length": tokens / forwards, "acceptance_length_per_step": per_step(drafts, accepted),
            "prompts": len(samples), "target_forwards": forwards, "tokens": tokens, "drafts": drafts,
            "accepted_draft_tokens": accepted, "plain_forwards": tokens, "forwards_saved": tokens - forwards,
            "forwards_saved_share": (tokens - forwards) / tokens if tokens else 0.0, **position_figures(samples)}


# The eval's decodings of the held-out prompts, each ``eval.jobs`` jobs: the trained drafter, an
# untrained one for scale, the trained one on the prompts rendered without thinking.
DECODINGS = ("trained", "untrained", "thinking_off")


def decodings(cfg: dict) -> tuple[str, ...]:
    """The decodings the eval settings ``cfg`` ask for (thinking off with ``eval.thinking_off``)."""
    return tuple(d for d in DECODINGS if d != "thinking_off" or cfg["thinking_off"])


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


def eval_result(trained: dict, untrained: dict, cfg: dict, thinking_off: dict | None = None) -> dict:
    """The eval stage's answer from its decodings (:func:`decode_heldout`); the trained and the
    untrained one must agree token for token: speculative decoding is lossless whatever the
    drafter. ``thinking_off``: the trained drafter's decoding of the prompts without thinking."""
    if [s["output_ids"] for s in trained["samples"]] != [s["output_ids"] for s in untrained["samples"]]:
        raise RuntimeError("speculative decoding is not lossless: trained and untrained drafters decoded differently")
    cfg = settings(cfg)
    result = {
        "overall": trained["overall"],
        "per_category": trained["per_category"],
        "untrained": {"overall": untrained["overall"], "per_category": untrained["per_category"]},
        **({"thinking_off": {"overall": thinking_off["overall"], "per_category": thinking_off["per_category"]}}
           if thinking_off else {}),
        "methods": METHODS,
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
    if thinking_off:
        logging.getLogger(__name__).info(
            "thinking off: acceptance length %.3f, per verify step %.3f (thinking on: %.3f, %.3f)",
            thinking_off["overall"]["acceptance_length"], thinking_off["overall"]["acceptance_length_per_step"],
            trained["overall"]["acceptance_length"], trained["overall"]["acceptance_length_per_step"])
    return result


def write_eval(result: dict, out: Path) -> None:
    """The eval report as JSON, its samples without token ids and steps."""
    write_json(out, {**result, "samples": [{k: v for k, v in s.items() if k not in ("output_ids", "steps")}
                                           for s in result["samples"]]})
