"""What the target decides about a prompt before any request (the prompts stage's checks): its
template renders it, it leaves room for the answer in the context, no message smuggles a special
token in as text. ``prompt_check_settings`` is the prompts rule's params: what decides them."""
from __future__ import annotations

import logging
from pathlib import Path

from dflash.core.chat import TokenScreen, render, texts_of

log = logging.getLogger("dflash.prompts.stage")  # the prompts stage's log, where its drops are counted

SPECIAL_TOKEN_ACTIONS = ("drop", "keep", "flag")


class PromptChecks:
    """What the target decides about a prompt before any request: whether its template renders
    it (``template_error``), whether the rendered prompt leaves ``max_tokens`` within
    ``context_length`` (``too_long``), and whether a message's
    content, a tool call or a tool definition holds one of the tokenizer's special tokens as text
    (``special_tokens_in_content``; ``special_tokens``: drop, keep, or flag = keep with
    ``meta.flags``). Adopted generations are not measured: they were generated already."""

    def __init__(self, tokenizer, context_length: int, max_tokens: int, thinking: bool, special_tokens: str = "drop"):
        if special_tokens not in SPECIAL_TOKEN_ACTIONS:
            raise ValueError(f"special_tokens: {special_tokens!r} is not one of {', '.join(SPECIAL_TOKEN_ACTIONS)}")
        self.tokenizer, self.context_length, self.max_tokens = tokenizer, context_length, max_tokens
        self.thinking, self.special_action = thinking, special_tokens
        self.screen_tokens = TokenScreen(tokenizer)
        # a byte-level vocabulary spells each byte as one character: a token covers at most this many
        self.token_chars = max(map(len, tokenizer.get_vocab()), default=1)

    def special_token(self, rec: dict) -> str | None:
        """Where the first special token shows in text the target would see: the messages, the
        tool definitions and the tool results replayed into later prompts; or None."""
        meta = rec.get("meta", {})
        return self.screen_tokens.found(rec["messages"], rec["tools"], self.thinking, meta.get("replay"))

    def unfit(self, recs: list[dict]) -> list[tuple[str, str] | None]:
        """(reason, detail) for each record the target cannot take, else None: ``template_error``
        when its chat template refuses the conversation, ``too_long`` when the rendered prompt
        leaves fewer than ``max_tokens`` tokens of the context. A byte-level tokenizer spends a
        token on one byte at least, so only prompts longer in UTF-8 bytes than the room left are
        encoded."""
        room = self.context_length - self.max_tokens
        out: list[tuple[str, str] | None] = [None] * len(recs)
        texts = {}
        for i, rec in enumerate(recs):
            if "imported" in rec["meta"]:
                continue
            # No token covers more characters than the vocabulary's longest: a prompt longer than
            # that many per token of room is too long without rendering or encoding it (a 50 MB
            # one-line prompt would take gigabytes and minutes to encode).
            chars = sum(map(len, texts_of([rec["messages"], rec["tools"]], keys=False)))
            if chars > room * self.token_chars:
                out[i] = ("too_long", f"{chars:,} characters: more than {room:,} tokens of room can hold")
                continue
            try:
                text = render(rec["messages"], rec["tools"], self.tokenizer, self.thinking)
            except ValueError as e:
                out[i] = ("template_error", str(e))
                continue
            if len(text.encode("utf-8")) > room:
                texts[i] = text
        if texts:
            for i, ids in zip(texts, self.tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"]):
                if len(ids) > room:
                    out[i] = ("too_long", f"{len(ids)} prompt tokens leave fewer than max_tokens {self.max_tokens} "
                                          f"of the context {self.context_length}")
        return out

    def screen(self, recs: list[dict], tally: dict[str, dict]) -> list[dict]:
        """The records to keep; each drop and flag is counted under its source and logged by id."""
        kept = []
        for rec, unfit in zip(recs, self.unfit(recs)):
            where = f"prompt {rec['id']} ({rec['source']}:{rec['meta']['index'] + 1})"
            counts = tally[rec["source"]]
            if unfit is not None:
                counts["dropped"][unfit[0]] += 1
                log.warning("%s: %s: %s", where, *unfit)
                continue
            found = self.special_token(rec)
            if found and self.special_action != "keep":
                counts["dropped" if self.special_action == "drop" else "flagged"]["special_tokens_in_content"] += 1
                log.warning("%s: special_tokens_in_content: %s (%s)", where, found,
                            "dropped" if self.special_action == "drop" else "kept, flagged")
                if self.special_action == "drop":
                    continue
                rec["meta"]["flags"] = [*rec["meta"].get("flags", []), "special_tokens_in_content"]
            kept.append(rec)
        return kept


def heldout_settings(config: dict) -> dict:
    """The prompts rule's params that draw a held-out set (``dflash.prompts.stage.build_prompts``)."""
    return {"share": config["prompts"]["heldout_share"],
            "max_per_category": config["prompts"]["heldout_max_per_category"]}


def prompt_check_settings(config: dict) -> dict:
    """What decides which prompts the prompts stage drops or flags (its rule's params)."""
    generate = config["generate"]
    return {"context_length": generate["context_length"], "max_tokens": generate["sampling"]["max_tokens"],
            "enable_thinking": generate["enable_thinking"], "special_tokens": config["prompts"]["special_tokens"]}


def prompt_checks(target_dir: str | Path, settings: dict) -> PromptChecks:
    """``PromptChecks`` for the target folder's tokenizer and template; ``settings`` is
    ``prompt_check_settings`` of the config. An unset context length is the model's
    ``max_position_embeddings``."""
    from transformers import AutoConfig, AutoTokenizer  # heavy: the Snakefile imports this module

    # local_files_only: the target is a folder the rule names; a name that is not one is never a Hub download
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    context = settings["context_length"]
    if context is None:
        context = getattr(AutoConfig.from_pretrained(target_dir, local_files_only=True).get_text_config(),
                          "max_position_embeddings", None)
    if context is None:
        raise ValueError(f"{target_dir}: the model config names no max_position_embeddings; set generate.context_length")
    return PromptChecks(tokenizer, context, settings["max_tokens"], settings["enable_thinking"],
                        settings["special_tokens"])
