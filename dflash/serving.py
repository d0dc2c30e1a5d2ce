"""Serving the trained drafter: the engines' commands for a checkpoint, and what would stop it there.

vLLM and SGLang both read our checkpoint as it is (``config.json`` with ``architectures:
["DFlashDraftModel"]``, ``dflash_config.{mask_token_id, target_layer_ids}``, ``block_size``,
``num_target_layers``, ``layer_types``; ``model.safetensors`` with the draft weights only: both
share the target's embedding and lm_head). What each must be told:

- vLLM: ``--speculative-config {"method": "dflash", "model": <checkpoint>,
  "num_speculative_tokens": block_size - 1}``. It does not read ``block_size``, and nothing checks
  the number: a larger one drafts positions the drafter never trained on. Without ``method`` it
  guesses from the path's name.
- SGLang: ``--speculative-algorithm DFLASH --speculative-draft-model-path <checkpoint>
  --speculative-num-draft-tokens block_size`` (the block itself, anchor included); hybrid
  (Qwen3.5/3.6) targets also need ``--mamba-scheduler-strategy extra_buffer``. GPU or NPU only.

Checks (:func:`serving_problems`): vLLM runs a draft layer causally when the config carries
``is_causal`` or ``dflash_config.causal`` (for every layer), so a checkpoint with either drafts
with the wrong mask; vLLM's CPU runner (no Triton) refuses drafters that mix sliding and full
layers. And a drafter learns the thinking mode of its data: served with the other one, it drafts
for text the target does not write (z-lab/dflash #60: 9.49 against 2.7 to 3.9).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path


def drafter_config(checkpoint: Path) -> dict:
    path = Path(checkpoint) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file: give a drafter checkpoint folder "
                                f"(results/checkpoints/<run>)") from None
    if "DFlashDraftModel" not in (config.get("architectures") or []) or "dflash_config" not in config:
        raise ValueError(f"{path}: not a DFlash drafter config (architectures {config.get('architectures')})")
    return config


def hybrid_target(target: Path) -> bool:
    """Whether the target mixes linear-attention layers in (Qwen3.5/3.6, Qwen3-Next): SGLang
    needs its extra_buffer scheduler for them. False when its config is not at hand."""
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or []) or text.get("model_type", "").startswith(
        ("qwen3_5", "qwen3_next"))


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


def serve_commands(checkpoint: Path, target: str, thinking: bool = True) -> dict:
    """The commands that serve ``target`` (a folder, or a model name the engines resolve) with the
    drafter in ``checkpoint``: ``vllm``, ``vllm_cpu`` (None for a hybrid target), ``sglang``
    (shell lines), and ``notes`` (lines to read before serving)."""
    checkpoint = Path(checkpoint).resolve()
    target = str(Path(target).resolve()) if Path(target).is_dir() else str(target)
    config = drafter_config(checkpoint)
    block = int(config["block_size"])
    spec = json.dumps({"method": "dflash", "model": str(checkpoint), "num_speculative_tokens": block - 1})
    vllm = ["vllm", "serve", str(target), "--speculative-config", spec]
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--speculative-algorithm",
              "DFLASH", "--speculative-draft-model-path", str(checkpoint), "--speculative-num-draft-tokens", str(block)]
    hybrid = hybrid_target(Path(target))
    if hybrid:
        sglang += ["--mamba-scheduler-strategy", "extra_buffer"]
    notes = [
        f"block size {block}: vLLM drafts num_speculative_tokens = {block - 1} tokens after each anchor; SGLang's "
        f"--speculative-num-draft-tokens is the block itself ({block})",
        ("trained on thinking-mode completions: serve with thinking on (Qwen3.6's default); requests with "
         "chat_template_kwargs {\"enable_thinking\": false} see much lower acceptance" if thinking else
         "trained on completions with thinking off: requests with thinking on see much lower acceptance"),
        "serve the target with the chat template and tokenizer the data was made with (the pipeline's target folder)",
    ]
    if hybrid:
        notes.append("hybrid (linear-attention) target: vLLM's CPU build cannot load it; serve it on a GPU")
    notes += serving_problems(config)
    cpu = [*vllm, "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching"]
    return {"vllm": shlex.join(vllm), "vllm_cpu": None if hybrid else shlex.join(cpu), "sglang": shlex.join(sglang),
            "notes": notes}
