"""Tokenize stage: validated shard -> flat token rows the trainer memory-maps.

Per shard: ``shard-N.safetensors`` with ``input_ids`` (int32, all rows concatenated),
``loss_mask`` (uint8, 1 on the model's output tokens, stop token included) and ``offsets``
(int64, row r is ``[offsets[r], offsets[r+1])``), plus ``shard-N.json``: per-row id, category,
length and trainable tokens, and the shard's statistics.

Rows come from the record's token ids when it has them (exactly what the target saw and
produced); records without ids are rendered with the chat template and the generated text is
tokenized as the continuation. What could make a row differ from the model's tokens is counted,
never hidden: ids that do not decode to the text (``text_mismatch``), text that re-tokenizes to
other ids (``retokenize_differs``: what the text path would get wrong), and rows from text whose
rendered prompt is not a token prefix of the rendered conversation (``boundary_unstable`` of
``boundary_checked``).
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash.io import atomic_path, iter_jsonl, write_json
from dflash.target import stop_token_ids

log = logging.getLogger(__name__)


def render_prompt(rec: dict, tokenizer) -> str:
    thinking = rec.get("generation", {}).get("enable_thinking", True)
    return tokenizer.apply_chat_template(rec["messages"], tools=rec.get("tools"), add_generation_prompt=True,
                                         enable_thinking=thinking, tokenize=False)


def boundary_stable(rec: dict, tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt's tokens are a prefix of the whole conversation's (prompt + this answer,
    rendered by the template): if not, the row's prompt/answer boundary is not what training on
    whole conversations would see."""
    thinking = rec.get("generation", {}).get("enable_thinking", True)
    answer = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        answer["reasoning_content"] = rec["reasoning"]
    full = tokenizer.apply_chat_template(rec["messages"] + [answer], tools=rec.get("tools"), enable_thinking=thinking,
                                         tokenize=False)
    return tokenizer.encode(full, add_special_tokens=False)[:len(prompt_ids)] == prompt_ids


def row_from_record(rec: dict, tokenizer, end_of_turn: int) -> tuple[list[int], list[int], str]:
    """(input ids, loss mask, path) for one completion record."""
    if rec.get("prompt_token_ids") is not None and rec.get("output_token_ids") is not None:
        prompt, output = rec["prompt_token_ids"], rec["output_token_ids"]
        path = "ids"
    else:
        prompt = tokenizer.encode(render_prompt(rec, tokenizer), add_special_tokens=False)
        output = tokenizer.encode(rec["text"], add_special_tokens=False)
        if rec["finish_reason"] == "stop":
            output = output + [end_of_turn]
        path = "text"
    return prompt + output, [0] * len(prompt) + [1] * len(output), path


def has_anchor(mask: list[int]) -> bool:
    """DFlash needs an anchor and at least one label: two consecutive supervised tokens."""
    return any(a and b for a, b in zip(mask, mask[1:]))


def tokenize_shard(validated_path: Path, out_tensors: Path, out_index: Path, tokenizer, cfg: dict) -> dict:
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop_ids = stop_token_ids(tokenizer)
    max_length = cfg["max_length"]
    ids_all: list[int] = []
    mask_all: list[int] = []
    offsets = [0]
    rows = []
    counts = Counter()
    trainable_by_cat: dict[str, list[int]] = defaultdict(list)
    for rec in iter_jsonl(validated_path):
        ids, mask, path = row_from_record(rec, tokenizer, end_of_turn)
        counts[f"from_{path}"] += 1
        if path == "ids":
            out = rec["output_token_ids"]
            body = out[:-1] if out and out[-1] in stop_ids else out
            if tokenizer.decode(body, skip_special_tokens=False) != rec["text"]:
                counts["text_mismatch"] += 1
                log.warning("%s: decoded output ids differ from the record's text", rec["id"])
            # what the text path would have made of this record (a sampler need not pick the
            # tokenizer's own split): how much rows from text would differ from the model's tokens
            elif tokenizer.encode(rec["text"], add_special_tokens=False) != body:
                counts["retokenize_differs"] += 1
        else:
            counts["boundary_checked"] += 1
            if not boundary_stable(rec, tokenizer, ids[:len(ids) - int(sum(mask))]):
                counts["boundary_unstable"] += 1
                log.warning("%s: the rendered prompt is not a token prefix of the rendered conversation", rec["id"])
        if len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
            counts["truncated"] += 1
        if not has_anchor(mask):
            counts["dropped_no_anchor"] += 1
            continue
        ids_all += ids
        mask_all += mask
        offsets.append(len(ids_all))
        rows.append({"id": rec["id"], "category": rec["category"], "length": len(ids), "trainable": sum(mask)})
        trainable_by_cat[rec["category"]].append(sum(mask))
    tensors = {
        "input_ids": torch.tensor(ids_all, dtype=torch.int32),
        "loss_mask": torch.tensor(mask_all, dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    with atomic_path(out_tensors) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "dflash-tokenized-v1"})
    stats = {
        "rows": len(rows),
        "tokens": len(ids_all),
        "trainable_tokens": sum(mask_all),
        **{k: counts[k] for k in ("from_ids", "from_text", "text_mismatch", "retokenize_differs", "boundary_checked",
                                  "boundary_unstable", "truncated", "dropped_no_anchor")},
        "trainable_by_category": {c: {"rows": len(v), "tokens": sum(v)} for c, v in sorted(trainable_by_cat.items())},
    }
    write_json(out_index, {"rows": rows, "stats": stats})
    log.info("tokenize %s: %s", Path(validated_path).name, {k: v for k, v in stats.items() if k != "trainable_by_category"})
    return stats
