"""JSON Schemas of the record kinds (``dflash/schemas/*.schema.yaml``), for checking any shard."""
from __future__ import annotations

from functools import cache
from importlib import resources

import yaml
from jsonschema import Draft202012Validator

KINDS = {"prompt": "prompt.schema.yaml", "completion": "completion.schema.yaml"}


@cache
def validator(kind: str) -> Draft202012Validator:
    text = resources.files("dflash").joinpath(f"schemas/{KINDS[kind]}").read_text(encoding="utf-8")
    return Draft202012Validator(yaml.safe_load(text))


def record_errors(kind: str, record: dict) -> list[str]:
    """Human-readable schema violations of one record (empty when it conforms)."""
    return [f"{'.'.join(map(str, e.absolute_path)) or 'record'}: {e.message}"
            for e in validator(kind).iter_errors(record)]
