"""A target and its drafter by their configs alone, without torch: the target's text config, the
target layers a drafter reads, the sizes it takes from the target, what would stop it training or
serving, and the hidden-state cache of those layers (its shards' format, its size). The Snakefile
(rule params), the target, gate, hidden and train stages, serving, the plan and ``dflash
cache-size`` read these; importing torch and transformers would cost each of them seconds to read
a few numbers."""
from __future__ import annotations

import json
from pathlib import Path

from dflash.core.units import human_bytes


def layer_selection(drafter_cfg: dict) -> dict:
    """What decides the captured target layers, and nothing else: a rule param that changes
    only when the hidden-state cache really has to be rebuilt."""
    if drafter_cfg["target_layer_ids"]:
        return {"target_layer_ids": list(drafter_cfg["target_layer_ids"])}
    return {"target_layer_ids": None, "num_layers": drafter_cfg["num_layers"]}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference choice of target layers: the middle one for a 1-layer draft, else evenly
    spaced from layer 1 to layer N-3."""
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    if len(set(ids)) != len(ids) or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"the default target layers for {num_draft_layers} draft layers on a {num_target_layers}-layer "
            f"target are {ids} (duplicated or out of range); set target_layer_ids explicitly"
        )
    return ids


def resolve_layer_ids(layers: dict, num_target_layers: int) -> list[int]:
    """The configured ``target_layer_ids``, or the reference default for the draft depth."""
    ids = layers.get("target_layer_ids")
    return list(ids) if ids else build_target_layer_ids(num_target_layers, layers["num_layers"])


def text_config(target: str | Path) -> dict:
    """The language model's part of a target's config: from a model folder or its config.json as
    JSON, else (a hub name) from the local hub cache through transformers; nothing is downloaded."""
    path = Path(target)
    path = path / "config.json" if path.is_dir() else path
    if path.name == "config.json" and path.is_file():
        config = json.loads(path.read_text(encoding="utf-8"))
        return config.get("text_config") or config
    from transformers import AutoConfig  # heavy: a hub name only

    try:
        return AutoConfig.from_pretrained(target, local_files_only=True).get_text_config().to_dict()
    except OSError:
        raise ValueError(f"{target}: no model folder, config.json or cached hub model of that name on this "
                         f"machine (nothing is downloaded to size a cache): pass --target the model's folder or "
                         f"its config.json") from None


def drafter_target_problems(drafter: dict, text: dict) -> list[tuple[str, str]]:
    """(key path, problem) for a ``drafter`` section that cannot train on a target whose text
    config is ``text``: known from the target's config.json alone, so said before any GPU stage
    rather than by the hidden or train job after every generate job."""
    layers, problems = text.get("num_hidden_layers"), []  # None: a config.json that does not say (the hidden job will)
    ids = drafter["target_layer_ids"]
    if layers and ids and (beyond := [i for i in ids if i >= layers]):
        problems.append(("drafter.target_layer_ids", f"{ids} names layer(s) {beyond} of a target with {layers} layers "
                                                     f"(ids 0 to {layers - 1}): pick layers the target has"))
    elif layers and not ids:
        try:
            build_target_layer_ids(layers, drafter["num_layers"])
        except ValueError as e:
            problems.append(("drafter.target_layer_ids", str(e)))
    mask = drafter.get("mask_token_id")
    if mask is not None and text.get("vocab_size") and mask >= text["vocab_size"]:
        problems.append(("drafter.mask_token_id", f"{mask} is outside the target's vocabulary of {text['vocab_size']}"))
    return problems


# The drafter's sizes that default to the target's own (drafter.* null), by the target's key.
DRAFTER_FROM_TARGET = {"intermediate_size": "intermediate_size", "num_heads": "num_attention_heads",
                       "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}


def drafter_sizes(drafter: dict, text: dict) -> dict:
    """The drafter's layer sizes: its own, or the target's where ``drafter.*`` is null."""
    return {k: drafter[k] if drafter[k] is not None else text[t] for k, t in DRAFTER_FROM_TARGET.items()}


def serving_problems(config: dict) -> list[str]:
    """One line for each reason the drafter of ``config`` would not run, or would run wrongly, in
    an engine; empty when none."""
    problems = []
    if "is_causal" in config or "causal" in config.get("dflash_config", {}):
        problems.append("the drafter config carries is_causal / dflash_config.causal: vLLM would run every draft "
                        "layer causally (a block sees only the slots before it); remove the key")
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if {"sliding_attention", "full_attention"} <= layer_types:
        problems.append("the drafter mixes sliding and full attention layers: vLLM's CPU runner refuses it "
                        "(NotImplementedError); vLLM on GPU and SGLang run it")
    return problems


# What a hidden-state shard holds (features, and since v2 the target's greedy token per token). The
# hidden rule's params carry it, so a cache of an older format is made again.
HIDDEN_FORMAT = "dflash-hidden-v2"
GREEDY_BYTES = 4  # one int32 per token: the target's greedy next token (target_argmax)
VALUE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def cache_bytes(tokens: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of a hidden-state cache: tokens x layers x hidden x bytes per value (fp8 adds one
    float32 scale per token and layer), and the target's greedy token per token."""
    scales = 4 * tokens * num_layers if dtype == "float8_e4m3fn" else 0
    return tokens * num_layers * hidden_size * VALUE_BYTES[dtype] + scales + GREEDY_BYTES * tokens


def cache_plan(config: dict, target_dir: str | Path, tokens: int) -> dict:
    """The hidden-state cache a run would write: tokens, layers, hidden size, dtype, bytes."""
    text = text_config(target_dir)
    layers = len(resolve_layer_ids(layer_selection(config["drafter"]), text["num_hidden_layers"]))
    dtype, hidden = config["hidden"]["dtype"], text["hidden_size"]
    size = cache_bytes(tokens, layers, hidden, dtype)
    return {"tokens": tokens, "layers": layers, "hidden_size": hidden, "dtype": dtype, "bytes": size,
            "text": f"{tokens:.3g} tokens x ({layers} layers x {hidden} x {VALUE_BYTES[dtype]} B"
                    f"{' + scales' if dtype == 'float8_e4m3fn' else ''} + {GREEDY_BYTES} B greedy token) = "
                    f"{human_bytes(size)}"}
