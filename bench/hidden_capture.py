"""Hidden-state capture: the ``hidden`` stage's per-shard job against the fastest public way to
get the same cache (the selected layers' features and the target's greedy next tokens) from a
transformers model, on CPU, in alternating rounds.

SpecForge 0.2.0 cannot be the competitor here: it has no in-process target model any more
(``specforge/modeling/target/`` holds only the trainable head and the embeddings; its config says
"the in-process HF/custom target backends were removed with the server-only cutover",
``model.target_backend: Literal["sglang"]``), and its one extraction path,
``specforge.offline_capture`` (``OfflineSGLangCapture``), builds an SGLang 0.5.14 ``ModelRunner``
on ``torch.cuda.current_device()``: it needs SGLang and a CUDA GPU. So the floor is what anyone
would write with transformers alone: per row, the causal LM's full forward
(``model(input_ids, output_hidden_states=True)``), the selected ``hidden_states[i + 1]`` stacked
and cast into the same preallocated cache, the logits of every position ``.argmax(-1)`` as int32
into the same preallocated greedy tokens, written with the same safetensors call.

All sides run the whole per-shard job on the same tokenized shard: load the rows and the target,
forward every row (one at a time, no padding), write ``hidden_states`` [T, k, H] and
``target_argmax`` [T] (int32) with the rows' ``input_ids`` and ``offsets``. Ours is
``dflash.hidden.stage.capture_shard`` (forward hooks on the selected layers only, the greedy tokens from
the last layer's normed output through the lm_head a chunk of rows at a time, never the whole
logits; as the ``hidden`` rule calls it). A third side, measured in the same rounds, is the
features-only floor: the decoder stack alone (``model.get_decoder()``, no lm_head) with
``output_hidden_states=True``, writing ``hidden_states``, ``input_ids`` and ``offsets`` only (the
format before ``dflash-hidden-v2``): ours / that floor is what the greedy tokens cost. Same
target, rows, layers (the demo config's ``drafter.target_layer_ids``), compute dtype (float32, as
``load_target`` loads it) and cache dtype (``--dtype``, default the demo's bfloat16), same torch
threads, pinned to the same cores; the caches are checked equal (``hidden_states`` of all three,
``target_argmax`` of ours and the full floor, counting the tokens that differ, if any). One
warm-up round is not counted; ``--rounds`` rounds alternate the order (reversed every other
round, so each floor runs before ours in every other round); figures are medians, the ratios the
medians of the per-round ratios. The load average is printed before and after.

The target is the demo target built offline as ``tests/conftest.py`` builds it (untaught:
weights do not change the work), ``qwen3_5_text`` (3 linear-attention layers, then 1 full
attention) or ``--architecture qwen3``. The rows are seeded random ids with lengths drawn like
real rows (log-normal, median about 1,500 tokens, at most ``tokenize.max_length``).

The projection to ``--project-tokens`` (default 1.64e9, the story's output tokens) is linear: time =
tokens / measured tokens/s (this tiny target, these cores: it says nothing of a 27B target on a
GPU, where the forward is everything), bytes = tokens x (layers x hidden x bytes per value + 4 B
of greedy token) (``dflash.hidden.stage.cache_bytes``), for the tiny target and, from its config's
shapes, for ``config/qwen3.6-27b.yaml``'s target.

Usage: python bench/hidden_capture.py [--rows 80] [--rounds 5] [--threads 1] [--architecture qwen3_5_text]
       [--dtype bfloat16] [--project-tokens 1.64e9]
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash.core.config import load_config
from dflash.hidden.stage import DTYPES, capture_shard
from dflash.core.shapes import layer_selection, resolve_layer_ids
from dflash.core.shapes import GREEDY_BYTES, HIDDEN_FORMAT, cache_bytes
from dflash.core.units import human_bytes

ROOT = Path(__file__).resolve().parents[1]
# Qwen3.6-27B's text config (README: 64 layers, hidden 5120); the real model is not on this machine.
REAL_TARGET = {"name": "Qwen3.6-27B", "num_hidden_layers": 64, "hidden_size": 5120}


def build_demo_target(workdir: Path, architecture: str) -> Path:
    from dflash.target.stage import build_target

    cfg = load_config(ROOT / "config.yaml")
    build = copy.deepcopy(cfg["target"]["build"])
    build["architecture"] = architecture
    build["teach"]["steps"] = 1  # the shapes are what the bench needs, not what the target learnt
    sources = [ROOT / s["path"] for s in cfg["prompts"]["sources"]]
    out = workdir / "target"
    build_target(sources, out, build)
    return out


def write_rows(path: Path, rows: int, vocab: int, max_length: int) -> int:
    """A tokenized shard of seeded random rows (the format ``tokenize_shard`` writes)."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(1500), 0.6, rows).astype(np.int64) + 2, max_length)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(0, vocab, int(offsets[-1]), dtype=np.int32)
    save_file({"input_ids": torch.from_numpy(ids), "loss_mask": torch.ones(len(ids), dtype=torch.uint8),
               "offsets": torch.from_numpy(offsets)}, str(path), metadata={"format": "dflash-tokenized-v1"})
    return len(ids)


