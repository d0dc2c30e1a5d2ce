"""Teaching the demo's tiny target: a Qwen3.6-architecture model built offline and taught the chat format.

A random-weight model never closes ``</think>`` nor emits a tool call, so every generation would
be rejected and the demo would prove nothing. So
1. a small byte-level BPE tokenizer is trained on the shipped conversations, with Qwen's special
   tokens (``<|im_start|>`` etc. special; ``<think>``, ``<tool_call>`` ... as non-special added
   tokens, exactly as in the real Qwen3.6 vocab, so decoding keeps them as text);
2. a ``qwen3_5_text`` model is built (GatedDeltaNet linear attention mixed with full attention);
3. it is taught the conversation format with a short CPU run on the reference assistant turns of
   the training split, loss on the assistant turn only.

This module and the chat template are the teaching code whose digest a shipped target's
provenance records (dflash.target.stage): a change here means `make demo-target`.
"""
from __future__ import annotations

import logging
import math
import random
import re
import time
from importlib import resources
from pathlib import Path

import torch

from dflash.core.io import iter_jsonl, write_json
from dflash.core.workflow import progress

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Non-special in Qwen3/3.6: ``skip_special_tokens`` keeps them, and the parsers rely on that.
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# The Qwen3.5/3.6 pre-tokenizer split (reference/qwen-formats.md section 8).
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def chat_template() -> str:
    return resources.files("dflash").joinpath("templates/qwen3_6.jinja").read_text(encoding="utf-8")


def load_conversations(paths: list[Path], split: str | None = "train") -> list[dict]:
    """Conversations (OpenAI messages + tools) of the given split from JSONL sources."""
    convs = []
    for path in paths:
        for rec in iter_jsonl(path):
            if split is None or rec.get("split", "train") == split:
                convs.append(rec)
    return convs


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast  # heavy: teaching only

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template(),
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(conversations: list[dict], vocab_size: int):
    """A byte-level BPE with the Qwen3.5 pre-tokenizer and Qwen's special and tag tokens.

    The merges are learnt on the conversations as the template renders them, so the system
    boilerplate of tool prompts and the tool-call XML compress as well as the prose.
    """
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,  # heavy: teaching only
                            pre_tokenizers, trainers)

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    renderer = _wrap(Tokenizer(models.BPE()))
    texts = [renderer.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=False) for c in conversations]
    # Tag strings are cut out of the training text: they become single added tokens anyway.
    tags = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TAG_TOKENS))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TAG_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((piece for t in texts for piece in tags.split(t)), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return _wrap(tok)


def model_config(cfg: dict, vocab_size: int, eos_ids: list[int], pad_id: int):
    """``qwen3_5_text`` (Qwen3.6's hybrid: GatedDeltaNet linear attention plus full attention) or
    plain ``qwen3`` (full attention only), for engines that cannot serve the hybrid on a CPU."""
    from transformers import Qwen3_5TextConfig, Qwen3Config  # heavy: teaching only

    common = dict(vocab_size=vocab_size, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                  num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_heads"],
                  num_key_value_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"], tie_word_embeddings=False,
                  eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=None, max_position_embeddings=32768)
    if cfg["architecture"] == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    every = cfg["full_attention_interval"]
    head_dim = cfg["head_dim"]
    rotary = head_dim * 0.25 // 2  # partial_rotary_factor 0.25, as in Qwen3.6
    mrope = [int(rotary - 2 * (rotary // 4)), int(rotary // 4), int(rotary // 4)]
    return Qwen3_5TextConfig(
        **common,
        layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(cfg["num_layers"])],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=cfg["num_kv_heads"],
        linear_num_value_heads=cfg["num_heads"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope, "mrope_interleaved": True},
    )


def teaching_rows(tokenizer, conversations: list[dict], max_length: int) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per conversation: loss on the final assistant turn, end-of-turn included."""
    rows = []
    for conv in conversations:
        messages, tools = conv["messages"], conv.get("tools")
        prompt = tokenizer.apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=True,
                                               enable_thinking=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        if not full.startswith(prompt):
            raise ValueError(f"template boundary unstable for conversation {messages[-2]['content'][:60]!r}")
        # The trailing newline after <|im_end|> is template framing, not model output.
        answer = full[len(prompt):].removesuffix("\n")
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        a_ids = tokenizer.encode(answer, add_special_tokens=False)
        ids = (p_ids + a_ids)[:max_length]
        mask = ([0] * len(p_ids) + [1] * len(a_ids))[:max_length]
        rows.append((ids, mask))
    return rows


def teach(model, rows, cfg: dict, pad_id: int) -> list[dict]:
    """Short supervised run on the reference turns. Returns the loss log."""
    rng = random.Random(cfg["seed"])
    steps, bs = cfg["steps"], cfg["batch_size"]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, int(0.05 * steps))

    def lr_at(step):
        if step < warmup:
            return cfg["lr"] * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    # Batches of similar length: tool prompts are ~5x longer than the rest, and padding every
    # batch to the longest row would make teaching several times slower.
    by_length = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    batches = [by_length[i:i + bs] for i in range(0, len(by_length), bs)]

    model.train()
    history, queue = [], []
    bar = progress(range(steps), desc="teach target", unit="step")
    for step in bar:
        if not queue:
            queue = rng.sample(batches, len(batches))
        batch = [rows[i] for i in queue.pop()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id)
        labels = torch.full((len(batch), width), -100)
        for b, (ids, mask) in enumerate(batch):
            input_ids[b, : len(ids)] = torch.tensor(ids)
            labels[b, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps - 1:
            history.append({"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step)})
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    return history


def teach_target(sources: list[Path], folder: Path, cfg: dict) -> dict:
    """Build and teach the tiny target on ``sources`` with the build config ``cfg``; save model,
    tokenizer and ``build_summary.json`` into ``folder``. Returns the summary."""
    from transformers import AutoModelForCausalLM, GenerationConfig  # heavy: teaching only

    t0 = time.time()
    torch.manual_seed(cfg["teach"]["seed"])
    everything = load_conversations(sources, split=None)
    train = [c for c in everything if c.get("split", "train") == "train"]
    if not train:
        raise ValueError(f"no training conversations in {', '.join(map(str, sources))}")
    # The vocabulary sees every shipped text (held-out prompts too, so they do not fall apart into
    # bytes), but the model is taught on the training split only.
    tokenizer = build_tokenizer(everything, cfg["vocab_size"])
    vocab = math.ceil(len(tokenizer) / 64) * 64
    eos_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    pad_id = eos_ids[1]
    model = AutoModelForCausalLM.from_config(model_config(cfg, vocab, eos_ids, pad_id))
    rows = teaching_rows(tokenizer, train, cfg["teach"]["max_length"])
    log.info("target: %d params, vocab %d, %d teaching rows (%d tokens, %d supervised)",
             sum(p.numel() for p in model.parameters()), vocab, len(rows),
             sum(len(r[0]) for r in rows), sum(sum(r[1]) for r in rows))
    history = teach(model, rows, cfg["teach"], pad_id)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=pad_id, do_sample=True,
        **cfg["sampling_defaults"],
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    summary = {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "teaching_rows": len(rows),
        "teach_first_loss": history[0]["loss"],
        "teach_final_loss": history[-1]["loss"],
        "seconds": round(time.time() - t0, 1),
        "history": history,
    }
    write_json(Path(folder) / "build_summary.json", summary)
    log.info("target: taught in %.0f s, loss %.3f -> %.3f", summary["seconds"],
             summary["teach_first_loss"], summary["teach_final_loss"])
    return summary
