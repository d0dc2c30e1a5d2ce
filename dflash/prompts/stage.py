"""Prompts stage: source files -> canonical prompt records in stratified shards.

A prompt record is ``{id, source, category, messages, tools, meta}`` (docs/design.md). ``messages``
is the conversation up to the generation: a trailing assistant turn in the source (a reference
answer) is dropped. A conversation with tool results is cut before its first tool call, and its
calls and cached results become ``meta.replay`` for the generate stage to feed back. Records
whose ``split`` is ``heldout`` (or every record of a source marked ``split: heldout``) go to
``heldout.jsonl.zst`` for the eval and never into a training shard.

With the target's tokenizer (``PromptChecks``) the stage also drops, with a reason counted per
source in the manifest, what the target should never be sent: conversations its chat template
refuses (``template_error``), prompts too long to leave ``max_tokens`` within its context
(``too_long``), and content holding the template's control
tokens (``special_tokens_in_content``: ``<|im_start|>system`` in a user turn would be encoded as a
real turn boundary and forge a system turn).

Memory does not grow with the records' size: records are screened in batches and spilled to a
temp file in the output's temp folder; memory keeps a few hundred bytes per record (a content
hash for the dedup, the id, category and split for the stratification) and one bucket of the spill
at a time while the shards are written (``build_prompts``).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
from array import array
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import numpy as np
import zstandard

from dflash.core.chat import rebuild_text, template_message
from dflash.core.dialects import detect_server
from dflash.core.io import (MAX_JSON_DEPTH, atomic_dir, deeper_than, dumps_line, jsonl_zst_writer, shard_name,
                       source_records, write_json)
from dflash.core.records import record_problem
from dflash.core.storage import local_copy
from dflash.core.toolcalls import schema_problem
from dflash.core.vocabulary import CATEGORIES, SPLITS
from dflash.core.workflow import notice
from dflash.prompts.checks import PromptChecks, heldout_settings, prompt_check_settings, prompt_checks

log = logging.getLogger(__name__)

SORTED_CATEGORIES = tuple(sorted(CATEGORIES))  # codes that sort as the names: stratification breaks ties on them
CATEGORY_CODE = {c: i for i, c in enumerate(SORTED_CATEGORIES)}
SCREEN_BATCH = 256  # records read and not yet screened: what the records themselves hold of memory
BUCKET_BYTES = 32 << 20  # kept records put in shard order at once
MAX_BUCKETS = 512  # files open at once while the spill is dealt into buckets (past 16 GB, buckets grow)
ROLES = ("system", "user", "assistant", "tool")
# The role table of ShareGPT-style dumps (docs/stages.md): chatgpt, bing and bard are the
# assistants the conversations were had with. Any other ``from`` drops the record (unknown_role).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                  "system": "system", "tool": "tool", "function_response": "tool"}


class Quirk(ValueError):
    """A source record that is no usable prompt: dropped with ``code``, counted per source."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


# Records dropped while reading, before they became prompt records: counted with the records
# read (the screening's drops are of records already counted).
QUIRKS = ("no_messages", "no_user_turn", "unknown_role", "malformed_record", "unknown_category", "unknown_split")


