"""Config loading: the JSON Schema shipped in the package validates and fills every config.

The same function serves the Snakefile and the ``dflash`` CLI, so a config that passes one
passes the other. Errors name the file and the key path, with a suggestion for a misspelt key.
"""
from __future__ import annotations

import copy
import difflib
import json
import re
import shlex
import string
from importlib import resources
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, validators

SCHEMA_FILE = "schemas/config.schema.yaml"
# What a generate.server.launch command may name; the serve rule fills them in.
PLACEHOLDERS = ("model", "host", "port", "served_model_name")


class ConfigError(ValueError):
    pass


def schema_path() -> Path:
    return Path(str(resources.files("dflash").joinpath(SCHEMA_FILE)))


def load_schema() -> dict:
    return yaml.safe_load(schema_path().read_text(encoding="utf-8"))


def _with_defaults(cls):
    """A validator that fills ``default`` values of missing properties before checking them."""
    check_properties = cls.VALIDATORS["properties"]

    def properties(validator, props, instance, schema):
        if isinstance(instance, dict):
            for name, sub in props.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, props, instance, schema)

    return validators.extend(cls, {"properties": properties})


_Filling = _with_defaults(Draft202012Validator)


def _allowed_keys(schema: dict, path: list) -> list[str]:
    node = schema
    for part in path:
        if isinstance(part, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(part, {})
    return sorted(node.get("properties", {}))


def _describe(error, schema: dict, source: str) -> str:
    where = ".".join(str(p) for p in error.absolute_path) or "top level"
    if error.validator == "additionalProperties":
        unknown = re.findall(r"'([^']+)'", error.message.split("(")[-1])
        allowed = _allowed_keys(schema, list(error.absolute_path))
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, allowed, n=1)
            hints.append(f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        return f"{source}: at {where}: {'; '.join(hints)}. Allowed keys: {', '.join(allowed)}"
    return f"{source}: at {where}: {error.message}"


def command_problem(template: str) -> str | None:
    """What is wrong with a ``generate.server.launch.command`` template, or None."""
    braces = "a literal brace is written {{ or }}"
    try:
        tokens = shlex.split(template)
    except ValueError as e:
        return f"not a valid command line: {e}"
    if not tokens:
        return "the command is empty"
    try:
        fields = {f for token in tokens for _, f, _, _ in string.Formatter().parse(token) if f is not None}
    except ValueError as e:
        return f"{e} ({braces})"
    unknown = sorted(fields - set(PLACEHOLDERS))
    if unknown:
        return (f"unknown placeholder {', '.join('{' + f + '}' for f in unknown)}; known: "
                f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} ({braces})")
    return None


def render_command(template: str, **values) -> list[str]:
    """The argv of a command template: split like a shell line before the placeholders are filled,
    so a value with spaces (a model path) stays one argument."""
    return [token.format(**values) for token in shlex.split(template)]


def _between_keys(config: dict) -> list[tuple[str, str]]:
    """(key path, problem) for what one key's schema cannot see: how keys go together."""
    generate = config["generate"]
    launch = generate["server"]["launch"]
    if launch is None:
        return []
    problems = []
    if generate["server"]["url"] is not None:
        problems.append(("generate.server", "url and launch are both set: with launch the pipeline starts the "
                                            "server and knows its url; set url: null, or remove launch to use "
                                            "the server at url"))
    if generate["backend"] != "openai":
        problems.append(("generate.server.launch", f"starts a server, which only backend 'openai' uses; "
                                                   f"generate.backend is '{generate['backend']}'"))
    command = command_problem(launch["command"])
    if command:
        problems.append(("generate.server.launch.command", command))
    return problems


def check_config(config: dict, source: str = "config") -> dict:
    """Validate ``config`` in place against the schema, filling defaults; raise ConfigError."""
    schema = load_schema()
    errors = sorted(_Filling(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    lines = ([_describe(e, schema, source) for e in errors] if errors
             else [f"{source}: at {where}: {problem}" for where, problem in _between_keys(config)])
    if lines:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    return config


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if overrides:
        config.update(overrides)
    return check_config(config, source=str(path))


# Sizes that suit the tiny demo target and would waste a real run: a config holding several of the
# demo's values for a real target was copied from the demo.
DEMO_SIZED = ("drafter.target_layer_ids", "train.num_anchors", "train.lr", "eval.max_new_tokens",
              "generate.sampling.max_tokens")


def _at(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def demo_sized_problem(config: dict, demo: dict, source: str, demo_source: str) -> str | None:
    """Why ``config`` must not run: it names a real target (``target.path``, a model with more layers
    than the demo builds) yet holds two or more of the demo's values of ``DEMO_SIZED``; None if fine."""
    path = config["target"]["path"]
    if not path:
        return None
    try:
        layers = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        layers = layers.get("text_config", layers).get("num_hidden_layers", 0)
    except (OSError, ValueError, AttributeError):
        return None  # not readable here (the model may live on the GPU nodes only): nothing to compare
    if layers <= _at(demo, "target.build.num_layers"):
        return None
    same = [k for k in DEMO_SIZED if _at(demo, k) is not None and _at(config, k) == _at(demo, k)]
    if len(same) < 2:
        return None
    values = ", ".join(f"{k} {_at(config, k)}" for k in same)
    return (f"{source}: target.path {path} is a {layers}-layer model, but {values} are the tiny demo's "
            f"values ({demo_source}); set them for this model (config/qwen3.6-27b.yaml is a complete real-run config)")
