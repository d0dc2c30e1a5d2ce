"""Speculative decoding: lossless against plain greedy, and a trained drafter gets more accepted."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash.train.drafter import TargetIO, load_drafter
from dflash.eval.acceptance import merge_parts, position_figures
from dflash.eval.stage import encode_prompts, evaluate, speculative_generate, untrained_drafter
from dflash.core.chat import stop_token_ids
from dflash.hidden.stage import decoder_layers, forward_features
from dflash.train.stage import train
from test_drafter import reference  # noqa: F401 - the fixture with the reference wheel's model.py
from test_train import LAYER_IDS, TRAIN_CFG, make_target, write_shards

DEMO_TARGET = Path(__file__).resolve().parents[1] / "data" / "demo" / "target"


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
WORDS = ("system user assistant you are a helpful bot what is the weather in paris today tell me a joke about "
         "cats write code to sort list please explain why sky blue how do i cook rice").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IM_END, ENDOFTEXT = 2, 0
MASK_ID = 255  # outside the tokenizer's vocabulary, like Qwen's reserved mask token
PROMPTS = [
    {"id": "w", "category": "chat", "messages": [{"role": "user", "content": "what is the weather in paris today"}],
     "tools": None},
    {"id": "j", "category": "chat", "messages": [{"role": "user", "content": "tell me a joke about cats"}],
     "tools": None},
    {"id": "c", "category": "code", "messages": [{"role": "system", "content": "you are a helpful bot"},
                                                 {"role": "user", "content": "write code to sort list"}], "tools": []},
    {"id": "r", "category": "code", "messages": [{"role": "user", "content": "how do i cook rice please"}],
     "tools": None},
]


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + list(dict.fromkeys(WORDS)))}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    text = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def plain_greedy(model, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    new = []
    while len(new) < max_new_tokens and not (new and new[-1] in stop_ids):
        with torch.no_grad():
            new.append(int(model(input_ids=torch.tensor([ids + new]), use_cache=False).logits[0, -1].argmax()))
    return new


@torch.no_grad()
def full_recompute_decode(target, drafter, io, prompt: list[int], max_new_tokens: int, stop_ids: set[int],
                          block_size: int | None = None) -> tuple[list[int], int]:
    """The oracle: speculative decoding without caches, as the evaluator did it before it kept
    them. Every step is one cache-free target forward over the whole sequence, and the drafter's
    plain forward over the whole prefix's features."""
    block_size = 1 if drafter is None else (block_size or drafter.block_size)

    def target_greedy(ids: list[int], keep: int):
        if drafter is None:
            return target(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -keep:].argmax(-1).tolist(), None
        logits, features = forward_features(target, torch.tensor([ids]), drafter.target_layer_ids)
        return logits[0, -keep:].argmax(-1).tolist(), features

    new, features = target_greedy(prompt, 1)
    forwards = 1
    while new[-1] not in stop_ids and len(new) < max_new_tokens:
        last = len(prompt) + len(new) - 1
        num_draft = min(block_size, max_new_tokens - len(new)) - 1
        draft = []
        if num_draft:
            block = torch.tensor([[new[-1]] + [drafter.mask_token_id] * num_draft])
            hidden = drafter(io.embed(block), torch.arange(last, last + num_draft + 1)[None], features[:, :last],
                             torch.arange(last)[None])
            draft = io.logits(hidden[0, 1:]).argmax(-1).tolist()
        verified, features = target_greedy(prompt + new + draft, num_draft + 1)
        forwards += 1
        accepted = 0
        while accepted < num_draft and draft[accepted] == verified[accepted]:
            accepted += 1
        for token in verified[:accepted + 1]:
            new.append(token)
            if token in stop_ids:
                break
    return new, forwards


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    path = make_target(tmp_path_factory.mktemp("m") / "target", seed=3, eos_token_id=IM_END)
    # A random model would often end its answers at once: silence the stop tokens so that the
    # outputs are long enough to measure acceptance (stopping is tested with explicit stop ids).
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][[IM_END, ENDOFTEXT]] = 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


ANSWER_TOKENS = 40


@pytest.fixture(scope="module")
def answers(tiny_target, tokenizer) -> dict[str, tuple[list[int], list[int]]]:
    """Prompt id -> (prompt ids, the target's plain greedy answer without stop tokens)."""
    return {p["id"]: (ids := prompt_ids(tokenizer, p), plain_greedy(tiny_target, ids, ANSWER_TOKENS, set()))
            for p in PROMPTS}


