"""The Qwen chat format in one place: how a conversation is rendered for the target, and how a
raw generation splits into reasoning, content and tool calls, and is rebuilt from them.

Generate (in-process prompts, rebuilt server replies), adopt (logged replies), tokenize (rows
from text) and eval (held-out prompts) all render through ``render``, so a conversation that one
stage takes, every stage takes, and the same way.

Rebuilding a reply from a server's parsed fields (reasoning and tool-call parsers) is exact or not
depending on what the server kept of the raw output (measured on SGLang 0.5.23 with
``--reasoning-parser qwen3`` and ``--tool-call-parser qwen3_coder``/``qwen25``, and vLLM 0.32.0 with
``qwen3`` and ``qwen3_coder``/``hermes``):

- reasoning keeps its trailing newline and content its leading ones on both, so a reply without
  tool calls is exact: reasoning + ``</think>`` + content;
- SGLang ``qwen3_coder`` keeps the text before the first call unstripped (``"\\n\\n"`` for a
  call-only reply), so calls rendered back in the XML format make it exact too;
- SGLang ``qwen25`` and vLLM ``qwen3_coder`` strip that text, and vLLM drops it when it is only
  whitespace: the whitespace is restored as the chat template renders an assistant turn, and the
  record says ``generation.verbatim: false``.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from typing import Iterator

from jinja2 import TemplateError

from dflash.core.dialects import DIALECTS
from dflash.core.io import MAX_JSON_DEPTH, deeper_than

THINK_CLOSE = "</think>"
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def call_arguments(fn: dict) -> dict:
    """A tool call's arguments as a mapping: the OpenAI wire sends them as a JSON string, which
    SGLang and vLLM parse before rendering; the template iterates over a mapping."""
    args = fn.get("arguments")
    too_deep = f"tool call {fn.get('name')!r}: arguments nest more than {MAX_JSON_DEPTH} levels deep"
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call {fn.get('name')!r}: arguments are not valid JSON ({e.msg}): {args[:80]!r}") \
                from None
        except RecursionError:  # deeper than json parses
            raise ValueError(too_deep) from None
    if deeper_than(args):  # the template's tojson and every walk after it would recurse past Python's limit
        raise ValueError(too_deep)
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise ValueError(f"tool call {fn.get('name')!r}: arguments are a JSON {type(args).__name__}, not an object")
    return args


def template_message(message: dict) -> dict:
    """A message as the chat template takes it: tool-call arguments as mappings and vLLM's
    ``reasoning`` named ``reasoning_content``. Other messages are returned as they are."""
    if message.get("role") != "assistant" or not (message.get("tool_calls") or message.get("reasoning") is not None):
        return message
    message = dict(message)
    if message.get("reasoning") is not None:
        reasoning = message.pop("reasoning")
        message.setdefault("reasoning_content", reasoning)
    if message.get("tool_calls"):
        message["tool_calls"] = [{"type": "function", "function": {"name": (c.get("function") or c)["name"],
                                                                 "arguments": call_arguments(c.get("function") or c)}}
                                 for c in message["tool_calls"]]
    return message


def render(messages: list[dict], tools: list | None, tokenizer, thinking: bool, generation_prompt: bool = True) -> str:
    """The conversation as the target's chat template renders it (with the generation prompt, by
    default). A conversation the template cannot take is a ``ValueError`` saying why."""
    try:
        return tokenizer.apply_chat_template([template_message(m) for m in messages], tools=tools or None,
                                             add_generation_prompt=generation_prompt, enable_thinking=thinking,
                                             tokenize=False)
    except (TemplateError, TypeError, KeyError) as e:
        raise ValueError(f"the chat template cannot render the conversation ({type(e).__name__}: {e})") from None


class TokenScreen:
    """Finds the tokenizer's special tokens (``<|im_start|>``, ``<|im_end|>`` ...) written as text
    where the chat template would put that text into a prompt: there the tokenizer encodes them as
    real control tokens, and ``<|im_end|>\n<|im_start|>system`` in a user turn or a tool result
    forges a turn.

    What counts is what the model will see, not how a record stores it: a token split across the
    parts of a message's content (``"Say hi.<|im_"``, ``"end|>"``) is joined by the template. Every
    text (keys included) is scanned for whole tokens; when a text starts or ends with a piece of a
    token, the conversation is rendered and its special tokens counted against those the template
    writes itself for the same conversation with every text blanked."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        special = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                         reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, special))) if special else None
        self.heads = {t[:k] for t in special for k in range(1, len(t))}
        self.tails = {t[k:] for t in special for k in range(1, len(t))}
        self.longest = max(map(len, special), default=0)
        self.firsts, self.lasts = {t[0] for t in special}, {t[-1] for t in special}

    def found(self, messages: list[dict], tools: list | None, thinking: bool,
              replay: list[dict] | None = None) -> str | None:
        """Where a special token shows in text that reaches the prompt (``messages``, ``tools``,
        and the tool results of ``replay`` steps, rendered in the later prompts), or None."""
        if self.pattern is None:
            return None
        pieces = False
        for where, value in [*((f"message {n} ({m.get('role')})", m) for n, m in enumerate(messages)),
                             ("the tool definitions", tools),
                             *((f"replayed tool result {n}", r) for n, step in enumerate(replay or [])
                               for r in step["results"])]:
            for text in texts_of(value):
                if hit := self.pattern.search(text):
                    return f"{hit.group()} in {where}"
                pieces = pieces or self._has_piece(text)
        return self._formed(messages, tools, thinking, replay or []) if pieces else None

    def _has_piece(self, text: str) -> bool:
        """Whether ``text`` ends with a token's beginning or starts with a token's end. Most texts
        have no token's first character near their end nor its last near their start."""
        span = self.longest - 1
        if not (self.firsts.intersection(text[-span:]) or self.lasts.intersection(text[:span])):
            return False
        return any(text[-k:] in self.heads or text[:k] in self.tails for k in range(1, min(len(text), self.longest)))

    def _formed(self, messages: list[dict], tools: list | None, thinking: bool, replay: list[dict]) -> str | None:
        conversation = messages + [turn for step in replay for turn in (
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}} for name in step["calls"]]},
            *step["results"])]
        try:
            seen = Counter(self.pattern.findall(render(conversation, tools, self.tokenizer, thinking)))
            own = Counter(self.pattern.findall(render(_blanked(conversation), _blanked(tools), self.tokenizer, thinking)))
        except ValueError:
            return None  # a conversation the template refuses is dropped as template_error
        extra = seen - own
        return f"{next(iter(extra))} formed across the texts of the conversation" if extra else None