def stable_id(source: str, messages: list[dict], tools: list | None) -> str:
    blob = json.dumps({"source": source, "messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def content_key(messages: list[dict], tools: list | None, extra: list | dict | None = None) -> bytes:
    """Duplicate key: the conversation, plus the replay or the imported answer that makes it a
    record; a raw digest, as one is kept in memory for every record read."""
    blob = json.dumps({"messages": messages, "tools": tools, "replay": extra}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).digest()


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


def _sharegpt_turn(k: int, turn) -> dict:
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise Quirk("malformed_record", f"turn {k} is not an object with from and value")
    if turn["from"] not in SHAREGPT_ROLES:
        raise Quirk("unknown_role", f"turn {k} is from {turn['from']!r} (the role table: docs/stages.md)")
    if not isinstance(turn["value"], str):
        raise Quirk("malformed_record", f"turn {k}'s value is a JSON {type(turn['value']).__name__}, not text")
    return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}


def _field_text(raw: dict, field: str) -> str:
    """A prompt field's text; a list is a conversation's user turns (MT-Bench ``turns``): the
    first, as the second needs the model's answer to the first."""
    if field not in raw:
        raise Quirk("malformed_record", f"missing field {field!r}")
    value = raw[field]
    if isinstance(value, list):
        if not value:
            raise Quirk("no_messages", f"field {field!r} is an empty list")
        value = value[0]
    if not isinstance(value, str):
        raise Quirk("malformed_record", f"field {field!r} is a JSON {type(value).__name__}, not text")
    return value


def _messages_from(raw: dict, source: dict) -> tuple[list[dict], list | None]:
    fmt = source.get("format", "openai")
    if fmt == "openai":
        return raw["messages"], raw.get("tools")
    if fmt == "sharegpt":
        key = next((k for k in ("conversations", "conversation") if k in raw), None)
        if key is None:
            raise Quirk("malformed_record", "missing field 'conversations' for format 'sharegpt'")
        turns = raw[key]
        if not isinstance(turns, list):
            raise Quirk("malformed_record", f"conversations is a JSON {type(turns).__name__}, not a list")
        return [_sharegpt_turn(k, t) for k, t in enumerate(turns)], raw.get("tools")
    if fmt == "fields":
        fields = source["prompt_field"]
        user = "\n\n".join(_field_text(raw, f) for f in ([fields] if isinstance(fields, str) else fields))
        messages = [{"role": "user", "content": user}]
        if source.get("system_field") and raw.get(source["system_field"]):
            messages.insert(0, {"role": "system", "content": _field_text(raw, source["system_field"])})
        return messages, None
    if fmt == "alpaca":
        user = raw["instruction"] + (f"\n\n{raw['input']}" if raw.get("input") else "")
        messages = [{"role": "user", "content": user}]
        if raw.get("system_prompt"):  # OpenOrca
            messages.insert(0, {"role": "system", "content": raw["system_prompt"]})
        return messages, None
    raise ValueError(f"unknown source format {fmt!r}")


def _check_messages(messages: list[dict], tools) -> None:
    """Raise the ``Quirk`` that makes these messages and tools no prompt."""
    if not isinstance(messages, list):
        raise Quirk("malformed_record", f"messages is a JSON {type(messages).__name__}, not a list")
    if not messages:
        raise Quirk("no_messages", "an empty conversation")
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Quirk("malformed_record", f"message {n} is a JSON {type(m).__name__}, not an object with role "
                                            f"and content")
        if m.get("role") not in ROLES:
            raise Quirk("unknown_role", f"message {n} has role {m.get('role')!r} (expected one of {', '.join(ROLES)})")
    if not any(m["role"] == "user" for m in messages):
        raise Quirk("no_user_turn", f"no user turn (roles: {', '.join(sorted({m['role'] for m in messages}))})")
    if tools is not None:
        for t in tools if isinstance(tools, list) else [tools]:
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or t.get("type") != "function" or "name" not in fn:
                raise Quirk("malformed_record", "tools entries must be {'type': 'function', 'function': "
                                                "{'name', ...}}")


# Tool names the engines take (OpenAI's rule, and the dots of namespaced tools): vLLM and the
# OpenAI API refuse a request whose tool is named with a space.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def shape_problem(rec: dict) -> tuple[str, str] | None:
    """(reason, detail) why a well-formed prompt record would mislead the target, or None; such a
    record is dropped and counted: ``non_text_content`` (an image or audio part a text model never
    sees: the prompt would lose it), ``null_content`` (a turn with no text and no tool calls),
    ``orphan_tool_result`` (a tool result no call asked for), ``bad_tool_name`` (a name the engines
    refuse), ``non_standard_json`` (NaN or Infinity, which JSON has no words for). A tool schema
    with no clear meaning is no reason to drop (``schema_unknown``)."""
    turns = rec["messages"] + [r for step in rec["meta"].get("replay", []) for r in step["results"]]
    for n, m in enumerate(rec["messages"]):
        content = m.get("content")
        if isinstance(content, list):
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
            if kinds - {"text"}:
                return "non_text_content", f"message {n} ({m['role']}) holds a {sorted(kinds - {'text'})[0]} part"
        if content is None and not m.get("tool_calls"):
            return "null_content", f"message {n} ({m['role']}) has content null and no tool calls"
        if m["role"] == "tool" and not any(p["role"] == "assistant" and p.get("tool_calls")
                                           for p in rec["messages"][:n]):
            return "orphan_tool_result", f"message {n} is a tool result with no tool call before it"
    names = [(t["function"]["name"], "a tool definition") for t in rec["tools"] or []]
    names += [((c.get("function") or c).get("name"), f"a call of message {n}") for n, m in enumerate(turns)
              for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    for name, where in names:
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            return "bad_tool_name", f"{where} names the tool {name!r} (letters, digits, _ . - only, at most 64)"
    try:
        json.dumps(rec, allow_nan=False)
    except ValueError:
        return "non_standard_json", "a number is NaN or Infinity (in a tool schema or arguments)"
    return None


def schema_unknown(rec: dict) -> str | None:
    """Why a tool's parameters schema has no clear meaning even normalised (an unknown type name,
    a $ref that resolves nowhere), or None. The prompt is kept as written, flagged
    ``tool_schema_unknown``: the model is served the tools as they are, and validate leaves the
    arguments of a call against that tool unchecked."""
    for tool in rec["tools"] or []:
        if problem := schema_problem(tool["function"].get("parameters")):
            return f"the parameters schema of {tool['function']['name']} has no clear meaning: {problem}"
    return None


# Logged chat-completion exchanges (format chat_completions): generations to adopt.


def failed_exchange(raw: dict) -> str | None:
    """What went wrong when a logged exchange is a failed request (an OpenAI batch line with
    ``status_code: 500`` or an ``error``), or None: it holds no generation to adopt, and costs the
    source that one line, not the run."""
    response = raw.get("response")
    status = response.get("status_code") if isinstance(response, dict) else None
    body = response.get("body") if isinstance(response, dict) and isinstance(response.get("body"), dict) else response
    if isinstance(status, int) and not 200 <= status < 300:
        return f"status_code {status}"
    if raw.get("error") and not (isinstance(body, dict) and body.get("choices")):
        return f"error {str(raw['error'])[:200]}"
    if isinstance(body, dict) and body.get("error") and not body.get("choices"):
        return f"error {str(body['error'])[:200]}"
    return None


def split_exchange(raw: dict) -> tuple[dict, dict]:
    """(request, response) of one logged exchange: ``{request, response}``, an OpenAI batch line
    (``{body: request, response: {body: response}}``), or a request with a ``response`` field."""
    if "response" not in raw:
        raise KeyError("response")
    request = raw.get("request") or raw.get("body") or raw
    response = raw["response"]
    if isinstance(response, dict) and "choices" not in response and isinstance(response.get("body"), dict):
        response = response["body"]
    if not isinstance(response, dict) or not response.get("choices"):
        raise ValueError("the response has no choices")
    if "messages" not in request:
        raise KeyError("messages")
    return request, response


def imported_generations(raw: dict, source: dict) -> list[dict]:
    """What the prompts stage keeps of a logged exchange, one entry per choice:
    ``{messages, tools, imported}``; ``imported`` is what ``adopted_record`` needs."""
    request, response = split_exchange(raw)
    kwargs = request.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking", source.get("enable_thinking", True))
    messages = [template_message(m) for m in request["messages"]]
    sampling = {"temperature": request.get("temperature"), "top_p": request.get("top_p"),
                "top_k": request.get("top_k"), "seed": request.get("seed"),
                "max_tokens": request.get("max_tokens", request.get("max_completion_tokens"))}
    out = []
    for choice in response["choices"]:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ValueError(f"choice {choice.get('index', 0)} has no message")
        server = source.get("server", "auto")
        if server == "auto":
            server = detect_server(choice, message)
            if server is None:
                raise ValueError("cannot tell whether SGLang or vLLM answered; set the source's server")
        finish = choice.get("finish_reason")  # as reported: chat.finish_reason decides with the ids and the cap
        if finish not in ("stop", "length", "abort", "tool_calls", None):
            raise ValueError(f"unknown finish_reason {finish!r}")
        prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
        output_ids = choice.get("token_ids") or choice.get("response_token_ids")
        out.append({"messages": messages, "tools": request.get("tools") or None, "imported": {
            "server": server, "tool_format": source.get("tool_format", "xml"), "model": response.get("model") or "",
            "enable_thinking": thinking, "sampling": sampling, "message": message, "finish_reason": finish,
            "usage": response.get("usage") or {}, "prompt_token_ids": prompt_ids, "output_token_ids": output_ids}})
    return out


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


def read_source(source: dict, dropped: Counter | None = None, max_line_bytes: int | None = None) -> Iterator[dict]:
    """Prompt records of one configured source (a local path or ``s3://``; JSON Lines, a JSON
    array or Parquet: ``dflash.core.io.source_records``), with ``meta.split`` set. A record that is no
    usable prompt (a ``Quirk``: an empty conversation, no user turn, a role outside the role
    table, a field missing or of the wrong type, a category or split of its own outside the enums)
    is skipped, counted in ``dropped`` under its code and logged with its place and id; only what
    is wrong with the whole file stops the stage. A ``chat_completions`` source holds generations
    to adopt (``meta.imported``): its messages are the request's, whole (nothing is cut or
    replayed: the server answered them); a logged request that failed is skipped, counted as
    ``failed_request``. A record longer than ``max_line_bytes`` (``line_too_long``) or nesting
    lists and objects deeper than ``MAX_JSON_DEPTH`` (``too_deep``) is skipped and counted too,
    never held whole or walked."""
    fmt, name = source.get("format", "openai"), source["name"]
    if fmt == "fields" and not source.get("prompt_field"):
        raise ValueError(f"prompt source {name!r}: format fields needs prompt_field, the field holding the prompt")
    try:
        with local_copy(source["path"]) as path:
            yield from _records_of(path, source["path"], fmt, name, source, Counter() if dropped is None else dropped,
                                   max_line_bytes)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"prompt source {name!r}: {e}") from None


# Lines a source may hold that no stage could read, skipped while reading: counted with the drops.
UNREADABLE = ("line_too_long", "too_deep")


def _records_of(path: Path, shown: str, fmt: str, name: str, source: dict, dropped: Counter,
                max_line_bytes: int | None = None) -> Iterator[dict]:
    def skipped(position: str, code: str, detail: str) -> None:
        dropped[code] += 1
        bound = " (prompts.max_line_bytes)" if code == "line_too_long" else ""
        log.warning("%s%s: %s: %s%s: skipped", shown, position, code, detail, bound)

    for index, (position, raw) in enumerate(source_records(path, max_line_bytes, skipped)):
        where = f"{shown}{position}"
        if deeper_than(raw):
            skipped(position, "too_deep", f"lists or objects nested more than {MAX_JSON_DEPTH} levels deep")
            continue
        if fmt == "chat_completions" and (failure := failed_exchange(raw)):
            dropped["failed_request"] += 1
            log.warning("%s: a failed request (%s), nothing to adopt: skipped", where, failure)
            continue
        try:
            yield from _prompt_records(raw, source, fmt, name, index, where)
        except Quirk as q:
            dropped[q.code] += 1
            own = raw.get("id")
            log.warning("%s%s: %s: %s: dropped", where, f" (id {own!r})" if isinstance(own, (str, int)) else "",
                        q.code, q.detail)


def _prompt_records(raw: dict, source: dict, fmt: str, name: str, index: int, where: str) -> list[dict]:
    """The prompt records of one source record (one per choice of a logged exchange), or the
    ``Quirk`` that makes it none."""
    if fmt == "chat_completions":
        entries = _imported_from(raw, source, where)
        _check_messages(entries[0][0], entries[0][1])  # every choice answers the same request
    else:
        try:
            messages, tools = _messages_from(raw, source)
        except KeyError as e:
            raise Quirk("malformed_record", f"missing field {e} for format {fmt!r}") from None
        except (TypeError, AttributeError):
            raise Quirk("malformed_record", f"a field of the wrong type for format {fmt!r} (see docs/stages.md "
                                            f"for the source formats)") from None
        _check_messages(messages, tools)
        messages, replay = split_replay(messages)
        if not any(m["role"] == "user" for m in messages):
            raise Quirk("no_user_turn", "no user turn before the first tool call to prompt with")
        entries = [(messages, tools, {"replay": replay} if replay else {})]
    # A benchmark's own fields mean other things (MT-Bench's category "writing", a split "test"):
    # a fields source takes both from its configuration.
    own = raw if fmt != "fields" else {}
    given = _enum_value(own, source, "category", CATEGORIES, None)
    split = _enum_value(own, source, "split", SPLITS, "train")
    records = []
    for choice, (messages, tools, extra) in enumerate(entries):
        tools = tools or None
        # no category given: a prompt that offers tools is a tool prompt (the tool gates and
        # `dflash check tools` look at those), any other is other; the record says it was inferred
        category = given or ("tool" if tools else "other")
        if not given:
            extra = {**extra, "category_inferred": True}
        # An imported generation is its own record: several answers to one prompt all count.
        keyed = messages + [{"replay": step} for step in extra.get("replay", [])]
        if "imported" in extra:
            keyed = keyed + [{"imported": extra["imported"]["message"], "choice": choice}]
        rec = {
            "id": stable_id(name, keyed, tools),
            "source": name,
            "category": category,
            "messages": messages,
            "tools": tools,
            "meta": {"index": index, "split": split, **extra},
        }
        if problem := record_problem("prompt", rec):
            raise Quirk("malformed_record", problem)
        records.append(rec)
    return records


def _enum_value(raw: dict, source: dict, key: str, allowed: tuple[str, ...], default: str) -> str:
    """A record's category or split: its own (outside ``allowed``: the record is dropped), else
    the source's (outside ``allowed``: the configuration is wrong, and the stage stops)."""
    # a test record trained on would make every eval on it a lie: an unknown split is never guessed
    expected = f"expected one of {', '.join(allowed)}" + ("; heldout records feed the eval only" if key == "split" else "")
    if raw.get(key):
        if raw[key] not in allowed:
            raise Quirk(f"unknown_{key}", f"unknown {key} {raw[key]!r} ({expected})")
        return raw[key]
    value = source.get(key, default)
    if value is not None and value not in allowed:
        raise ValueError(f"prompt source {source['name']!r}: unknown {key} {value!r} ({expected})")
    return value


def stratified_order(ids: np.ndarray, categories: np.ndarray) -> np.ndarray:
    """Indices of the records in shard order, where contiguous chunks mix categories in proportion.

    Each category's records (in id order, ties in input order) are spread evenly over [0, 1);
    sorting on that position, then on the category, interleaves the categories. ``categories``
    must sort as the category names do (the names, or codes into ``SORTED_CATEGORIES``).
    """
    by_id = np.argsort(ids, kind="stable")
    position = np.empty(len(ids))
    for category in np.unique(categories):
        members = by_id[categories[by_id] == category]
        position[members] = (np.arange(len(members)) + 0.5) / len(members)
    return np.lexsort((categories, position))


class _Kept:
    """What stays in memory of the records kept, in read order: id, category and split, for the
    stratification and the manifest. The records themselves go to the spill file as their lines."""

    def __init__(self, write):
        self.write, self.bytes = write, 0
        self.ids, self.categories, self.heldout = array("Q"), bytearray(), bytearray()
        self.inferred = Counter()  # categories inferred (none given), by category

    def add(self, rec: dict) -> None:
        line = dumps_line(rec)
        self.write(line)
        self.bytes += len(line)
        self.ids.append(int(rec["id"], 16))  # stable_id: 16 hex digits, whose numbers sort as the strings do
        self.categories.append(CATEGORY_CODE[rec["category"]])
        self.heldout.append(rec["meta"]["split"] == "heldout")
        if rec["meta"].get("category_inferred"):
            self.inferred[rec["category"]] += 1


def draw_heldout(ids: np.ndarray, categories: np.ndarray, share: float, max_per_category: int) -> np.ndarray:
    """Positions of the prompts to hold out: of each category's ``n`` (two at least), its
    ``ceil(share x n)`` smallest ids, at most ``max_per_category``. The ids are content hashes, so
    the draw is a random one that no reading order moves."""
    drawn = [np.empty(0, dtype=np.int64)]
    for category in np.unique(categories):
        members = np.flatnonzero(categories == category)
        if len(members) > 1:
            take = min(max_per_category, math.ceil(share * len(members)))
            drawn.append(members[np.argsort(ids[members], kind="stable")[:take]])
    return np.sort(np.concatenate(drawn))


def _read_sources(sources: list[dict], checks: PromptChecks | None, kept: _Kept,
                  max_line_bytes: int | None = None) -> dict[str, dict]:
    """Read, dedup and screen every source into ``kept``, ``SCREEN_BATCH`` records at a time;
    returns the counts per source name, read, dropped and flagged."""
    seen: set[bytes] = set()
    reads: dict[str, dict] = {}
    # All of a name's screening counts go to its last source's tally, as when screening followed all reading.
    screened: dict[str, dict] = defaultdict(lambda: {"dropped": Counter(), "flagged": Counter()})
    batch: list[dict] = []

    def screen_batch():
        for rec in checks.screen(batch, screened) if checks is not None else batch:
            kept.add(rec)
        batch.clear()

    for source in sources:
        counts = reads[source["name"]] = {"records": 0, "duplicate": 0}
        for rec in read_source(source, screened[source["name"]]["dropped"], max_line_bytes):
            counts["records"] += 1
            key = content_key(rec["messages"], rec["tools"], rec["meta"].get("replay") or rec["meta"].get("imported", {}).get("message"))
            if key in seen:
                counts["duplicate"] += 1
                continue
            seen.add(key)
            if shape := shape_problem(rec):
                screened[rec["source"]]["dropped"][shape[0]] += 1
                log.warning("prompt %s (%s:%d): %s: %s", rec["id"], rec["source"], rec["meta"]["index"] + 1, *shape)
                continue
            if unknown := schema_unknown(rec):
                screened[rec["source"]]["flagged"]["tool_schema_unknown"] += 1
                rec["meta"]["flags"] = [*rec["meta"].get("flags", []), "tool_schema_unknown"]
                log.warning("prompt %s (%s:%d): tool_schema_unknown: %s (kept, flagged)", rec["id"], rec["source"],
                            rec["meta"]["index"] + 1, unknown)
            batch.append(rec)
            if len(batch) == SCREEN_BATCH:
                screen_batch()
        # read, then dropped before they became records
        counts["records"] += sum(screened[source["name"]]["dropped"][code]
                                 for code in ("failed_request", *UNREADABLE, *QUIRKS))
        if not counts["records"]:
            notice(log, f"prompt source {source['name']!r} ({source['path']}) holds no records")
    screen_batch()
    tally = {}
    for name, counts in reads.items():
        # Duplicates are found while reading, before any screening: they come first in the counts.
        dropped = Counter({"duplicate": counts["duplicate"]} if counts["duplicate"] else {})
        dropped.update(screened[name]["dropped"])
        tally[name] = {"records": counts["records"], "dropped": dropped, "flagged": screened[name]["flagged"]}
    return tally


def dropped_share_problem(tally: dict[str, dict], sources: list[dict], limit: float | None) -> str | None:
    """The line that stops the stage when a source's drops (duplicates aside: a source may
    overlap another) pass ``limit`` of its records, or None. So many drops mean the source is
    not what its format says (a ShareGPT file given as openai), not that its records are odd."""
    if limit is None:
        return None
    for source in sources:
        counts = tally[source["name"]]
        lost = Counter({code: n for code, n in counts["dropped"].items() if code != "duplicate"})
        share = sum(lost.values()) / max(1, counts["records"])
        if share > limit:
            top = ", ".join(f"{code} {n:,}" for code, n in sorted(lost.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
            return (f"prompt source {source['name']!r} ({source['path']}): {share:.1%} of its {counts['records']:,} "
                    f"records dropped ({top}), over prompts.max_dropped_share {limit}: check its format "
                    f"({source.get('format', 'openai')}; the prompts log names each record) or raise the limit")
    return None


def _spilled_in_order(spill: Path, order: np.ndarray, spilled_bytes: int) -> Iterator[bytes]:
    """The lines of ``spill`` (a zstd JSONL file) in ``order`` (line numbers from 0), with one
    bucket of about ``BUCKET_BYTES`` in memory: a sequential pass deals each line into the bucket
    of its place; then each bucket is read back whole and put in order. Every read and write is
    sequential: the output folder may be on a network file system."""
    place = np.empty(len(order), dtype=np.int64)
    place[order] = np.arange(len(order))
    buckets = min(MAX_BUCKETS, max(1, -(-spilled_bytes // BUCKET_BYTES)))
    bucket_of = place // max(1, -(-len(order) // buckets))
    paths = [spill.with_name(f".bucket-{b:03d}") for b in range(buckets)]
    with ExitStack() as stack:
        files = [stack.enter_context(open(path, "wb", buffering=1 << 16)) for path in paths]
        # zstandard's reader, not dflash.core.io's: it returns a bounded size however well the lines compress
        with open(spill, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            for line, b in zip(io.BufferedReader(reader, 1 << 20), bucket_of.tolist()):
                files[b].write(line)
    spill.unlink()
    for b, path in enumerate(paths):
        with open(path, "rb") as f:
            lines = f.readlines()
        path.unlink()
        for k in np.argsort(place[bucket_of == b]).tolist():
            yield lines[k]
        del lines  # before the next bucket is read: one bucket in memory at a time


def build_prompts(sources: list[dict], out_dir: str | Path, shard_size: int, checks: PromptChecks | None = None,
                  max_line_bytes: int | None = None, max_dropped_share: float | None = None,
                  heldout: dict | None = None) -> dict:
    """Read, dedup, screen (with ``checks``) and shard all sources into ``out_dir``; returns the
    manifest, which counts per source the records read, kept, dropped and flagged. A source that
    loses more than ``max_dropped_share`` of its records (duplicates aside) stops the stage
    before anything is written (``dropped_share_problem``). When no record or source marks a split
    of ``heldout``, ``heldout`` (``share``, ``max_per_category``: ``prompts.heldout_*``) draws the
    held-out set from each category (``draw_heldout``).

    The records are streamed: each kept record is written to a spill file as soon as it is
    screened, and memory holds only a content hash per record read (the dedup) and the id,
    category and split of each record kept (the stratification), not the records.
    """
    with atomic_dir(out_dir, "prompts") as tmp:
        spill = tmp / ".spill.jsonl.zst"
        with jsonl_zst_writer(spill, level=1) as write:
            kept = _Kept(write)
            tally = _read_sources(sources, checks, kept, max_line_bytes)
        if problem := dropped_share_problem(tally, sources, max_dropped_share):
            raise ValueError(problem)
        dropped = sum((c["dropped"] for c in tally.values()), Counter())
        ids, categories = np.frombuffer(kept.ids, dtype=np.uint64), np.frombuffer(kept.categories, dtype=np.uint8)
        held_out = np.frombuffer(kept.heldout, dtype=np.uint8).astype(bool)
        drawn = None
        if not held_out.any() and heldout and heldout["share"]:
            held_out[(drawn := draw_heldout(ids, categories, heldout["share"], heldout["max_per_category"]))] = True
        train, held = np.flatnonzero(~held_out), np.flatnonzero(held_out)
        if not len(train):
            raise ValueError("no training prompts in the configured sources"
                             + (f" (dropped: {', '.join(f'{k} {n}' for k, n in dropped.items())})" if dropped else ""))
        train = train[stratified_order(ids[train], categories[train])]
        held = held[np.argsort(ids[held], kind="stable")]
        shards = [train[i:i + shard_size] for i in range(0, len(train), shard_size)]
        lines = _spilled_in_order(spill, np.concatenate([train, held]), kept.bytes)
        for i, shard in enumerate(shards):
            with jsonl_zst_writer(tmp / shard_name(i)) as write:
                for _ in range(len(shard)):
                    write(next(lines))
        with jsonl_zst_writer(tmp / "heldout.jsonl.zst") as write:
            for line in lines:
                write(line if drawn is None else _held_out_line(line))
        # Which shard holds an id, known without reading the shards: exclusion lists map to jobs.
        with open(tmp / "ids.tsv", "w", encoding="utf-8") as f:
            for i, shard in enumerate(shards):
                f.write("".join(f"{id_:016x}\t{i:05d}\n" for id_ in ids[shard].tolist()))
        manifest = {
            "shards": [
                {"name": shard_name(i), "records": len(s),
                 "categories": dict(Counter(SORTED_CATEGORIES[c] for c in categories[s].tolist()))}
                for i, s in enumerate(shards)
            ],
            "prompts": len(train),
            "heldout": len(held),
            "categories": _counts(categories[np.sort(train)]),
            "heldout_categories": _counts(categories[np.sort(held)]),
            # where the held-out set comes from: the sources' splits, or drawn (prompts.heldout_share)
            "heldout_from": "the sources' splits" if drawn is None else {**heldout, "drawn": len(drawn)},
            "categories_inferred": dict(kept.inferred),
            "dropped": dict(dropped),
            "sources": {name: {"records": c["records"], "kept": c["records"] - sum(c["dropped"].values()),
                               "dropped": dict(c["dropped"]), "flagged": dict(c["flagged"])}
                        for name, c in tally.items()},
        }
        manifest["warnings"] = _warnings(manifest)
        write_json(tmp / "manifest.json", manifest)
    log.info("prompts: %d training prompts in %d shards, %d held out, dropped %s",
             len(train), len(shards), len(held), manifest["dropped"] or "none")
    for warning in manifest["warnings"]:
        notice(log, f"prompts: {warning}")
    return manifest


def _counts(codes: np.ndarray) -> dict[str, int]:
    """Prompts per category, in the order the categories were first read."""
    return dict(Counter(SORTED_CATEGORIES[c] for c in codes.tolist()))


def _held_out_line(line: bytes) -> bytes:
    rec = json.loads(line)
    rec["meta"]["split"] = "heldout"
    return dumps_line(rec)


def _warnings(manifest: dict) -> list[str]:
    """What the run will miss, said when the prompts are made rather than after generation."""
    warnings = []
    if not manifest["heldout"]:
        warnings.append("no held-out prompts (no source marks a split of heldout, and prompts.heldout_share is 0): "
                        "the eval will have nothing to measure; set prompts.heldout_share or mark a source "
                        "split: heldout")
    if set(manifest["categories"]) == {"other"}:
        warnings.append("every training prompt is in category other (no record or source gives one, and none "
                        "offers tools): acceptance is reported for other alone; give the sources a category "
                        "(prompts.sources[].category)")
    return warnings


def prompts_job(config: dict, target_dir: str | Path, out_dir: str | Path) -> dict:
    """The prompts stage as its rule and ``dflash prompts`` run it: the config's sources into
    shards, screened by the target's tokenizer, template and context (``prompt_check_settings``)."""
    prompts = config["prompts"]
    return build_prompts(prompts["sources"], out_dir, prompts["shard_size"],
                         prompt_checks(target_dir, prompt_check_settings(config)), prompts["max_line_bytes"],
                         prompts["max_dropped_share"], heldout_settings(config))