@pytest.fixture(scope="module")
def trained_drafter(tiny_target_dir, tiny_target, answers, tmp_path_factory):
    """A drafter trained on the target's own greedy answers to PROMPTS (a memorised set)."""
    rows = [(ids + answer, [0] * len(ids) + [1] * len(answer)) for ids, answer in answers.values()]
    work = tmp_path_factory.mktemp("train")
    tok, hid = write_shards(tiny_target, work, rows, LAYER_IDS)
    train([tok], [hid], tiny_target_dir, work / "drafter", {**TRAIN_CFG, "mask_token_id": MASK_ID, "steps": 200})
    return work / "drafter"


def test_stop_token_ids(tokenizer, tiny_target):
    assert stop_token_ids(tokenizer, tiny_target.generation_config) == {IM_END, ENDOFTEXT}


def test_speculative_decoding_is_lossless(tiny_target, answers, trained_drafter):
    io = TargetIO.from_model(tiny_target)
    drafters = {"none": None, "untrained": untrained_drafter(trained_drafter)[0].eval(),
                "trained": load_drafter(trained_drafter)[0].eval()}
    for ids, expected in list(answers.values())[:2]:
        expected = expected[:30]
        stop = expected[len(expected) // 2]  # a token from the answer acts as stop id
        expected_stopped = expected[:expected.index(stop) + 1]
        for name, drafter in drafters.items():
            out, forwards, steps = speculative_generate(tiny_target, drafter, io, ids, 30, set())
            assert out == expected, name
            # every forward after the prefill verifies a drafted block, but the last one when a single
            # token was left to generate (nothing to draft); each step yields its accepted tokens + 1
            assert (forwards - 1 - len(steps) in (0, 1)) if drafter else not steps, name
            assert 1 + sum(a + 1 for _, a in steps) + (forwards - 1 - len(steps)) == len(out), name
            assert 1 <= len(out) / forwards <= (drafter.block_size if drafter else 1), name
            out = speculative_generate(tiny_target, drafter, io, ids, 30, {stop}).tokens
            assert out == expected_stopped, name
            # max_new_tokens cuts even a fully accepted block
            assert speculative_generate(tiny_target, drafter, io, ids, 7, set())[0] == expected[:7], name
        # blocks shorter than the trained ones
        assert speculative_generate(tiny_target, drafters["trained"], io, ids, 30, set(), block_size=3)[0] == expected


def test_trained_drafter_beats_untrained(tiny_target_dir, tokenizer, answers, trained_drafter):
    cfg = {"max_new_tokens": ANSWER_TOKENS, "device": "cpu"}
    baseline = evaluate(tiny_target_dir, None, PROMPTS, {**cfg, "max_new_tokens": 8}, tokenizer)
    untrained = evaluate(tiny_target_dir, trained_drafter, PROMPTS, cfg, tokenizer, init_only=True)
    trained = evaluate(tiny_target_dir, trained_drafter, PROMPTS, cfg, tokenizer)

    assert baseline["overall"]["acceptance_length"] == 1.0
    assert untrained["overall"]["acceptance_length"] >= 1.0
    assert trained["overall"]["acceptance_length"] > max(2.0, untrained["overall"]["acceptance_length"] + 0.5)
    expected = [answers[p["id"]][1] for p in PROMPTS]
    assert [s["output_ids"] for s in baseline["samples"]] == [e[:8] for e in expected]
    for result in (untrained, trained):
        assert [s["output_ids"] for s in result["samples"]] == expected

    overall = trained["overall"]
    assert overall["prompts"] == 4 and overall["tokens"] == 4 * ANSWER_TOKENS
    assert overall["acceptance_length"] == pytest.approx(overall["tokens"] / overall["target_forwards"])
    assert set(trained["per_category"]) == {"chat", "code"}
    assert sum(c["target_forwards"] for c in trained["per_category"].values()) == overall["target_forwards"]
    assert [s["id"] for s in trained["samples"]] == ["w", "j", "c", "r"]
    assert set(trained["samples"][0]) == {"id", "category", "acceptance_length", "tokens", "target_forwards",
                                          "output_ids", "acceptance_length_per_step", "drafts",
                                          "accepted_draft_tokens", "steps"}
    # vLLM's figure: 1 + accepted draft tokens per verify step that drafted, the prefill left out
    assert overall["drafts"] == sum(len(s["steps"]) for s in trained["samples"])
    assert overall["acceptance_length_per_step"] == pytest.approx(1 + overall["accepted_draft_tokens"] / overall["drafts"])
    assert overall["acceptance_length_per_step"] > overall["acceptance_length"]
    # every verify step once in the histogram, at the draft tokens it accepted
    histogram = overall["accepted_length_histogram"]
    rates = overall["acceptance_rate_per_position"]
    assert sum(histogram) == overall["drafts"] and len(histogram) == len(rates) + 1 == load_drafter(
        trained_drafter)[1].block_size
    assert sum(n * count for n, count in enumerate(histogram)) == overall["accepted_draft_tokens"]
    assert 0 < rates[-1] <= rates[0] <= 1


def test_position_figures_count_each_verify_step_where_it_drafted():
    """Position k's rate: steps that accepted k drafted tokens or more / steps that drafted k; a
    step cut short by max_new_tokens counts only at the positions it drafted."""
    samples = [{"steps": [(3, 3), (3, 1), (3, 0)]}, {"steps": [(3, 2), (1, 1)]}]
    figures = position_figures(samples)
    assert figures["acceptance_rate_per_position"] == [4 / 5, 2 / 4, 1 / 4]
    assert figures["accepted_length_histogram"] == [1, 2, 1, 1]
    assert position_figures([]) == {"acceptance_rate_per_position": [], "accepted_length_histogram": [0]}


def test_thinking_off_renders_the_empty_think_block():
    """The thinking-off decoding reads the same prompts with the template's empty think block."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    on, off = (tokenizer.decode(encode_prompts(PROMPTS[:1], tokenizer, thinking=t)[0]) for t in (True, False))
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off == on + "\n</think>\n\n"


def test_a_decoding_shared_by_jobs_joins_into_the_whole(tiny_target_dir, tokenizer, trained_drafter):
    """eval.jobs: each job decodes every jobs-th prompt; joined, the parts are the one decoding."""
    cfg = {"max_new_tokens": 12, "device": "cpu"}
    whole = evaluate(tiny_target_dir, trained_drafter, PROMPTS, cfg, tokenizer)
    parts = [evaluate(tiny_target_dir, trained_drafter, PROMPTS[k::3], cfg, tokenizer) for k in range(3)]
    assert merge_parts(parts) == whole


def test_block_size_larger_than_trained_is_refused(tiny_target_dir, tokenizer, trained_drafter):
    with pytest.raises(ValueError, match="block_size"):
        evaluate(tiny_target_dir, trained_drafter, PROMPTS[:1], {"block_size": 8, "device": "cpu"}, tokenizer)


def test_same_tokens_and_steps_as_reference_generate(reference, tmp_path, monkeypatch):
    """The wheel's cached ``dflash_generate`` (on a plain Qwen3 target, whose KV cache it can
    crop) and ours draft, accept and emit the same tokens step for step."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # its stats timer syncs CUDA
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})).eval()
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 250, (12,), generator=g).tolist() for _ in range(3)]
    rows = [(p + plain_greedy(target, p, 40, set()), [0] * 12 + [1] * 40) for p in prompts]
    tok, hid = write_shards(target, tmp_path, rows, LAYER_IDS)
    # Briefly trained, so that blocks are accepted partly: the interesting case.
    cfg = {**TRAIN_CFG, "mask_token_id": MASK_ID, "layer_types": ["sliding_attention", "full_attention"],
           "sliding_window": 6, "steps": 40}
    train([tok], [hid], tmp_path / "target", tmp_path / "drafter", cfg)
    ours = load_drafter(tmp_path / "drafter")[0].eval()
    theirs = reference.DFlashDraftModel.from_pretrained(tmp_path / "drafter").eval()

    steps = []
    for p in prompts:
        expected = reference.dflash_generate(theirs, target, torch.tensor([p]), 40, None, return_stats=True)
        out, forwards, ours_steps = speculative_generate(target, ours, TargetIO.from_model(target), p, 40, set())
        assert out == expected.output_ids[0, len(p):].tolist()
        assert forwards - 1 == len(expected.acceptance_lengths)  # its prefill is not a step
        # our per-step figure is the reference's tau, step by step (its steps count the bonus token);
        # a last forward with one token left drafts nothing and is no step of ours, one of 1 of its
        undrafted = forwards - 1 - len(ours_steps)
        assert undrafted in (0, 1)
        assert [1 + accepted for _, accepted in ours_steps] + [1] * undrafted == expected.acceptance_lengths
        steps += expected.acceptance_lengths
    assert 1 in steps and 4 in steps and len(steps) < 3 * 39