def texts_of(value, keys: bool = True) -> Iterator[str]:
    """Every string in a message, tool definition or tool result: values, and keys unless ``keys``
    is false."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            if keys:
                yield from texts_of(key)
            yield from texts_of(item, keys)
    elif isinstance(value, list):
        for item in value:
            yield from texts_of(item, keys)


# What the template branches on, kept when a conversation is blanked: roles and part or tool types.
_STRUCTURE_KEYS = ("role", "type")


def _blanked(value, key: str | None = None):
    """``value`` with every text replaced by a neutral one and every key renamed, its shape kept."""
    if isinstance(value, str):
        return value if key in _STRUCTURE_KEYS else "x"
    if isinstance(value, dict):
        return {(k if k in _STRUCTURE_KEYS or k in _SHAPE_KEYS else f"k{n}"): _blanked(v, k)
                for n, (k, v) in enumerate(value.items())}
    if isinstance(value, list):
        return [_blanked(v, key) for v in value]
    return value


# Keys the template reads by name: renamed, it would render another conversation.
_SHAPE_KEYS = ("content", "tool_calls", "function", "name", "arguments", "reasoning_content", "reasoning", "text",
               "description", "parameters", "properties", "required", "tool_call_id", "image", "image_url", "video")


def thinking_of(rec: dict) -> bool:
    return rec.get("generation", {}).get("enable_thinking", True)


def render_prompt(rec: dict, tokenizer) -> str:
    """The generation prompt of a prompt or completion record."""
    return render(rec["messages"], rec.get("tools"), tokenizer, thinking_of(rec))


def render_conversation(rec: dict, tokenizer) -> str:
    """Prompt and this answer as the template renders a whole conversation (as training on
    conversations, SpecForge style, would tokenize it)."""
    answer = {"role": "assistant", "content": rec.get("content") or ""}
    if rec.get("reasoning") is not None:
        answer["reasoning_content"] = rec["reasoning"]
    return render(rec["messages"] + [answer], rec.get("tools"), tokenizer, thinking_of(rec), generation_prompt=False)


def opens_think(rec: dict, tokenizer) -> bool:
    """Whether the template's generation prompt already opens the think block (Qwen3.5/3.6 do)."""
    return render(rec["messages"], rec.get("tools"), tokenizer, True).rstrip("\n").endswith("<think>")


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    """Ids that end a generation: Qwen's end-of-turn and end-of-text, the tokenizer's eos and the
    generation_config's eos ids. One definition for generating, tokenizing and decoding."""
    ids = {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS} | {tokenizer.eos_token_id}
    eos = getattr(generation_config, "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos])
    # Tokens missing from the vocabulary come back as None or as the unknown token.
    return {i for i in ids if i is not None and i != tokenizer.unk_token_id}


def output_body(ids: list[int], stop_ids: set[int]) -> list[int]:
    """Output ids without the final stop token: the ids whose decoding is a record's ``text``."""
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def finish_reason(reported: str | None, max_tokens: int | None, stop_ids: set[int], output_ids: list[int] | None = None,
                  completion_tokens: int | None = None) -> str:
    """A generation's finish reason (``stop``, ``length``, ``abort``), decided by its output ids
    when they are known: ``stop`` when the last id is a stop token, ``length`` when the output
    reached ``max_tokens`` without one, whatever the server reported (vLLM 0.32 reports
    ``tool_calls`` whenever its parser pulled a call out of the output, even one cut at the cap).
    Otherwise the server's reason stands (a stop string, an abort), ``tool_calls`` read as
    ``stop``; without ids, a ``tool_calls`` reply that used up ``max_tokens`` may have been cut and
    is taken as ``length``."""
    if output_ids:
        if output_ids[-1] in stop_ids:
            return "stop"
        if max_tokens is not None and len(output_ids) >= max_tokens:
            return "length"
    elif reported == "tool_calls" and max_tokens is not None and (completion_tokens or 0) >= max_tokens:
        return "length"
    return {"tool_calls": "stop", None: "stop"}.get(reported, reported)


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


def render_call(call: dict, tool_format: str) -> str:
    """One parsed tool call in the model's raw format (as the Qwen templates render it)."""
    fn = call.get("function") or call
    if tool_format == "hermes":
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
        return f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args}}}\n</tool_call>'
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                     for k, v in call_arguments(fn).items())
    return f"<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>"


