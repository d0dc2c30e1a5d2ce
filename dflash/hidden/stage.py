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
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from dflash.core.config import defaults
from dflash.core.io import atomic_path, read_json
from dflash.core.shapes import HIDDEN_FORMAT, layer_selection, resolve_layer_ids
from dflash.core.tensors import load_safetensors, save_safetensors
from dflash.core.workflow import progress
from dflash.hidden.feature_guard import STATS_KEY, FeatureStats, check_summary
from dflash.target.head import head_argmax
from dflash.target.models import check_fast_kernels, load_target, pick_device

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
def forward_features(model, input_ids: torch.Tensor, layer_ids: list[int], logits: bool = True,
                     captured: dict | None = None, **model_kwargs):
    """One target forward: (logits [B, T, V] or None, features [B, T, k, H]); ``model_kwargs``
    (a KV cache, logits_to_keep) go to the model's forward, which runs without a cache by default.
    ``captured``: the dict of a :func:`capture_layers` block the caller keeps open over many
    forwards (a decode loop), so the hooks are not registered anew for each.

    Features are stacked in ``layer_ids`` order, in the model's dtype. The last decoder layer's
    entry in transformers' ``hidden_states`` is taken after the final norm, so the same is done
    here to keep ``features[..., j, :] == hidden_states[layer_ids[j] + 1]`` for every id.
    """
    base = base_model(model)
    hooks = capture_layers(model, layer_ids) if captured is None else nullcontext(captured)
    with hooks as outputs:
        if logits:
            lg = model(input_ids=input_ids, **{"use_cache": False, **model_kwargs}).logits
        else:
            base(input_ids=input_ids, use_cache=False)
            lg = None
    last = len(base.layers) - 1
    feats = torch.stack([base.norm(outputs[i]) if i == last else outputs[i] for i in layer_ids], dim=2)
    return lg, feats


