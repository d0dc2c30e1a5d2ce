"""Greedy speculative decoding with the target and a drafter: acceptance length per category.

Both models keep a cache, as the reference's ``dflash_generate`` does: the target its keys and
values (and, in its linear-attention layers, its recurrent and convolution states), the drafter
the keys and values of its context, so each step costs one block, not the whole prefix. Every step
is one target forward over the block ``[anchor, drafted tokens]``, which yields the greedy tokens
that verify the block and the layer features the drafter needs for the next block. Acceptance
follows the reference: the longest drafted prefix that matches the target's greedy tokens, plus
the target's next token, so the output is exactly plain greedy decoding.

Unlike the reference, a rejected draft is taken back out of the target's linear-attention layers
too: their recurrent state has absorbed every token fed and cannot be cropped like keys and
values, so it is saved before each verify forward and, on a rejection, advanced from there over
the accepted positions alone (:class:`CachedTarget`). The reference (``dflash`` 0.1.0) crops only
keys, values and convolution states, so on a hybrid target it goes on from a state that has seen
the rejected tokens, and its later tokens are not the target's greedy ones.

The figures and the settings: :mod:`dflash.eval.acceptance`.

With ``engine: vllm`` the job measures what the serving engine sees: it starts a vLLM server with
the trained drafter (``--speculative-config``, ``num_speculative_tokens`` = block size - 1), then one
with the untrained drafter, sends every held-out prompt as the same token ids, greedy, and reads
each request's own verify steps from vLLM's per-request spec-decode metrics. The target is not
loaded here (on a GPU the server needs its memory). Tokens per target forward are then counted
as tokens / (1 + verify steps): with a drafter vLLM drafts at every decode step. vLLM's CPU build
serves full-attention targets only: hybrid ones need a GPU.
"""
from __future__ import annotations

import json
import logging
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoTokenizer, DynamicCache, GenerationConfig, PreTrainedModel, Qwen3Config

from dflash.core.chat import render, stop_token_ids
from dflash.core.config import render_command
from dflash.core.curves import log_eval
from dflash.core.io import read_json, write_json
from dflash.core.records import checked_records
from dflash.core.workflow import progress
from dflash.eval.acceptance import (DECODINGS, decodings, eval_result, merge_parts, per_step, settings, summaries,
                                    write_eval)
from dflash.generate.server import ServerProcess, free_port
from dflash.hidden.stage import capture_layers, decoder_layers, forward_features
from dflash.target.models import check_fast_kernels, pick_device, target_model
from dflash.train.drafter import DFlashDraftModel, TargetIO, load_drafter, write_drafter_state
from dflash.train.stage import planned_drafter_config


def untrained_drafter(drafter: Path | Qwen3Config, seed: int = 0) -> tuple[DFlashDraftModel, Qwen3Config]:
    """A randomly initialised drafter with the config of the checkpoint folder ``drafter`` (or
    that config itself, as :func:`dflash.train.stage.drafter_config` makes it before training): the
    baseline that shows what training adds."""
    config = drafter if isinstance(drafter, Qwen3Config) else Qwen3Config.from_pretrained(drafter)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return DFlashDraftModel(config), config