def reasoning_of(message: dict) -> str | None:
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"]
    return message.get("reasoning")


def rebuild_text(message: dict, thinking: bool, finish_reason: str = "stop", server: str = "sglang",
                 tool_format: str = "xml") -> tuple[str, bool]:
    """(raw output, verbatim) behind a parsed chat message; ``verbatim`` is false when whitespace
    the server stripped was restored from the template's rules rather than read back."""
    reasoning = reasoning_of(message)
    content = message.get("content") or ""
    calls = [render_call(c, tool_format) for c in message.get("tool_calls") or []]
    body, verbatim = content + "\n".join(calls), True
    if calls and (tool_format in DIALECTS[server].strips_text_before_calls or not content):
        # Qwen3.6 writes "\n\n" after </think>; the template joins text and first call with
        # "\n\n" (XML) or "\n" (Hermes).
        lead = "\n\n" if thinking else ""
        sep = ("\n\n" if tool_format == "xml" else "\n") if content.strip() else ""
        body = lead + content.strip() + sep + "\n".join(calls)
        verbatim = body == content + "\n".join(calls)
    if not thinking:
        if reasoning:
            raise ValueError("reasoning in a reply generated with thinking off")
        return body, verbatim
    if not body and finish_reason == "length":
        return reasoning or "", verbatim  # cut inside the reasoning: no </think> was written
    return (reasoning or "") + THINK_CLOSE + body, verbatim


def served_output(prompt: dict, message: dict, thinking: bool, finish_reason: str, server: str, tool_format: str,
                  tokenizer) -> tuple[str, bool]:
    """``rebuild_text`` for a reply to ``prompt``: with a template whose generation prompt stops
    before ``<think>`` (Qwen3 hybrid) the model wrote the tag itself, and both servers' reasoning
    parsers drop it."""
    text, verbatim = rebuild_text(message, thinking, finish_reason, server, tool_format)
    if thinking and text and not opens_think(prompt, tokenizer):
        text = "<think>" + text
    return text, verbatim