@pytest.fixture(scope="module")
def half_trained_drafter(tiny_target_dir, tiny_target, answers, tmp_path_factory):
    """Briefly trained, with a sliding-attention layer whose window is shorter than the prompts:
    blocks are accepted fully, in part and not at all, so the caches are rolled back at every
    acceptance length."""
    rows = [(ids + answer, [0] * len(ids) + [1] * len(answer)) for ids, answer in answers.values()]
    work = tmp_path_factory.mktemp("half")
    tok, hid = write_shards(tiny_target, work, rows, LAYER_IDS)
    train([tok], [hid], tiny_target_dir, work / "drafter",
          {**TRAIN_CFG, "mask_token_id": MASK_ID, "layer_types": ["sliding_attention", "full_attention"],
           "sliding_window": 6, "steps": 30})
    return work / "drafter"


def test_cached_decoding_matches_full_recompute(tiny_target, answers, trained_drafter, half_trained_drafter):
    """The cached decoder (the target's keys, values and rolled-back linear-attention states, the
    drafter's context keys and values) emits the same tokens in the same number of target forwards
    as full recomputation, for every kind of drafter, block size, stop and length limit."""
    io = TargetIO.from_model(tiny_target)
    drafters = {"none": None, "untrained": untrained_drafter(trained_drafter)[0].eval(),
                "trained": load_drafter(trained_drafter)[0].eval(),
                "half": load_drafter(half_trained_drafter)[0].eval()}
    g = torch.Generator().manual_seed(5)
    prompts = [ids for ids, _ in answers.values()] + [torch.randint(4, 200, (n,), generator=g).tolist()
                                                        for n in (3, 9, 17)]
    ratios = set()
    for name, drafter in drafters.items():
        for ids in prompts:
            for max_new, stop, block_size in ((ANSWER_TOKENS, set(), None), (11, set(), None), (30, set(), 3),
                                              (ANSWER_TOKENS, {answers["w"][1][5]}, None)):
                if drafter is None and block_size:
                    continue
                expected = full_recompute_decode(tiny_target, drafter, io, ids, max_new, stop, block_size)
                got = speculative_generate(tiny_target, drafter, io, ids, max_new, stop, block_size)
                assert got[:2] == expected, (name, ids, max_new, stop, block_size)
                ratios.add(round(len(got[0]) / got[1], 2))
    # Acceptance from none to whole blocks: every rollback length was exercised.
    assert min(ratios) < 1.2 and max(ratios) > 2.5 and len(ratios) > 10