def _metadata(target_dir: Path, layer_ids: list[int], hidden_size: int, dtype: str) -> dict:
    return {"format": HIDDEN_FORMAT, "target_layer_ids": json.dumps(list(layer_ids)),
            "hidden_size": str(hidden_size), "dtype": dtype, "model": Path(target_dir).name}


@torch.no_grad()
def transformers_capture(tokenized: Path, out_path: Path, target_dir: Path, layer_ids: list[int], dtype: str) -> None:
    """The same cache from transformers alone: the causal LM's full forward with
    ``output_hidden_states=True``, the logits of every position ``.argmax(-1)`` as the greedy tokens."""
    from transformers import AutoModelForCausalLM

    rows = load_file(str(tokenized))
    input_ids, offsets = rows["input_ids"], rows["offsets"]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = torch.empty((len(input_ids), len(layer_ids), model.config.hidden_size), dtype=DTYPES[dtype])
    greedy = torch.empty(len(input_ids), dtype=torch.int32)
    for r in range(len(offsets) - 1):
        a, b = offsets[r].item(), offsets[r + 1].item()
        result = model(input_ids=input_ids[a:b].long().unsqueeze(0), use_cache=False, output_hidden_states=True)
        out[a:b] = torch.stack([result.hidden_states[i + 1][0] for i in layer_ids], dim=1).to(out.dtype)
        greedy[a:b] = result.logits[0].argmax(-1)
    save_file({"hidden_states": out, "target_argmax": greedy, "input_ids": input_ids, "offsets": offsets},
              str(out_path), metadata=_metadata(target_dir, layer_ids, model.config.hidden_size, dtype))


