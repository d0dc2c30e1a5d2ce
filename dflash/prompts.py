"""Prompts stage: source files -> canonical prompt records in stratified shards.

A prompt record is ``{id, source, category, messages, tools, meta}`` (DESIGN.md). ``messages``
is the conversation up to the generation: a trailing assistant turn in the source (a reference
answer) is dropped. A conversation with tool results is cut before its first tool call, and its
calls and cached results become ``meta.replay`` for the generate stage to feed back. Records
whose ``split`` is ``heldout`` (or every record of a source marked ``split: heldout``) go to
``heldout.jsonl.zst`` for the eval and never into a training shard.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Iterator

from dflash.adopt import imported_generations, rebuild_text
from dflash.io import atomic_dir, iter_jsonl, local_copy, shard_name, write_json, write_jsonl_zst

log = logging.getLogger(__name__)

CATEGORIES = ("chat", "code", "reasoning", "tool", "other")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_response": "tool"}


def stable_id(source: str, messages: list[dict], tools: list | None) -> str:
    blob = json.dumps({"source": source, "messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def content_key(messages: list[dict], tools: list | None, extra: list | dict | None = None) -> str:
    """Duplicate key: the conversation, plus the replay or the imported answer that makes it a record."""
    blob = json.dumps({"messages": messages, "tools": tools, "replay": extra}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _calls_tools(messages: list[dict], i: int) -> bool:
    """Message i is an assistant tool call answered by tool results."""
    return (messages[i]["role"] == "assistant" and bool(messages[i].get("tool_calls"))
            and i + 1 < len(messages) and messages[i + 1]["role"] == "tool")


def split_replay(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(prompt messages, replay steps) of a source conversation.

    Each step is ``{"calls": [tool names the source called], "results": [its tool messages]}``,
    read from the first answered tool call on while calls and results alternate; what follows
    (the reference answer, later user turns) is not replayed.
    """
    first = next((i for i in range(len(messages)) if _calls_tools(messages, i)), None)
    if first is None:
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        return messages, []
    steps, i = [], first
    while i < len(messages) and _calls_tools(messages, i):
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        names = [(c.get("function") or c)["name"] for c in messages[i]["tool_calls"]]
        steps.append({"calls": names, "results": messages[i + 1:j]})
        i = j
    return messages[:first], steps


def _messages_from(raw: dict, fmt: str) -> tuple[list[dict], list | None]:
    if fmt == "openai":
        return raw["messages"], raw.get("tools")
    if fmt == "sharegpt":
        turns = raw.get("conversations") or raw["conversation"]
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns], raw.get("tools")
    if fmt == "alpaca":
        user = raw["instruction"] + (f"\n\n{raw['input']}" if raw.get("input") else "")
        messages = [{"role": "user", "content": user}]
        if raw.get("system_prompt"):  # OpenOrca
            messages.insert(0, {"role": "system", "content": raw["system_prompt"]})
        return messages, None
    raise ValueError(f"unknown source format {fmt!r}")


def _check_messages(messages: list[dict], tools, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: no messages")
    for m in messages:
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: unknown role {m.get('role')!r} (expected one of {', '.join(ROLES)})")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: no user message")
    if tools is not None:
        for t in tools:
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type") != "function" or not isinstance(fn, dict) or "name" not in fn:
                raise ValueError(f"{where}: tools entries must be {{'type': 'function', 'function': {{'name', ...}}}}")


def _imported_from(raw: dict, source: dict, where: str) -> list[tuple[list[dict], list | None, dict]]:
    """(messages, tools, meta) per choice of a logged chat-completion exchange."""
    try:
        generations = imported_generations(raw, source)
        for g in generations:
            imp = g["imported"]
            rebuild_text(imp["message"], imp["enable_thinking"], imp["finish_reason"], imp["server"],
                         imp["tool_format"])
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e} for format 'chat_completions'") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: {e}") from None
    return [(g["messages"], g["tools"], {"imported": g["imported"]}) for g in generations]


def read_source(source: dict) -> Iterator[dict]:
    """Prompt records of one configured source (a local path or ``s3://``), with ``meta.split``
    set. A ``chat_completions`` source holds generations to adopt (``meta.imported``): its
    messages are the request's, whole (nothing is cut or replayed: the server answered them)."""
    fmt, name = source.get("format", "openai"), source["name"]
    try:
        with local_copy(source["path"]) as path:
            yield from _records_of(path, source["path"], fmt, name, source)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"prompt source {name!r}: {e}") from None


