"""Config loading: the JSON Schema shipped in the package validates and fills every config.

The same function serves the Snakefile and the ``dflash`` CLI, so a config that passes one
passes the other. Errors name the file and the key path, with a suggestion for a misspelt key.
"""
from __future__ import annotations

import copy
import difflib
import functools
import json
import os
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


@functools.cache
def _schema() -> dict:
    return yaml.safe_load(schema_path().read_text(encoding="utf-8"))


def load_schema() -> dict:
    return copy.deepcopy(_schema())  # a caller's changes stay its own


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


def defaults(section: str) -> dict:
    """The schema's defaults of one top-level section, its nested sections filled too: the one
    source of every default. Code handed part of a section (a test, a bench script, a library
    call) completes it from here, so nothing restates a default the schema states."""
    instance: dict = {section: {}}
    for _ in _Filling(_schema()).iter_errors(instance):  # filling happens as it validates
        pass
    return instance[section]


def completed(cfg: dict, section: str) -> dict:
    """``cfg``, some of a section's keys, over that section's defaults (nested mappings merged key
    by key): what code handed part of a section reads. A loaded config is complete already."""
    def merged(base: dict, over: dict) -> dict:
        return {**base, **{k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                           for k, v in over.items()}}

    return merged(defaults(section), cfg)


def _allowed_keys(schema: dict, path: list) -> list[str]:
    node = schema
    for part in path:
        if isinstance(part, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(part, {})
    return sorted(node.get("properties", {}))


# Keys renamed since a release, by their path: the error names the new one.
RENAMED = {"generate.save_every": "generate.mirror_every (its records and seconds unchanged: only train.save_every "
                                  "counts steps)"}


def _describe(error, schema: dict, source: str) -> str:
    where = ".".join(str(p) for p in error.absolute_path) or "top level"
    if list(error.absolute_path)[:4] == ["generate", "server", "launch", "env"] and len(error.absolute_path) > 4:
        return f"{source}: at {where}: must be a string (its value is not shown: it may be a secret)"
    if error.validator == "additionalProperties":
        unknown = re.findall(r"'([^']+)'", error.message.split("(")[-1])
        allowed = _allowed_keys(schema, list(error.absolute_path))
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, allowed, n=1)
            if (renamed := RENAMED.get(f"{where}.{key}")):
                hints.append(f"'{key}' is now {renamed}")
            else:
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
    """(key path, problem) for what one key's schema cannot see (how keys go together), or could only
    say by echoing the value (a secret in a url)."""
    generate = config["generate"]
    url, launch = generate["server"]["url"], generate["server"]["launch"]
    problems = []
    # user:password@host: the url is printed in logs and errors, and urllib would take it for a host name
    if url is not None and "@" in re.split(r"[/?#]", url.split("://", 1)[-1])[0]:
        problems.append(("generate.server.url", "holds a user name or password (user:password@host), which logs and "
                                                "errors would show with the url: remove it, and set "
                                                "generate.server.api_key_env to the environment variable holding "
                                                "the key"))
    elif url is not None and ("?" in url or "#" in url):  # /chat/completions goes after it: a key there leaks
        problems.append(("generate.server.url", "holds a query or fragment (?... or #...): give the base URL ending "
                                                "in /v1; an API key goes in the environment variable named by "
                                                "generate.server.api_key_env"))
    if launch is None:
        return problems
    if url is not None:
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


def _place_problems(config: dict) -> list[tuple[str, str]]:
    """(key path, problem) for where the outputs would go and what names them, that a pattern
    cannot say: a folder that would put outputs at the file system's root or among the project's
    own files, and two sources of one name (ids and counts are kept per source name)."""
    problems = []
    out = config["output_dir"]
    if not out.strip():
        problems.append(("output_dir", "is empty: outputs would go to /prompts, /target ... at the file system's "
                                       "root; give a folder such as results"))
    elif all(part in ("", ".", "..") for part in os.path.normpath(out).split(os.sep)):
        problems.append(("output_dir", f"{out!r} is the working directory, a folder above it or the file system's "
                                       f"root, where the stages' folders would mix with others: give a folder of "
                                       f"its own, such as results"))
    names = [s["name"] for s in config["prompts"]["sources"]]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(("prompts.sources", f"two sources are named {name!r}: give each a name of its own (ids and "
                                            f"counts are kept per source name)"))
    return problems


def check_config(config: dict, source: str = "config") -> dict:
    """Validate ``config`` in place against the schema, filling defaults; raise ConfigError."""
    schema = load_schema()
    errors = sorted(_Filling(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    lines = ([_describe(e, schema, source) for e in errors] if errors
             else [f"{source}: at {where}: {problem}" for where, problem in _place_problems(config) + _between_keys(config)])
    if lines:
        raise ConfigError("invalid configuration: " + ("\n  ".join([""] + lines) if len(lines) > 1 else lines[0]))
    return config


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last one without a word)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"{self.name}:{key_node.start_mark.line + 1}: key {key!r} is given twice in one "
                                  f"mapping (also on line {seen[key]}): keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping file users edit (a config, the site file), read strictly: a syntax error, a
    key given twice, an empty file or a top level that is no mapping is one line naming the file
    and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{path}: the file is empty: expected a YAML mapping of keys")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level is a YAML {type(data).__name__}, not a mapping of keys")
    return data


def read_config_yaml(path: str | Path) -> dict:
    """A pipeline config file, as ``read_yaml`` reads it, refusing a YAML template: with
    ``__use_yte__: true`` Snakemake runs the file's ``?`` expressions as Python while it reads a
    --configfile, so a config handed over could run code on every node (profiles may keep YTE:
    they are the site's own)."""
    config = read_yaml(path)
    if "__use_yte__" in config:
        line = next((n for n, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1)
                     if text.lstrip("\ufeff").startswith("__use_yte__")), None)
        raise ConfigError(f"{path}{f':{line}' if line else ''}: __use_yte__ makes Snakemake run this file's ?-expressions "
                          f"as Python code; a pipeline config holds plain values: remove the key and write the "
                          f"values out")
    return config


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    config = read_config_yaml(path)
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
