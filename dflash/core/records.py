"""The record kinds: their JSON Schemas (``dflash/schemas/*.schema.yaml``), for checking any
shard, and the completion record's one constructor (``make_completion``).

Every stage reads its input records through ``checked_records``: a record of the wrong kind or
shape (a prompts shard given to tokenize, a completion without ``text``) is one line naming the
file, the line and the id as it is read, never a ``KeyError`` deep inside a stage. The check runs
compiled (fastjsonschema, a few microseconds a record, less than parsing the line).
"""
from __future__ import annotations

import copy
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator

import fastjsonschema
import yaml

from dflash.core.chat import split_reasoning
from dflash.core.io import iter_jsonl_lines

KINDS = {"prompt": "prompt.schema.yaml", "completion": "completion.schema.yaml"}


@cache
def schema(kind: str) -> dict:
    return yaml.safe_load(resources.files("dflash").joinpath(f"schemas/{KINDS[kind]}").read_text(encoding="utf-8"))


@cache
def _compiled(kind: str, unread: tuple[str, ...]) -> Callable[[dict], object]:
    """The kind's schema compiled, less the requirement of fields the reader leaves unparsed."""
    s = copy.deepcopy(schema(kind))
    s["required"] = [k for k in s["required"] if k not in unread]
    return fastjsonschema.compile(s)


def record_problem(kind: str, record: dict, unread: tuple[str, ...] = ()) -> str | None:
    """The first way ``record`` breaks its kind's schema, as a short phrase, or None."""
    try:
        _compiled(kind, unread)(record)
    except fastjsonschema.JsonSchemaValueException as e:
        return e.message.removeprefix("data.").removeprefix("data ")
    return None


def checked_records(path: str | Path, kind: str, expected: str,
                    skip_arrays: tuple[str, ...] = ()) -> Iterator[tuple[bytes, dict]]:
    """(raw line, record) of a shard (``dflash.core.io.iter_jsonl_lines``), each checked against the
    ``kind`` schema as it is read. ``expected`` says what the reader takes, for the error line
    (e.g. "validate reads the completions/ shards of the generate stage")."""
    for n, (line, rec) in enumerate(iter_jsonl_lines(path, skip_arrays), 1):
        if problem := record_problem(kind, rec, skip_arrays):
            raise ValueError(f"{path}:{n}: record {rec.get('id', '(no id)')}: {problem}: not a {kind} record; "
                             f"{expected}")
        yield line, rec


def make_completion(prompt: dict, text: str, finish_reason: str, generation: dict, *, step: int = 0,
                    token_ids: tuple[list | None, list | None] = (None, None), usage: tuple[int, int] = (0, 0),
                    error: str | None = None) -> dict:
    """A completion record of ``prompt`` (``completion.schema.yaml``), the one constructor the
    generated, failed and adopted ones share: the model's ``text`` split into reasoning and content
    as every stage splits it (an error record has neither); step N > 0 of a replayed conversation
    gets the id ``<prompt id>-gN``."""
    reasoning, content = (None, "") if error else split_reasoning(text, generation["enable_thinking"])
    return {"id": f"{prompt['id']}-g{step}" if step else prompt["id"], "prompt_id": prompt["id"],
            **{k: prompt[k] for k in ("source", "category", "messages", "tools")},
            "text": text, "reasoning": reasoning, "content": content, "finish_reason": finish_reason,
            "prompt_token_ids": token_ids[0], "output_token_ids": token_ids[1],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
            "generation": generation, "error": error}