class CachedTarget:
    """The target behind a cache that can be rolled back to the tokens a verify forward accepted
    (see the module docstring). Use as a context manager around the forwards.

    A linear-attention layer's recurrent state after the accepted tokens is recomputed from the
    state saved before the verify forward and the gated-delta-rule inputs (queries, keys, values,
    gates) of the accepted positions, caught on their way into the layer's chunked kernel: the
    token-by-token form of the same rule over those few positions, nothing else of the layer run
    again. Its convolution state needs no recomputing: the cache keeps the raw inputs, and
    cropping cuts them back to the accepted tokens.
    """

    CHUNKED, RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"

    def __init__(self, target: PreTrainedModel, layer_ids: list[int] | None):
        self.target, self.layer_ids = target, layer_ids
        self.cache = DynamicCache(config=target.config)
        # Keeps the convolution inputs of every token fed until the next crop, so they can be cut back.
        self.cache.activate_past_recording()
        self.linear = [i for i, layer in enumerate(self.cache.layers) if hasattr(layer, "recurrent_states")]
        self.modeling = None
        if self.linear:
            # The module that defines the linear-attention layers holds the rule they call.
            modules = {sys.modules[type(m).__module__] for layer in decoder_layers(target)
                       for m in layer.children() if type(m).__name__.endswith("GatedDeltaNet")}
            if len(modules) != 1 or not all(hasattr(m, n) for m in modules for n in (self.CHUNKED, self.RECURRENT)):
                raise ValueError(f"{type(target).__name__}: layers {self.linear} keep a recurrent state, and no "
                                 f"gated delta rule ({self.CHUNKED}) was found to roll it back with")
            self.modeling = modules.pop()
        self.rule_inputs: list[tuple] = []
        self.saved: list[torch.Tensor] = []
        self.exits = ExitStack()
        self.captured: dict | None = None

    def __enter__(self) -> CachedTarget:
        if self.layer_ids is not None:
            # Hooked once for the whole decode, not once per forward.
            self.captured = self.exits.enter_context(capture_layers(self.target, self.layer_ids))
        if self.modeling is not None:
            # The layers call the rule by its module-level name: wrapping it there is the one way
            # to see its inputs without running the layer again. Undone on exit.
            chunked = getattr(self.modeling, self.CHUNKED)

            def catch(query, key, value, *args, **kwargs):
                self.rule_inputs.append((query, key, value, kwargs["g"], kwargs["beta"],
                                         kwargs.get("use_qk_l2norm_in_kernel", False)))
                return chunked(query, key, value, *args, **kwargs)
            setattr(self.modeling, self.CHUNKED, catch)
            self.exits.callback(setattr, self.modeling, self.CHUNKED, chunked)
        return self

    def __exit__(self, *exc) -> None:
        self.exits.close()

    def forward(self, ids: list[int], keep: int) -> tuple[list[int], torch.Tensor | None]:
        """Feed ``ids`` after the cached tokens: the greedy next token at each of the last ``keep``
        positions, and the drafter's context features [1, len(ids), k, H] (None without layer ids).
        A single token is always kept, so only longer feeds save the recurrent states."""
        self.rule_inputs.clear()
        if len(ids) > 1:
            # None before the prefill; the cache updates the tensor in place.
            self.saved = [s if s is None else s.clone() for s in
                          (self.cache.layers[i].recurrent_states[0] for i in self.linear)]
        input_ids = torch.tensor([ids], device=self.target.device)
        kwargs = {"past_key_values": self.cache, "use_cache": True, "logits_to_keep": keep}
        if self.layer_ids is None:
            logits, features = self.target(input_ids=input_ids, **kwargs).logits, None
        else:
            logits, features = forward_features(self.target, input_ids, self.layer_ids, captured=self.captured,
                                                **kwargs)
        return logits[0, -keep:].argmax(-1).tolist(), features

    def keep(self, fed: int, kept: int) -> None:
        """After feeding ``fed`` tokens, keep the first ``kept`` of them in the cache."""
        if kept < fed and self.linear:
            if len(self.rule_inputs) != len(self.linear):
                raise RuntimeError(f"{len(self.rule_inputs)} gated delta rule calls seen for {len(self.linear)} "
                                   "linear-attention layers")
            # Every layer's rule in one call, the layers side by side in the batch dimension.
            q, k, v, g, beta = (torch.cat([inputs[j][:, :kept] for inputs in self.rule_inputs]) for j in range(5))
            _, states = getattr(self.modeling, self.RECURRENT)(
                q, k, v, g=g, beta=beta, initial_state=torch.cat(self.saved), output_final_state=True,
                use_qk_l2norm_in_kernel=self.rule_inputs[0][5])
            for i, state in zip(self.linear, states.split(1)):
                self.cache.layers[i].recurrent_states[0].copy_(state)
        # Cuts the rejected keys, values and convolution inputs; trims the convolution inputs to the kernel.
        self.cache.crop(kept - fed)