def test_drafter_cached_context_matches_forward(half_trained_drafter):
    drafter = load_drafter(half_trained_drafter)[0].eval()
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 13, 2, 64, generator=g)
    block = torch.randn(1, 4, 64, generator=g)
    positions = torch.arange(13, 17)[None]
    with torch.no_grad():
        plain = drafter(block, positions, features, torch.arange(13)[None])
        # Appended in two parts, as decoding does.
        kv = [(torch.cat([k1, k2], 2), torch.cat([v1, v2], 2)) for (k1, v1), (k2, v2) in zip(
            drafter.context_keys_values(features[:, :8], torch.arange(8)[None]),
            drafter.context_keys_values(features[:, 8:], torch.arange(8, 13)[None]))]
        cached = drafter.forward_cached(block, positions, kv, torch.arange(13)[None])
    torch.testing.assert_close(cached, plain, rtol=1e-5, atol=1e-5)


def test_decode_leaves_the_target_unhooked(tiny_target, answers, trained_drafter):
    """The feature hooks live for one decode (not one forward) and are gone after it, even when it fails."""
    drafter = load_drafter(trained_drafter)[0].eval()
    io = TargetIO.from_model(tiny_target)
    ids = answers["w"][0]
    speculative_generate(tiny_target, drafter, io, ids, 12, set())
    with pytest.raises(ValueError, match="one block"):
        speculative_generate(tiny_target, drafter, io, ids, 12, set(), block_size=drafter.block_size + 1)
    assert not any(layer._forward_hooks for layer in decoder_layers(tiny_target))
