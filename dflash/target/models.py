"""A target model folder, loaded for a stage, and whether it will run at speed on this device.

Every stage that runs the target (generate's CPU backend, hidden, online training, eval) loads it
here; a hybrid target (Qwen3.5/3.6: GatedDeltaNet linear attention) on CUDA needs kernels that
transformers only imports when installed, or it silently runs a reference path many times slower.
"""
from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch

from dflash.core.io import REWRITE


def pick_device(name: str) -> torch.device:
    """A config's ``device``: "auto" is CUDA when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def target_model(path: str | Path, dtype=torch.float32):
    """The model of a model folder, in eval mode; weights cut short or damaged are one line naming
    the folder (safetensors' own error names no file)."""
    from safetensors import SafetensorError  # heavy: the jobs that load a target only
    from transformers import AutoModelForCausalLM  # heavy: the jobs that load a target only

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    except SafetensorError as e:
        raise ValueError(f"{path}: a weights file of the model is cut short or damaged ({e}): {REWRITE}") from None


def load_target(path: str | Path, dtype=torch.float32):
    """(model, tokenizer) from a model folder, in eval mode."""
    from transformers import AutoTokenizer  # heavy: the jobs that load a target only

    return target_model(path, dtype), AutoTokenizer.from_pretrained(path)


# What transformers' GatedDeltaNet imports for its fast path (import name: distribution).
FAST_KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
FAST_KERNEL_POLICIES = ("require", "warn")


def kernel_choices(config) -> dict[str, bool]:
    """{import name: whether transformers uses its kernel} as the modeling file of ``config``'s
    model type decided when it was imported; {} for a model type without such fallbacks.

    transformers (5.19 to 5.23) wraps each kernel function in ``use_kernel_func_from_hub_with_fallback``,
    which tries the import once and keeps the answer in the wrapper's closure; reading it there
    agrees with what the model will run, even where the package is installed but fails to import.
    """
    from transformers.models.auto.configuration_auto import model_type_to_module_name  # heavy: loading a target only

    name = model_type_to_module_name(config.model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:  # a model type of remote code or of another library: nothing to read
        return {}
    chosen: dict[str, bool] = {}
    for fn in vars(module).values():
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or not cells or not {"package", "is_new_implementation"} <= set(code.co_freevars):
            continue
        closure = {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}
        package = closure["package"]
        chosen[package] = chosen.get(package, True) and bool(closure["is_new_implementation"])
    return chosen


def fast_kernels_problem(model_or_config, device: torch.device | str) -> str | None:
    """One line when a hybrid target (linear-attention layers) on CUDA would run transformers'
    reference PyTorch path for want of its kernels; None on CPU, for a full-attention target, or
    when transformers found every kernel."""
    if torch.device(device).type != "cuda":
        return None
    config = getattr(model_or_config, "config", model_or_config)
    if "linear_attention" not in (getattr(config.get_text_config(), "layer_types", None) or []):
        return None
    missing = [p for p, found in kernel_choices(config).items() if not found]
    if not missing:
        return None
    ordered = [p for p in FAST_KERNELS if p in missing] + [p for p in missing if p not in FAST_KERNELS]
    names = " and ".join(f"{FAST_KERNELS.get(p, p)} ({p})" for p in ordered)
    return (f"hybrid target ({config.model_type}) on CUDA without its fast kernels: transformers could not import "
            f"{names}, so its linear-attention layers would run the slow reference PyTorch path; install the gpu "
            f"extra: pip install -e '.[gpu]', or use envs/gpu.yaml; or set target.fast_kernels: warn to run anyway "
            f"on the slow path")


def check_fast_kernels(model_or_config, device: torch.device | str, policy: str,
                       log: logging.Logger | None = None) -> None:
    """``target.fast_kernels``: "require" raises ValueError with :func:`fast_kernels_problem`'s line,
    "warn" logs it."""
    if policy not in FAST_KERNEL_POLICIES:
        raise ValueError(f"target.fast_kernels must be one of {', '.join(FAST_KERNEL_POLICIES)}, not {policy!r}")
    problem = fast_kernels_problem(model_or_config, device)
    if problem is None:
        return
    if policy == "require":
        raise ValueError(problem)
    (log or logging.getLogger(__name__)).warning(problem)