def append_context(drafter: DFlashDraftModel, context_kv: list | None, features: torch.Tensor,
                   start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The drafter's cached context keys and values with those of ``features`` [1, n, k, H]
    (positions ``start`` ..) appended."""
    positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
    new = drafter.context_keys_values(features, positions)
    if context_kv is None:
        return new
    return [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(context_kv, new)]


def propose(drafter: DFlashDraftModel, io: TargetIO, context_kv: list, context_len: int, last_token: int,
            num_draft: int) -> list[int]:
    """Draft ``num_draft`` tokens after ``last_token``, which sits right after the ``context_len``
    context positions whose keys and values ``context_kv`` holds."""
    device = io.embed_weight.device
    block = torch.tensor([[last_token] + [drafter.mask_token_id] * num_draft], device=device)
    positions = torch.arange(context_len, context_len + num_draft + 1, device=device)[None]
    hidden = drafter.forward_cached(io.embed(block), positions, context_kv,
                                    torch.arange(context_len, device=device)[None])
    return io.logits(hidden[0, 1:]).argmax(-1).tolist()


class Decoded(NamedTuple):
    tokens: list[int]  # the new tokens: exactly plain greedy decoding's
    forwards: int  # target forwards, the prefill included
    steps: list[tuple[int, int]]  # (drafted, accepted) per verify step that drafted, in order


@torch.inference_mode()
def speculative_generate(target: PreTrainedModel, drafter: DFlashDraftModel | None, io: TargetIO,
                         prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                         block_size: int | None = None) -> Decoded:
    """Greedy decoding, verified block by block. Without a drafter every forward yields one token:
    plain greedy decoding."""
    block_size = 1 if drafter is None else (block_size or drafter.block_size)
    with CachedTarget(target, None if drafter is None else drafter.target_layer_ids) as cached:
        new, features = cached.forward(prompt_ids, 1)
        cached.keep(len(prompt_ids), len(prompt_ids))
        forwards, context_kv, steps = 1, None, []
        while new[-1] not in stop_ids and len(new) < max_new_tokens:
            last = len(prompt_ids) + len(new) - 1  # position of the newest token, the block's anchor
            if drafter is not None:
                # The features of the tokens accepted since the last block, up to the anchor.
                context_kv = append_context(drafter, context_kv, features, last - features.shape[1])
            # Never draft past max_new_tokens: a fully accepted block yields num_draft + 1 tokens.
            num_draft = min(block_size, max_new_tokens - len(new)) - 1
            draft = propose(drafter, io, context_kv, last, new[-1], num_draft) if num_draft else []
            # The target's token after the anchor and after each drafted token.
            verified, features = cached.forward([new[-1]] + draft, num_draft + 1)
            forwards += 1
            accepted = 0
            while accepted < num_draft and draft[accepted] == verified[accepted]:
                accepted += 1
            if num_draft:
                steps.append((num_draft, accepted))
            for token in verified[:accepted + 1]:
                new.append(token)
                if token in stop_ids:
                    break
            if new[-1] in stop_ids or len(new) >= max_new_tokens:
                break  # no block follows: nothing to roll back
            cached.keep(num_draft + 1, accepted + 1)
            if features is not None:
                features = features[:, :accepted + 1]
    return Decoded(new, forwards, steps)


def load_target(target_dir: Path, cfg: dict) -> PreTrainedModel:
    device = pick_device(cfg["device"])
    # on the config: a large target would take minutes to load before the job stops
    check_fast_kernels(AutoConfig.from_pretrained(target_dir), device, cfg["fast_kernels"],
                       logging.getLogger(__name__))
    return target_model(target_dir, "auto").to(device)


def encode_prompts(prompts: list[dict], tokenizer, thinking: bool = True) -> list[list[int]]:
    """Each held-out prompt rendered as the pipeline renders its training prompts, as token ids;
    ``thinking=False``: with the template's empty think block instead."""
    encoded = []
    for prompt in prompts:
        try:
            text = render(prompt["messages"], prompt.get("tools"), tokenizer, thinking=thinking)
        except ValueError as e:
            raise ValueError(f"held-out prompt {prompt['id']}: {e}") from None
        encoded.append(tokenizer.encode(text, add_special_tokens=False))
    return encoded


def evaluate(target_dir: Path, drafter_dir: Path | None, prompts: list[dict], cfg: dict, tokenizer, *,
             init_only: bool = False, log: logging.Logger | None = None, target: PreTrainedModel | None = None,
             prompt_ids: list[list[int]] | None = None) -> dict:
    """Speculative-decode every prompt; ``drafter_dir=None`` is plain greedy decoding and
    ``init_only=True`` uses an untrained drafter with the config of ``drafter_dir`` (or that
    config, given instead of a folder). ``target``
    (the model of ``target_dir``) and ``prompt_ids`` (:func:`encode_prompts`) let several
    evaluations load and render once.

    Returns ``{"overall": {...}, "per_category": {category: {...}}, "samples": [...]}`` where each
    summary has ``acceptance_length, acceptance_length_per_step, prompts, target_forwards, tokens,
    drafts, accepted_draft_tokens`` and each sample those of its own plus ``id, category,
    output_ids, steps`` (:class:`Decoded`).
    """
    log = log or logging.getLogger(__name__)
    cfg = settings(cfg)
    target = load_target(target_dir, cfg) if target is None else target
    prompt_ids = encode_prompts(prompts, tokenizer) if prompt_ids is None else prompt_ids
    drafter = None
    shown = "of the configured shape" if isinstance(drafter_dir, Qwen3Config) else drafter_dir
    if drafter_dir is not None:
        drafter, config = untrained_drafter(drafter_dir, cfg["seed"]) if init_only else load_drafter(drafter_dir)
        check_drafter(config, target.config, shown, cfg["block_size"])
        drafter = drafter.to(target.device, target.dtype).eval()
    io = TargetIO.from_model(target)
    stop_ids = stop_token_ids(tokenizer, target.generation_config)
    log.info("evaluating %s with drafter %s%s on %d prompts, stop ids %s", target_dir, shown,
             " (untrained)" if init_only else "", len(prompts), sorted(stop_ids))

    # two decodings, trained and untrained, run side by side: the console lines say which
    desc = "greedy decode" if drafter is None else f"spec decode, {'untrained' if init_only else 'trained'} drafter"
    decoded = [speculative_generate(target, drafter, io, ids, cfg["max_new_tokens"], stop_ids, cfg["block_size"])
               for ids in progress(prompt_ids, desc=desc, unit="prompt")]
    result = tally(prompts, decoded)
    log.info("acceptance length %.3f over %d prompts", result["overall"]["acceptance_length"], len(prompts))
    return result


def tally(prompts: list[dict], decoded: list[Decoded]) -> dict:
    """Each prompt's decoding as a sample, and their summaries overall and per category."""
    samples = []
    for prompt, (out, forwards, steps) in zip(prompts, decoded, strict=True):
        accepted = sum(a for _, a in steps)
        samples.append({"id": prompt["id"], "category": prompt["category"],
                        "acceptance_length": len(out) / forwards, "tokens": len(out), "target_forwards": forwards,
                        "acceptance_length_per_step": per_step(len(steps), accepted), "drafts": len(steps),
                        "accepted_draft_tokens": accepted, "output_ids": out, "steps": steps})
    return summaries(samples)


def vllm_decode(url: str, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Decoded:
    """One prompt through a vLLM server, greedy, as token ids; its verify steps from the response's
    per-request spec-decode metrics (``--per-request-spec-decode-metrics detailed``)."""
    body = {"model": "target", "prompt": prompt_ids, "max_tokens": max_new_tokens, "temperature": 0.0,
            "stop_token_ids": sorted(stop_ids), "return_token_ids": True, "skip_special_tokens": False}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    out = answer["choices"][0]["token_ids"]
    spec = (answer.get("metrics") or {}).get("speculative_decoding")
    if spec is None or spec.get("per_step_accepted") is None:
        raise RuntimeError(f"{url}: the answer carries no per-step spec-decode metrics: start vLLM with "
                           "--per-request-spec-decode-metrics detailed (eval.vllm.command)")
    steps = list(zip(spec["per_step_drafted"], spec["per_step_accepted"], strict=True))
    return Decoded(out, 1 + len(steps), steps)


SPEC_DECODE_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                        "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                        "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def spec_decode_counters(url: str) -> dict[str, int]:
    """vLLM's Prometheus spec-decode counters (``/metrics``), summed over their label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        lines = response.read().decode().splitlines()
    totals = dict.fromkeys(SPEC_DECODE_COUNTERS, 0)
    for line in lines:
        for key, name in SPEC_DECODE_COUNTERS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                totals[key] += int(float(line.rsplit(" ", 1)[1]))
    return totals


def evaluate_vllm(target_dir: Path, drafter_dir: Path, prompts: list[dict], prompt_ids: list[list[int]], cfg: dict,
                  stop_ids: set[int], log_dir: Path, label: str, log: logging.Logger | None = None) -> dict:
    """:func:`evaluate`'s result, measured by a vLLM server (``cfg["vllm"]``) serving the target
    with the drafter in ``drafter_dir``; the server's log goes to ``log_dir/vllm-<label>.log``."""
    log = log or logging.getLogger(__name__)
    block_size = cfg["block_size"] or Qwen3Config.from_pretrained(drafter_dir).block_size
    spec = json.dumps({"method": "dflash", "model": str(Path(drafter_dir).resolve()),
                       "num_speculative_tokens": block_size - 1})
    port, engine = free_port(), cfg["vllm"]
    argv = render_command(engine["command"], model=str(target_dir), host="127.0.0.1", port=port,
                          served_model_name="target", speculative_config=spec)
    server = ServerProcess(argv, f"http://127.0.0.1:{port}/health", Path(log_dir) / f"vllm-{label}.log", engine["env"],
                           engine["startup_timeout_s"])
    log.info("starting vLLM with the %s drafter: %s", label, " ".join(argv))
    with server:
        url = f"http://127.0.0.1:{port}"
        with ThreadPoolExecutor(engine["concurrency"]) as pool:
            decoded = list(progress(pool.map(lambda ids: vllm_decode(url, ids, cfg["max_new_tokens"], stop_ids),
                                             prompt_ids), total=len(prompt_ids), desc=f"vLLM, {label} drafter",
                                    unit="prompt"))
        counters = spec_decode_counters(url)
    result = {**tally(prompts, decoded), "server_counters": counters}
    steps = sum(len(d.steps) for d in decoded)
    if counters["drafts"] != steps:  # the server's own tally of what its responses reported
        log.warning("vLLM's /metrics counts %d drafts, its responses %d verify steps", counters["drafts"], steps)
    log.info("vLLM, %s drafter: acceptance length per verify step %.3f over %d prompts", label,
             result["overall"]["acceptance_length_per_step"], len(prompts))
    return result


def check_drafter(config: Qwen3Config, target_config, drafter_dir: Path, block_size: int | None) -> None:
    text = target_config.get_text_config()
    layer_ids, trained_block = config.dflash_config["target_layer_ids"], config.block_size
    problems = []
    if (config.hidden_size, config.vocab_size) != (text.hidden_size, text.vocab_size):
        problems.append(f"hidden/vocab {config.hidden_size}/{config.vocab_size} vs target "
                        f"{text.hidden_size}/{text.vocab_size}")
    if max(layer_ids) >= text.num_hidden_layers:
        problems.append(f"target_layer_ids {layer_ids} vs {text.num_hidden_layers} target layers")
    if block_size is not None and not 1 <= block_size <= trained_block:
        problems.append(f"block_size {block_size} outside 1..{trained_block} (the trained block size)")
    if problems:
        raise ValueError(f"drafter {drafter_dir} does not fit target: " + "; ".join(problems))


def decode_heldout(checkpoint: Path | Qwen3Config, target_dir: Path, heldout: Path, cfg: dict, drafter: str,
                   server_logs: Path | None = None, part: int = 0) -> dict:
    """The held-out prompts decoded with the trained drafter of ``checkpoint`` or, for scale, an
    untrained one with its config (``drafter``: "trained" or "untrained"; an untrained one may be
    given its config instead, so that it decodes while the drafter trains; "thinking_off": the
    trained one on the prompts rendered with thinking off): :func:`evaluate`'s
    result, each sample with its ``output_ids`` and ``steps``. With ``engine: vllm`` the server's
    log goes to ``server_logs``. ``part``: of ``eval.jobs`` jobs sharing the prompts, this one
    decodes every jobs-th prompt from the part-th (:func:`dflash.eval.acceptance.merge_parts` joins them)."""
    if drafter not in DECODINGS:
        raise ValueError(f"drafter must be one of {DECODINGS}, not {drafter!r}")
    cfg = settings(cfg)
    prompts = [rec for _, rec in checked_records(heldout, "prompt", "eval reads the heldout.jsonl.zst of the prompts stage")]
    if not prompts:
        raise ValueError(f"{heldout}: no held-out prompts to evaluate (mark some source records split: heldout)")
    if cfg["jobs"] > len(prompts):
        raise ValueError(f"{heldout}: eval.jobs {cfg['jobs']} is more than its {len(prompts)} held-out prompts: "
                         f"lower eval.jobs")
    prompts = prompts[part::cfg["jobs"]]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = encode_prompts(prompts, tokenizer, thinking=drafter != "thinking_off")
    if cfg["engine"] != "vllm":
        return evaluate(target_dir, checkpoint, prompts, cfg, tokenizer, init_only=drafter == "untrained",
                        prompt_ids=prompt_ids)
    given = isinstance(checkpoint, Qwen3Config)
    config = checkpoint if given else Qwen3Config.from_pretrained(checkpoint)
    check_drafter(config, AutoConfig.from_pretrained(target_dir), "of the configured shape" if given else checkpoint,
                  cfg["block_size"])
    try:
        generation_config = GenerationConfig.from_pretrained(target_dir)
    except OSError:  # a target without generation_config.json: the tokenizer's stop ids alone
        generation_config = None
    stop_ids = stop_token_ids(tokenizer, generation_config)
    logs = Path(server_logs or Path(heldout).parent)
    logs.mkdir(parents=True, exist_ok=True)
    if drafter != "untrained":
        return evaluate_vllm(target_dir, checkpoint, prompts, prompt_ids, cfg, stop_ids, logs, drafter)
    # the untrained baseline is a checkpoint too: the server reads drafters from folders
    with tempfile.TemporaryDirectory(dir=logs, prefix=".untrained-drafter-") as baseline:
        model, config = untrained_drafter(config, cfg["seed"])
        write_drafter_state(model.state_dict(), config, Path(baseline))
        return evaluate_vllm(target_dir, Path(baseline), prompts, prompt_ids, cfg, stop_ids, logs, drafter)


def run_eval(checkpoint: Path, target_dir: Path, heldout: Path, out: Path, cfg: dict,
             server_logs: Path | None = None) -> dict:
    """The eval stage in one process (the pipeline runs each decoding as its own jobs): the trained
    drafter and an untrained one on the held-out prompts, and the trained one with thinking off
    (``eval.thinking_off``); writes the JSON report (token ids left out) and returns it with each
    sample's ``output_ids`` and ``steps``. With ``engine: vllm`` the servers' logs go to
    ``server_logs`` (default: beside ``out``)."""
    logs = server_logs or Path(out).parent
    decoded = {which: decode_heldout(checkpoint, target_dir, heldout, cfg, which, logs)
               for which in decodings(settings(cfg))}
    result = eval_result(decoded["trained"], decoded["untrained"], cfg, decoded.get("thinking_off"))
    write_eval(result, out)
    return result


def eval_settings(config: dict) -> dict:
    """The ``eval`` section with the target's ``fast_kernels`` policy, as every decoding had it."""
    return {**config["eval"], "fast_kernels": config["target"]["fast_kernels"]}


def eval_decode_job(config: dict, checkpoint: Path | None, target_dir: Path, heldout: Path, out: Path, drafter: str,
                    part: int, log_path: Path) -> dict:
    """The eval_decode rule's job: part ``part`` of one decoding (``drafter``), by the trained
    drafter of ``checkpoint`` or, with none, an untrained one of the config's shape, as training
    will make it. With ``eval.engine: vllm`` the server's log goes beside the job's own."""
    log = Path(log_path)
    decoded = decode_heldout(checkpoint or planned_drafter_config(config["drafter"], target_dir), target_dir, heldout,
                             eval_settings(config), drafter, server_logs=log.with_name(f"{log.stem}-vllm"), part=part)
    write_json(out, decoded)
    return decoded


def eval_job(config: dict, trained: list[Path], untrained: list[Path], thinking_off: list[Path], out: Path,
             run: str) -> dict:
    """The eval rule's job: each decoding joined from its parts, acceptance trained against
    untrained (and with thinking off, when decoded), written and sent to the run's live curves."""
    joined = [merge_parts([read_json(path) for path in paths]) if paths else None
              for paths in (trained, untrained, thinking_off)]
    result = eval_result(joined[0], joined[1], eval_settings(config), joined[2])
    write_eval(result, out)
    log_eval(config, run, result)
    return result


def run_eval_job(config: dict, checkpoint: Path, target_dir: Path, heldout: Path, out: Path) -> dict:
    """``dflash eval``: the eval stage in one process (:func:`run_eval`), sent to the live curves of
    the config's run."""
    result = run_eval(checkpoint, target_dir, heldout, out, eval_settings(config))
    log_eval(config, config["run"], result)
    return result