def features_and_greedy(model, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's (features [T, k, H], the target's greedy next token after each position [T],
    int32) from one forward ``input_ids`` [1, T]: the last layer's normed output through the
    lm_head, chunk by chunk (never the whole logits), whether or not it is a feature layer."""
    last = len(decoder_layers(model)) - 1
    ids = list(layer_ids) + ([] if last in layer_ids else [last])
    _, feats = forward_features(model, input_ids, ids, logits=False)
    greedy = head_argmax(feats[0, :, ids.index(last)], model.get_output_embeddings().weight)
    return feats[0, :, :len(layer_ids)], greedy


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def to_fp8(feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scale per token and layer): each token's vector is scaled so its
    largest magnitude is the largest fp8 value."""
    scale = feats.float().abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (feats.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def cached_features(handle, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of an open hidden-state shard (safetensors ``safe_open``), dequantized
    when stored as fp8."""
    feats = handle.get_slice("hidden_states")[start:end]
    if feats.dtype == torch.float8_e4m3fn:
        return feats.float() * handle.get_slice("scales")[start:end].unsqueeze(-1)
    return feats


def row_name(tokenized_path: Path, row: int) -> str:
    """``row N (record ID)``: the record's id from the index tokenize writes beside the shard."""
    try:
        return f"row {row} (record {read_json(Path(tokenized_path).with_suffix('.json'))['rows'][row]['id']})"
    except (OSError, ValueError, LookupError, TypeError):
        return f"row {row}"


def check_token_ids(tokenized_path: Path, input_ids: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> None:
    """Refuse ids the target has no embedding row for (a shard tokenized with another tokenizer),
    naming the first row that holds one: the forward would fail with a bare ``IndexError``."""
    bad = ((input_ids < 0) | (input_ids >= vocab_size)).nonzero()
    if not len(bad):
        return
    at = int(bad[0])
    row = int(torch.searchsorted(offsets, at, right=True)) - 1
    raise ValueError(f"{tokenized_path}: {row_name(tokenized_path, row)} holds token id {int(input_ids[at])}, "
                     f"outside the target's vocabulary of {vocab_size} ids ({len(bad)} of the shard's "
                     f"{len(input_ids)} tokens are): it was tokenized with another tokenizer; re-run tokenize with "
                     f"this target's")


def capture_shard(tokenized_path: Path, out_path: Path, target_dir: Path, layers: dict,
                  dtype: str | None = None, device: str = "auto", fast_kernels: str | None = None) -> dict:
    """Selected-layer features of every token of every row of a tokenized shard, and the
    target's greedy next token after each (the labels of ``train.loss.labels: target``).

    Writes ``hidden_states`` [T_total, k, H] and ``target_argmax`` [T_total] (int32) aligned with
    the tokenized shard's flat ``input_ids`` (which are stored again, with ``offsets``, so a cache
    can be checked against its rows). On CUDA the target runs in bfloat16. ``dtype`` and
    ``fast_kernels``: ``hidden.dtype`` and ``target.fast_kernels``, the schema's when not given.
    """
    from transformers import AutoConfig  # heavy: the capture only

    dtype = dtype or defaults("hidden")["dtype"]
    fast_kernels = fast_kernels or defaults("target")["fast_kernels"]
    rows = load_safetensors(tokenized_path, ("input_ids", "offsets"), "a tokenized shard")
    input_ids, offsets = rows["input_ids"], rows["offsets"]
    on = pick_device(device)
    check_fast_kernels(AutoConfig.from_pretrained(target_dir), on, fast_kernels, log)  # before minutes of loading
    model = load_target(target_dir, torch.bfloat16 if on.type == "cuda" else torch.float32)[0].to(on)
    check_token_ids(tokenized_path, input_ids, offsets, model.get_input_embeddings().weight.shape[0])
    layer_ids = resolve_layer_ids(layers, model.config.num_hidden_layers)
    hidden_size = model.config.hidden_size
    out = torch.empty((len(input_ids), len(layer_ids), hidden_size), dtype=DTYPES[dtype])
    fp8 = dtype == "float8_e4m3fn"
    scales = torch.empty((len(input_ids), len(layer_ids)), dtype=torch.float32) if fp8 else None
    greedy = torch.empty(len(input_ids), dtype=torch.int32)
    stats = FeatureStats(layer_ids)
    t0 = time.time()
    for r in progress(range(len(offsets) - 1), desc=f"hidden {Path(tokenized_path).stem}", unit="row"):
        a, b = offsets[r].item(), offsets[r + 1].item()
        feats, greedy[a:b] = features_and_greedy(model, input_ids[a:b].long().unsqueeze(0).to(on), layer_ids)
        stats.add_row(feats, lambda: f"{tokenized_path}: {row_name(tokenized_path, r)}")
        if fp8:
            out[a:b], scales[a:b] = to_fp8(feats.cpu())
        else:
            out[a:b] = feats.to(out.dtype).cpu()
    # the shard alone: across shards, training compares them (here another shard may be a stale
    # output of another target, about to be rebuilt)
    features = stats.summary()
    check_summary(features, str(out_path), None, 0)
    metadata = {"format": HIDDEN_FORMAT, "target_layer_ids": json.dumps(list(layer_ids)),
                "hidden_size": str(hidden_size), "dtype": dtype, "model": Path(target_dir).name,
                STATS_KEY: json.dumps(features)}
    tensors = {"hidden_states": out, "target_argmax": greedy, "input_ids": input_ids, "offsets": offsets,
               **({"scales": scales} if fp8 else {})}
    with atomic_path(out_path) as tmp:
        save_safetensors(tensors, tmp, metadata)
    summary = {"rows": len(offsets) - 1, "tokens": len(input_ids), "layers": list(layer_ids),
               "bytes": sum(t.numel() * t.element_size() for k, t in tensors.items()
                            if k in ("hidden_states", "scales", "target_argmax")),
               "seconds": round(time.time() - t0, 2), "features": features["layers"]}
    log.info("hidden %s: %s", Path(tokenized_path).name, summary)
    return summary


def hidden_job(config: dict, tokenized_path: Path, target_dir: Path, out_path: Path) -> dict:
    """The hidden stage as its rules (the shards' and the pilot's) and ``dflash hidden`` run it: the
    drafter's layers (``layer_selection``, the rule's param) in ``hidden.dtype``; the target's
    ``fast_kernels`` policy is no param: it changes no result."""
    return capture_shard(tokenized_path, out_path, target_dir, layer_selection(config["drafter"]),
                         config["hidden"]["dtype"], fast_kernels=config["target"]["fast_kernels"])
