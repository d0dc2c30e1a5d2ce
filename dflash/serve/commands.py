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

Checks (:func:`dflash.core.shapes.serving_problems`): vLLM runs a draft layer causally when the config carries
``is_causal`` or ``dflash_config.causal`` (for every layer), so a checkpoint with either drafts
with the wrong mask; vLLM's CPU runner (no Triton) refuses drafters that mix sliding and full
layers. And a drafter learns the thinking mode of its data: served with the other one, it drafts
for text the target does not write (z-lab/dflash #60: 9.49 against 2.7 to 3.9).
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from dflash.core.shapes import serving_problems
from dflash.core.workflow import target_dir


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


# (the drafter config's key, the target text config's, what it is): a drafter reads its target's layers at
# its width, and drafts tokens of its vocabulary
FIT = (("num_target_layers", "num_hidden_layers", "layers"), ("hidden_size", "hidden_size", "hidden size"),
       ("vocab_size", "vocab_size", "vocabulary"))


def drafter_fit_problems(config: dict, text: dict) -> list[str]:
    """Why the drafter of ``config`` (its config.json) cannot draft for a target whose text config
    is ``text``: it reads that many of the target's layers, of its width, and drafts tokens of its
    vocabulary with its mask token; empty when it fits (or ``text`` does not say)."""
    problems = []
    for mine, theirs, what in FIT:
        if config.get(mine) is not None and text.get(theirs) is not None and config[mine] != text[theirs]:
            problems.append(f"{what} {config[mine]:,} (the target has {text[theirs]:,})")
    layers, vocab, dflash = text.get("num_hidden_layers"), text.get("vocab_size"), config["dflash_config"]
    if layers and (beyond := [i for i in dflash.get("target_layer_ids") or [] if i >= layers]):
        problems.append(f"target layers {beyond} (the target's are 0 to {layers - 1})")
    if vocab and (mask := dflash.get("mask_token_id")) is not None and mask >= vocab:
        problems.append(f"mask token {mask} (outside the target's vocabulary)")
    return problems


# The run's server flags that serving needs too, as each engine spells them (SGLang's launch command,
# vLLM's): the parsers give the same responses the data was made from; parallelism and context length fit
# the model on the node as generation did.
FLAGS = {"reasoning_parser": (("--reasoning-parser",), ("--reasoning-parser",)),
         "tool_call_parser": (("--tool-call-parser",), ("--tool-call-parser",)),
         "tp": (("--tp", "--tp-size", "--tensor-parallel-size"), ("--tensor-parallel-size", "-tp")),
         "dp": (("--dp", "--dp-size", "--data-parallel-size"), ("--data-parallel-size", "-dp")),
         "context_length": (("--context-length",), ("--max-model-len",))}
# the Hermes-JSON tool-call parser (Qwen2.5, Qwen3) by the other engine's name
TOOL_PARSER_NAMES = {"vllm": {"qwen25": "hermes", "qwen": "hermes"}, "sglang": {"hermes": "qwen25"}}
# The engine versions these commands were checked with: vLLM's CPU build serves a drafter the pipeline
# trained (tests/test_serve_vllm.py); SGLang's DFlash speculative path needs a GPU, so only its
# parsers (the responses generation reads) run here. The Makefile pins the same (tests/test_serving.py).
TESTED_WITH = {"vllm": "0.32.0", "sglang": "0.5.23"}


def run_flags(command: str | None) -> dict:
    """The flags of ``FLAGS`` that a run's server command (generate.server.launch.command, SGLang's
    or vLLM's) sets, by name."""
    words, found = shlex.split(command or ""), {}
    for name, (sglang, vllm) in FLAGS.items():
        for i, word in enumerate(words):
            flag, _, value = word.partition("=")
            if flag in sglang + vllm and (value or i + 1 < len(words)):
                found[name] = value or words[i + 1]
    return found


def engine_flags(flags: dict) -> tuple[list[str], list[str]]:
    """``run_flags`` as vLLM's and as SGLang's command-line flags."""
    vllm, sglang = [], []
    for name, value in flags.items():
        if name == "tool_call_parser":
            vllm += ["--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER_NAMES["vllm"].get(value, value)]
            sglang += ["--tool-call-parser", TOOL_PARSER_NAMES["sglang"].get(value, value)]
            continue
        vllm += [FLAGS[name][1][0], value]
        sglang += [FLAGS[name][0][0], value]
    return vllm, sglang


def serve_commands(checkpoint: Path, target: str, thinking: bool = True, launch_command: str | None = None) -> dict:
    """The commands that serve ``target`` (a folder, or a model name the engines resolve) with the
    drafter in ``checkpoint``, with the flags of the run's server (``launch_command``): ``vllm``,
    ``vllm_cpu`` (None for a hybrid target), ``sglang`` (shell lines), and ``notes`` (lines to
    read before serving). A drafter trained for another target stops it (``drafter_fit_problems``)."""
    checkpoint = Path(checkpoint).resolve()
    target = str(Path(target).resolve()) if Path(target).is_dir() else str(target)
    config = drafter_config(checkpoint)
    text = {}
    if (Path(target) / "config.json").is_file():
        text = json.loads((Path(target) / "config.json").read_text())
        text = text.get("text_config") or text
        if misfit := drafter_fit_problems(config, text):
            raise ValueError(f"{checkpoint}: a drafter trained for another target than {target}: "
                             f"{', '.join(misfit)}: give --target the model it was trained with, or the checkpoint "
                             f"trained for this one")
    block = int(config["block_size"])
    spec = json.dumps({"method": "dflash", "model": str(checkpoint), "num_speculative_tokens": block - 1})
    flags = run_flags(launch_command)
    vllm_flags, sglang_flags = engine_flags(flags)
    vllm = ["vllm", "serve", str(target), "--speculative-config", spec]
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--speculative-algorithm",
              "DFLASH", "--speculative-draft-model-path", str(checkpoint), "--speculative-num-draft-tokens", str(block)]
    hybrid = hybrid_target(Path(target))
    if hybrid:
        sglang += ["--mamba-scheduler-strategy", "extra_buffer"]
    notes = [
        f"tested with vLLM {TESTED_WITH['vllm']} (its CPU build serves a drafter of this pipeline) and SGLang "
        f"{TESTED_WITH['sglang']} (its parsers; its DFlash path needs a GPU and was not run here)",
        ("the commands carry the run's server flags (generate.server.launch.command): "
         + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in flags.items())) if flags else
        "the run started no server (generate.server.launch is null), so its flags are unknown here: add the "
        "reasoning and tool-call parsers, parallelism and context length of the server the data came from",
    ]
    if not text:
        notes.append(f"{target}: no config.json on this machine: the drafter's fit to the target (layers, hidden "
                     f"size, vocabulary, mask token) is unchecked")
    notes += [
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
    return {"vllm": shlex.join([*vllm, *vllm_flags]), "vllm_cpu": None if hybrid else shlex.join(cpu),
            "sglang": shlex.join([*sglang, *sglang_flags]), "notes": notes}


def run_serve_commands(config: dict, checkpoint: Path, target: str | None = None) -> dict:
    """``serve_commands`` for a run of ``config``: its target (unless ``target``), thinking mode and
    server flags."""
    launch = config["generate"]["server"]["launch"] or {}
    return serve_commands(checkpoint, target or target_dir(config), config["generate"]["enable_thinking"],
                          launch.get("command"))


def serve_command_command(config: dict, checkpoint: Path, target: str | None = None) -> None:
    """``dflash serve-command``: each engine's command line, then what would stop it, as notes."""
    commands = run_serve_commands(config, checkpoint, target)
    print(f"# vLLM\n{commands['vllm']}")
    if commands["vllm_cpu"]:
        print(f"# vLLM's CPU build\n{commands['vllm_cpu']}")
    print(f"# SGLang (GPU)\n{commands['sglang']}")
    for note in commands["notes"]:
        print(f"# note: {note}")
