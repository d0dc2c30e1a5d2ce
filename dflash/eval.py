"""Greedy speculative decoding with the target and a drafter: acceptance length per category.

The target is hybrid: its linear-attention layers carry a recurrent state that cannot be rolled
back past a rejected draft token, so no cache is kept. Every step is one full target forward
over prompt + accepted tokens + drafted block, which yields the greedy tokens that verify the
block and the layer features the drafter needs for the next block. Acceptance follows the
reference: the longest drafted prefix that matches the target's greedy tokens, plus the
target's next token, so the output is exactly plain greedy decoding.

``acceptance_length`` is tokens per target forward, the prefill forward (which yields the first
token) included: 1.0 without a drafter. The reference's tau leaves the prefill out, so on short
outputs it reads slightly higher.

``cfg`` keys:
    max_new_tokens: int = 96     tokens generated per prompt at most
    block_size: int | None = None   tokens per block (anchor + drafted); None = the drafter's
                                 config; may be smaller than it, not larger
    device: str = "auto"         "auto" = cuda when available, else cpu
    seed: int = 0                initialisation of the untrained (``init_only``) drafter
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from dflash.chat import render, stop_token_ids
from dflash.drafter import DFlashDraftModel, TargetIO, load_drafter
from dflash.hidden import forward_features
from dflash.train import pick_device
from dflash.workflow import progress

DEFAULTS = {"max_new_tokens": 96, "block_size": None, "device": "auto", "seed": 0}


def untrained_drafter(drafter_dir: Path, seed: int = 0) -> tuple[DFlashDraftModel, Qwen3Config]:
    """A randomly initialised drafter with the config of ``drafter_dir``: the baseline that shows
    what training adds."""
    config = Qwen3Config.from_pretrained(drafter_dir)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DFlashDraftModel(config), config


def propose(drafter: DFlashDraftModel, io: TargetIO, context: torch.Tensor, last_token: int,
            num_draft: int) -> list[int]:
    """Draft ``num_draft`` tokens after ``last_token``, which sits right after ``context``
    (target features [1, S, k, H] of positions 0 .. S-1)."""
    S, device = context.shape[1], context.device
    block = torch.tensor([[last_token] + [drafter.mask_token_id] * num_draft], device=device)
    positions = torch.arange(S, S + num_draft + 1, device=device)[None]
    hidden = drafter(io.embed(block), positions, context, torch.arange(S, device=device)[None])
    return io.logits(hidden[0, 1:]).argmax(-1).tolist()


@torch.no_grad()
def speculative_generate(target: PreTrainedModel, drafter: DFlashDraftModel | None, io: TargetIO,
                         prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                         block_size: int | None = None) -> tuple[list[int], int]:
    """Greedy decoding, verified block by block; returns (new tokens, target forwards).

    Without a drafter every forward yields one token: plain greedy decoding.
    """
    device = io.embed_weight.device
    block_size = 1 if drafter is None else (block_size or drafter.block_size)

    def target_greedy(ids: list[int], keep: int) -> tuple[list[int], torch.Tensor | None]:
        """The target's greedy next token at each of the last ``keep`` positions, and the
        drafter's context features of every position."""
        input_ids = torch.tensor([ids], device=device)
        if drafter is None:
            logits, features = target(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits, None
        else:
            logits, features = forward_features(target, input_ids, drafter.target_layer_ids)
        return logits[0, -keep:].argmax(-1).tolist(), features

    greedy, features = target_greedy(prompt_ids, 1)
    new, forwards = greedy, 1
    while new[-1] not in stop_ids and len(new) < max_new_tokens:
        last = len(prompt_ids) + len(new) - 1  # position of the newest token, the block's anchor
        # Never draft past max_new_tokens: a fully accepted block yields num_draft + 1 tokens.
        num_draft = min(block_size, max_new_tokens - len(new)) - 1
        draft = propose(drafter, io, features[:, :last], new[-1], num_draft) if num_draft else []
        # The target's token after the anchor and after each drafted token.
        verified, features = target_greedy(prompt_ids + new + draft, num_draft + 1)
        forwards += 1
        accepted = 0
        while accepted < num_draft and draft[accepted] == verified[accepted]:
            accepted += 1
        for token in verified[:accepted + 1]:
            new.append(token)
            if token in stop_ids:
                break
    return new, forwards


def summarize(samples: list[dict]) -> dict:
    tokens = sum(s["tokens"] for s in samples)
    forwards = sum(s["target_forwards"] for s in samples)
    # plain greedy decoding runs one target forward per new token
    return {"acceptance_length": tokens / forwards, "prompts": len(samples), "target_forwards": forwards,
            "tokens": tokens, "plain_forwards": tokens, "forwards_saved": tokens - forwards,
            "forwards_saved_share": (tokens - forwards) / tokens if tokens else 0.0}


def evaluate(target_dir: Path, drafter_dir: Path | None, prompts: list[dict], cfg: dict, tokenizer, *,
             init_only: bool = False, log: logging.Logger | None = None) -> dict:
    """Speculative-decode every prompt; ``drafter_dir=None`` is plain greedy decoding and
    ``init_only=True`` uses an untrained drafter with the config of ``drafter_dir``.

    Returns ``{"overall": {...}, "per_category": {category: {...}}, "samples": [...]}`` where each
    summary has ``acceptance_length, prompts, target_forwards, tokens`` and each sample ``id,
    category, acceptance_length, tokens, target_forwards, output_ids``.
    """
    log = log or logging.getLogger(__name__)
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown eval settings: {unknown}")
    cfg = {**DEFAULTS, **cfg}
    if cfg["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg['max_new_tokens']}")
    device = pick_device(cfg["device"])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").to(device).eval()
    drafter = None
    if drafter_dir is not None:
        drafter, config = untrained_drafter(drafter_dir, cfg["seed"]) if init_only else load_drafter(drafter_dir)
        check_drafter(drafter, config, target, drafter_dir, cfg["block_size"])
        drafter = drafter.to(device, target.dtype).eval()
    io = TargetIO.from_model(target)
    stop_ids = stop_token_ids(tokenizer, target.generation_config)
    log.info("evaluating %s with drafter %s%s on %d prompts, stop ids %s", target_dir, drafter_dir,
             " (untrained)" if init_only else "", len(prompts), sorted(stop_ids))

    samples = []
    for prompt in progress(prompts, desc="spec decode"):
        try:
            text = render(prompt["messages"], prompt.get("tools"), tokenizer, thinking=True)
        except ValueError as e:
            raise ValueError(f"held-out prompt {prompt['id']}: {e}") from None
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        out, forwards = speculative_generate(target, drafter, io, prompt_ids, cfg["max_new_tokens"], stop_ids,
                                             cfg["block_size"])
        samples.append({"id": prompt["id"], "category": prompt["category"],
                        "acceptance_length": len(out) / forwards, "tokens": len(out),
                        "target_forwards": forwards, "output_ids": out})

    categories = sorted({s["category"] for s in samples})
    result = {
        "overall": summarize(samples),
        "per_category": {c: summarize([s for s in samples if s["category"] == c]) for c in categories},
        "samples": samples,
    }
    log.info("acceptance length %.3f over %d prompts", result["overall"]["acceptance_length"], len(samples))
    return result


def check_drafter(drafter: DFlashDraftModel, config: Qwen3Config, target: PreTrainedModel, drafter_dir: Path,
                  block_size: int | None) -> None:
    text = target.config.get_text_config()
    problems = []
    if (config.hidden_size, config.vocab_size) != (text.hidden_size, text.vocab_size):
        problems.append(f"hidden/vocab {config.hidden_size}/{config.vocab_size} vs target "
                        f"{text.hidden_size}/{text.vocab_size}")
    if max(drafter.target_layer_ids) >= text.num_hidden_layers:
        problems.append(f"target_layer_ids {drafter.target_layer_ids} vs {text.num_hidden_layers} target layers")
    if block_size is not None and not 1 <= block_size <= drafter.block_size:
        problems.append(f"block_size {block_size} outside 1..{drafter.block_size} (the trained block size)")
    if problems:
        raise ValueError(f"drafter {drafter_dir} does not fit target: " + "; ".join(problems))


def run_eval(checkpoint: Path, target_dir: Path, heldout: Path, out: Path, cfg: dict) -> dict:
    """The eval stage: the trained drafter and, for scale, an untrained one with the same config,
    on the held-out prompts; writes the JSON report (token ids left out)."""
    from transformers import AutoTokenizer

    from dflash.io import read_jsonl, write_json

    prompts = read_jsonl(heldout)
    if not prompts:
        raise ValueError(f"{heldout}: no held-out prompts to evaluate (mark some source records split: heldout)")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    trained = evaluate(target_dir, checkpoint, prompts, cfg, tokenizer)
    untrained = evaluate(target_dir, checkpoint, prompts, cfg, tokenizer, init_only=True)
    if [s["output_ids"] for s in trained["samples"]] != [s["output_ids"] for s in untrained["samples"]]:
        raise RuntimeError("speculative decoding is not lossless: trained and untrained drafters decoded differently")
    result = {
        "overall": trained["overall"],
        "per_category": trained["per_category"],
        "untrained": {"overall": untrained["overall"], "per_category": untrained["per_category"]},
        "samples": [{k: v for k, v in s.items() if k != "output_ids"} for s in trained["samples"]],
        "settings": cfg,
    }
    write_json(out, result)
    logging.getLogger(__name__).info("acceptance length: trained %.3f, untrained %.3f",
                                     trained["overall"]["acceptance_length"], untrained["overall"]["acceptance_length"])
    return result