def _records_of(path: Path, shown: str, fmt: str, name: str, source: dict) -> Iterator[dict]:
    for index, raw in enumerate(iter_jsonl(path)):
        where = f"{shown}:{index + 1}"
        if fmt == "chat_completions":
            entries = _imported_from(raw, source, where)
        else:
            try:
                messages, tools = _messages_from(raw, fmt)
            except KeyError as e:
                raise ValueError(f"{where}: missing field {e} for format {fmt!r}") from None
            _check_messages(messages, tools, where)
            messages, replay = split_replay(messages)
            if not messages:
                raise ValueError(f"{where}: nothing before the first tool call to prompt with")
            entries = [(messages, tools, {"replay": replay} if replay else {})]
        category = raw.get("category") or source.get("category") or "other"
        if category not in CATEGORIES:
            raise ValueError(f"{where}: unknown category {category!r} (expected one of {', '.join(CATEGORIES)})")
        for choice, (messages, tools, extra) in enumerate(entries):
            if fmt == "chat_completions":
                _check_messages(messages, tools, where)
            tools = tools or None
            # An imported generation is its own record: several answers to one prompt all count.
            keyed = messages + [{"replay": step} for step in extra.get("replay", [])]
            if "imported" in extra:
                keyed = keyed + [{"imported": extra["imported"]["message"], "choice": choice}]
            yield {
                "id": stable_id(name, keyed, tools),
                "source": name,
                "category": category,
                "messages": messages,
                "tools": tools,
                "meta": {"index": index, "split": raw.get("split") or source.get("split", "train"), **extra},
            }


def stratify(records: list[dict], shard_size: int) -> list[list[dict]]:
    """Split into shards of ``shard_size`` where every shard mixes categories in proportion.

    Each category's records (in id order) are spread evenly over [0, 1); sorting on that position
    interleaves the categories, so contiguous chunks carry each category's share.
    """
    by_cat: dict[str, list[dict]] = {}
    for rec in sorted(records, key=lambda r: r["id"]):
        by_cat.setdefault(rec["category"], []).append(rec)
    keyed = [((j + 0.5) / len(recs), cat, rec["id"], rec)
             for cat, recs in by_cat.items() for j, rec in enumerate(recs)]
    ordered = [k[-1] for k in sorted(keyed, key=lambda k: k[:3])]
    return [ordered[i:i + shard_size] for i in range(0, len(ordered), shard_size)]


def build_prompts(sources: list[dict], out_dir: Path, shard_size: int) -> dict:
    """Read, dedup and shard all sources into ``out_dir``; returns the manifest."""
    seen: set[str] = set()
    train, heldout = [], []
    dropped = Counter()
    for source in sources:
        for rec in read_source(source):
            key = content_key(rec["messages"], rec["tools"], rec["meta"].get("replay") or rec["meta"].get("imported", {}).get("message"))
            if key in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(key)
            (heldout if rec["meta"]["split"] == "heldout" else train).append(rec)
    if not train:
        raise ValueError("no training prompts in the configured sources")
    shards = stratify(train, shard_size)
    with atomic_dir(out_dir) as tmp:
        for i, shard in enumerate(shards):
            write_jsonl_zst(tmp / shard_name(i), shard)
        write_jsonl_zst(tmp / "heldout.jsonl.zst", sorted(heldout, key=lambda r: r["id"]))
        # Which shard holds an id, known without reading the shards: exclusion lists map to jobs.
        (tmp / "ids.tsv").write_text("".join(f"{r['id']}\t{i:05d}\n" for i, s in enumerate(shards) for r in s),
                                     encoding="utf-8")
        manifest = {
            "shards": [
                {"name": shard_name(i), "records": len(s), "categories": dict(Counter(r["category"] for r in s))}
                for i, s in enumerate(shards)
            ],
            "prompts": len(train),
            "heldout": len(heldout),
            "categories": dict(Counter(r["category"] for r in train)),
            "heldout_categories": dict(Counter(r["category"] for r in heldout)),
            "dropped": dict(dropped),
        }
        write_json(tmp / "manifest.json", manifest)
    log.info("prompts: %d training prompts in %d shards, %d held out, dropped %s",
             len(train), len(shards), len(heldout), dict(dropped) or "none")
    return manifest
