"""Hidden-state capture: the target's selected layer outputs for every token.

Layer convention (the same as the reference DFlash code): layer id ``i`` means the output of
decoder layer ``i``, i.e. transformers' ``hidden_states[i + 1]`` (index 0 is the embeddings).
Only the selected layers are captured, with forward hooks, so no full hidden-state tuple is
materialised.
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def base_model(model):
    """The decoder stack (embeddings, layers, final norm) of a causal LM, text-only or composite."""
    base = model.model if hasattr(model, "model") else model
    return base.language_model if hasattr(base, "language_model") else base


def decoder_layers(model) -> torch.nn.ModuleList:
    return base_model(model).layers


@contextmanager
def capture_layers(model, layer_ids: list[int]):
    """Collect the outputs of the given decoder layers during forwards inside the block.

    Yields a dict ``layer_id -> tensor [B, T, H]`` filled by the next forward.
    """
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range: the target has {len(layers)} decoder layers")
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def forward_features(model, input_ids: torch.Tensor, layer_ids: list[int], logits: bool = True):
    """One target forward: (logits [B, T, V] or None, features [B, T, k, H]).

    Features are stacked in ``layer_ids`` order, in the model's dtype. The last decoder layer's
    entry in transformers' ``hidden_states`` is taken after the final norm, so the same is done
    here to keep ``features[..., j, :] == hidden_states[layer_ids[j] + 1]`` for every id.
    """
    base = base_model(model)
    with capture_layers(model, layer_ids) as captured:
        if logits:
            lg = model(input_ids=input_ids, use_cache=False).logits
        else:
            base(input_ids=input_ids, use_cache=False)
            lg = None
    last = len(base.layers) - 1
    feats = torch.stack([base.norm(captured[i]) if i == last else captured[i] for i in layer_ids], dim=2)
    return lg, feats


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_layer_ids(layers: dict, num_target_layers: int) -> list[int]:
    """The configured ``target_layer_ids``, or the reference default for the draft depth."""
    from dflash.drafter import build_target_layer_ids

    ids = layers.get("target_layer_ids")
    return list(ids) if ids else build_target_layer_ids(num_target_layers, layers["num_layers"])


def capture_shard(tokenized_path: Path, out_path: Path, target_dir: Path, layers: dict,
                  dtype: str = "bfloat16") -> dict:
    """Selected-layer features of every token of every row of a tokenized shard.

    Writes ``hidden_states`` [T_total, k, H] aligned with the tokenized shard's flat ``input_ids``
    (which are stored again, with ``offsets``, so a cache can be checked against its rows).
    """
    from safetensors.torch import load_file, save_file
    from dflash.io import atomic_path
    from dflash.target import load_target
    from dflash.workflow import progress

    rows = load_file(str(tokenized_path))
    input_ids, offsets = rows["input_ids"], rows["offsets"]
    model, _ = load_target(target_dir)
    layer_ids = resolve_layer_ids(layers, model.config.num_hidden_layers)
    hidden_size = model.config.hidden_size
    out = torch.empty((len(input_ids), len(layer_ids), hidden_size), dtype=DTYPES[dtype])
    t0 = time.time()
    for r in progress(range(len(offsets) - 1), desc=f"hidden {Path(tokenized_path).stem}"):
        a, b = offsets[r].item(), offsets[r + 1].item()
        _, feats = forward_features(model, input_ids[a:b].long().unsqueeze(0), layer_ids, logits=False)
        out[a:b] = feats[0].to(out.dtype)
    metadata = {"format": "dflash-hidden-v1", "target_layer_ids": json.dumps(list(layer_ids)),
                "hidden_size": str(hidden_size), "dtype": dtype, "model": Path(target_dir).name}
    with atomic_path(out_path) as tmp:
        save_file({"hidden_states": out, "input_ids": input_ids, "offsets": offsets}, str(tmp), metadata=metadata)
    summary = {"rows": len(offsets) - 1, "tokens": len(input_ids), "layers": list(layer_ids),
               "bytes": out.numel() * out.element_size(), "seconds": round(time.time() - t0, 2)}
    log.info("hidden %s: %s", Path(tokenized_path).name, summary)
    return summary