@torch.no_grad()
def features_only_capture(tokenized: Path, out_path: Path, target_dir: Path, layer_ids: list[int],
                          dtype: str) -> None:
    """The features alone (the cache before the greedy tokens): the decoder stack, no lm_head,
    with transformers' own ``output_hidden_states``."""
    from transformers import AutoModelForCausalLM

    rows = load_file(str(tokenized))
    input_ids, offsets = rows["input_ids"], rows["offsets"]
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    out = torch.empty((len(input_ids), len(layer_ids), model.config.hidden_size), dtype=DTYPES[dtype])
    for r in range(len(offsets) - 1):
        a, b = offsets[r].item(), offsets[r + 1].item()
        states = decoder(input_ids=input_ids[a:b].long().unsqueeze(0), use_cache=False,
                         output_hidden_states=True).hidden_states
        out[a:b] = torch.stack([states[i + 1][0] for i in layer_ids], dim=1).to(out.dtype)
    save_file({"hidden_states": out, "input_ids": input_ids, "offsets": offsets}, str(out_path),
              metadata=_metadata(target_dir, layer_ids, model.config.hidden_size, dtype))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads and cores for each (default 1)")
    ap.add_argument("--architecture", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3"])
    ap.add_argument("--dtype", default=load_config(ROOT / "config.yaml")["hidden"]["dtype"],
                    choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--project-tokens", type=float, default=1.64e9)
    a = ap.parse_args()
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:a.threads])
    torch.set_num_threads(a.threads)
    logging.disable(logging.INFO)
    started = time.perf_counter()
    print(f"python {platform.python_version()}, " + ", ".join(
        f"{p} {importlib.metadata.version(p)}" for p in ("torch", "transformers", "safetensors")))
    print(f"load average (1, 5, 15 min) at the start: {load_average()}; cores pinned: "
          f"{sorted(os.sched_getaffinity(0))} of {os.cpu_count()}")
    cfg = load_config(ROOT / "config.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = build_demo_target(tmp, a.architecture)
        text = json.loads((target / "config.json").read_text())
        layers = layer_selection(cfg["drafter"])
        layer_ids = resolve_layer_ids(layers, text["num_hidden_layers"])
        tokenized = tmp / "shard.safetensors"
        tokens = write_rows(tokenized, a.rows, text["vocab_size"], cfg["tokenize"]["max_length"])
        print(f"target: demo {a.architecture}, {text['num_hidden_layers']} layers, hidden {text['hidden_size']}, "
              f"vocab {text['vocab_size']}, layers {layer_ids}, compute float32, cache {a.dtype} + int32 greedy "
              f"tokens; {a.rows} rows, {tokens:,} tokens; threads per method: {a.threads}")
        outs = {"ours": tmp / "ours.safetensors", "transformers": tmp / "hf.safetensors",
                "features-only": tmp / "hf-features.safetensors"}
        methods = {
            "ours": lambda: capture_shard(tokenized, outs["ours"], target, layers, a.dtype),
            "transformers": lambda: transformers_capture(tokenized, outs["transformers"], target, layer_ids, a.dtype),
            "features-only": lambda: features_only_capture(tokenized, outs["features-only"], target, layer_ids,
                                                           a.dtype),
        }
        for run in methods.values():  # warm-up, not counted
            run()
        caches = {k: load_file(str(v)) for k, v in outs.items()}
        for k in ("transformers", "features-only"):
            same = {name: torch.equal(caches["ours"][name], caches[k][name])
                    for name in ("hidden_states", "input_ids", "offsets", "target_argmax") if name in caches[k]}
            line = ", ".join(f"{name} {'equal' if v else 'DIFFER'}" for name, v in same.items())
            if "target_argmax" in caches[k]:
                differ = int((caches["ours"]["target_argmax"] != caches[k]["target_argmax"]).sum())
                line += f" ({differ:,} of {tokens:,} greedy tokens differ)"
            print(f"caches ours vs {k}: {line}")
        del caches
        cache = cache_bytes(tokens, len(layer_ids), text["hidden_size"], a.dtype)
        features_cache = cache - GREEDY_BYTES * tokens
        seconds: dict[str, list[float]] = {k: [] for k in methods}
        for r in range(a.rounds):
            for k in (list(methods) if r % 2 == 0 else list(reversed(methods))):
                t = time.perf_counter()
                methods[k]()
                seconds[k].append(time.perf_counter() - t)
            print(f"round {r + 1}: " + ", ".join(f"{k} {tokens / seconds[k][-1]:,.0f}" for k in methods) + " tokens/s",
                  flush=True)
        for k in methods:
            s = statistics.median(seconds[k])
            size = features_cache if k == "features-only" else cache
            print(f"{k:13s} {tokens / s:10,.0f} tokens/s  {human_bytes(size / s)}/s  "
                  f"({tokens:,} tokens, {human_bytes(size)} cache, {s:.2f} s a shard)")
        for k, what in (("transformers", "the full floor: features + greedy tokens"),
                        ("features-only", "features only: what the greedy tokens cost")):
            ratios = [t / o for o, t in zip(seconds["ours"], seconds[k])]
            print(f"ratio ours / {k} (tokens/s; {what}): {statistics.median(ratios):.2f} "
                  f"(median of {len(ratios)} rounds, range {min(ratios):.2f}-{max(ratios):.2f})")
        n = a.project_tokens
        for k in methods:
            hours = n / (tokens / statistics.median(seconds[k])) / 3600
            print(f"projection {n:.3g} tokens, {k}: {hours:,.1f} h on {a.threads} core(s) with this target")
        real = load_config(ROOT / "config" / "qwen3.6-27b.yaml")["drafter"]
        real_ids = resolve_layer_ids(layer_selection(real), REAL_TARGET["num_hidden_layers"])
        greedy_bytes = GREEDY_BYTES * int(n)
        for name, k, hidden in (("this target", len(layer_ids), text["hidden_size"]),
                                (REAL_TARGET["name"], len(real_ids), REAL_TARGET["hidden_size"])):
            total = cache_bytes(int(n), k, hidden, a.dtype)
            print(f"projection {n:.3g} tokens, cache with {name} ({k} layers x {hidden}, {a.dtype}, + "
                  f"{GREEDY_BYTES} B greedy token): {human_bytes(total)}, of which greedy tokens "
                  f"{human_bytes(greedy_bytes)} ({100 * greedy_bytes / total:.3f}%)")
    print(f"load average (1, 5, 15 min) at the end: {load_average()}; the run took "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
