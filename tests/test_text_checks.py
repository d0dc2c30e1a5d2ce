"""The validate stage's text checks (dflash/validate/text_checks.py) on the shapes real Qwen3.6 completions
take: each code with a record that has the problem and its good twin, in English and Chinese, and
the good records a naive check would reject."""
import shutil
from pathlib import Path

import pytest

from dflash.core.io import read_jsonl, write_jsonl_zst
from dflash.validate.text_checks import ShardMemory, target_special_tokens
from dflash.validate.stage import judge, validate_shard
from tests.test_validate import CFG, REASONING, WEATHER, record

ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = ROOT / "data/demo/target"
# Qwen3.5/3.6's special tokens past the three the demo tokenizer has (tests/../qwen-formats.md)
QWEN36_EXTRA = ["<|object_ref_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
ZH_REASONING = "用户问法国的首都是哪里。法国的首都是巴黎，这是一个常识问题，我直接用一句话回答即可。"


@pytest.fixture(scope="module")
def qwen36_like_target(tmp_path_factory) -> Path:
    """The demo tokenizer with Qwen3.6's vision tokens added as special tokens, saved by
    transformers itself (so tokenizer_config.json carries added_tokens_decoder)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("target")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN36_EXTRA})
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def memory_tokens(qwen36_like_target) -> list[str]:
    return target_special_tokens(qwen36_like_target)


def said(content, prompt="What is the capital of France?", reasoning=REASONING, **kw):
    rec = record(f"{reasoning}\n</think>\n\n{content}", **kw)
    rec["messages"] = [{"role": "user", "content": prompt}]
    return rec


def hits(rec, memory=None):
    reasons, flags, _, details = judge(rec, CFG, memory)
    return reasons + flags, details


# -- control_token_text --------------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["demo", "qwen36"])
def test_special_tokens_are_the_tokenizers_own(folder, qwen36_like_target):
    """target_special_tokens reads the files; transformers' loaded tokenizer is the reference."""
    from transformers import AutoTokenizer

    from dflash.core.chat import TokenScreen

    path = DEMO_TARGET if folder == "demo" else qwen36_like_target
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    screen = TokenScreen(tokenizer)
    expected = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special})
    assert target_special_tokens(path) == expected and screen.pattern is not None
    assert "<think>" not in expected and "<|im_end|>" in expected


@pytest.mark.parametrize("content", [
    "The capital of France is Paris.<|im_end|>\n<|im_start|>user\nAnd Germany?",
    "The capital of France is Paris. It sits on the Seine.<|endoftext|>",
    "Here is the image you described: <|vision_start|><|image_pad|><|vision_end|> showing Paris.",
])
def test_a_control_token_written_as_text_is_caught(content, memory_tokens):
    found, details = hits(said(content), ShardMemory(memory_tokens))
    assert "control_token_text" in found
    assert details["control_token_text"].startswith("<|") and "in the answer at character" in details[
        "control_token_text"]


def test_a_control_token_in_the_reasoning_is_named_there(memory_tokens):
    rec = said("巴黎。", reasoning=f"{ZH_REASONING}<|im_end|>", prompt="法国的首都是哪里？")
    assert hits(rec, ShardMemory(memory_tokens))[1]["control_token_text"].startswith("<|im_end|> written as text in "
                                                                                     "the reasoning")


@pytest.mark.parametrize("content", [
    "Chat formats differ: Zephyr marks turns with <|user|> and <|assistant|>, and some models use <|im_sep|> "
    "between the role and the message.",
    "Vision tokens such as <|vision_start|> are special only in the tokenizers that define them.",
])
def test_lookalikes_the_tokenizer_does_not_mark_special_pass(content, memory_tokens):
    demo_only = ShardMemory(target_special_tokens(DEMO_TARGET))  # the second: not special in this target
    memory = demo_only if "Vision" in content else ShardMemory(memory_tokens)
    assert "control_token_text" not in hits(said(content), memory)[0]


def test_the_stage_finds_them_with_the_targets_tokens(tmp_path, qwen36_like_target):
    leaked = {**said("Paris.<|vision_end|> It is the capital of France and its largest city."), "id": "leak"}
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [said("Paris is the capital of France and its largest city."), leaked])
    report = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                            tmp_path / "qa.json", CFG, special_tokens=target_special_tokens(qwen36_like_target))
    [rejected] = read_jsonl(tmp_path / "r.jsonl.zst")
    assert report["kept"] == 1 and rejected["id"] == "leak" and rejected["qa"]["reasons"] == ["control_token_text"]
    assert "<|vision_end|>" in report["examples"]["control_token_text"][0]["excerpt"]


def test_a_folder_without_tokenizer_files_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=rf"^{tmp_path}: no tokenizer.json or tokenizer_config.json"):
        target_special_tokens(tmp_path)


def test_the_demo_target_copy_without_its_config_still_reads(tmp_path):
    shutil.copy(DEMO_TARGET / "tokenizer.json", tmp_path)
    assert target_special_tokens(tmp_path) == target_special_tokens(DEMO_TARGET)


# -- stray_think ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    f"{REASONING}\n<think>\nLet me start over.\n</think>\n\nParis.",  # a second think block opened in the reasoning
    f"<think>\n{REASONING}\n<think>\nHmm.\n</think>\n\nParis is the capital.",  # past the leading one
    f"{ZH_REASONING}\n</think>\n\n巴黎。</think>\n巴黎是法国的首都。",
])
def test_a_stray_think_tag_in_the_reasoning_or_answer_is_caught(text):
    assert "stray_think" in hits(record(text))[0]


ASKS_FORMAT = "How does Qwen3 mark its reasoning in the raw output?"


@pytest.mark.parametrize("content, prompt", [
    ("Qwen3 wraps its reasoning like this:\n\n```\n<think>\nreasoning here\n</think>\n\nthe answer\n```\n\n"
     "The parser splits the text at `</think>`.", ASKS_FORMAT),
    ("Strip the block with `re.sub(r\"<think>.*?</think>\", \"\", text, flags=re.S)` before showing the answer.",
     ASKS_FORMAT),
    ("解析器在 `</think>` 处切分推理和回答：\n\n```python\nreasoning, answer = text.split(\"</think>\", 1)\n```",
     "Qwen3 在原始输出里怎么标记推理？"),
])
def test_think_tags_quoted_in_code_are_kept(content, prompt):
    """Today's naive check rejected these: an answer explaining the format is a good record."""
    assert hits(said(content, prompt=prompt))[0] == []


def test_a_leading_think_in_the_reasoning_is_the_parsers_not_a_stray():
    assert hits(record(f"<think>\n{REASONING}\n</think>\n\nThe capital of France is Paris."))[0] == []


# -- language_drift ------------------------------------------------------------------------------

DRIFT = ("The capital of France is Paris, on the Seine.\n\n巴黎是法国的首都和最大城市，位于塞纳河畔，"
         "是欧洲最重要的文化和经济中心之一。")


@pytest.mark.parametrize("content, prompt", [
    (DRIFT, "What is the capital of France?"),
    ("Paris is the capital.\n\nПариж является столицей Франции и крупнейшим городом страны.", "What is the capital "
     "of France?"),
])
def test_an_answer_drifting_into_another_script_is_caught(content, prompt):
    found, details = hits(said(content, prompt=prompt))
    assert "language_drift" in found and "paragraph" in details["language_drift"]


@pytest.mark.parametrize("content, prompt", [
    (DRIFT, "Answer in English, then repeat the answer in Chinese."),
    (DRIFT, "Translate 'Paris is the capital of France' and explain."),
    ("巴黎是法国的首都和最大城市，位于塞纳河畔，是欧洲最重要的文化和经济中心之一。", "用中文回答：法国的首都是哪里？"),
    ("巴黎是法国的首都和最大城市，位于塞纳河畔，是欧洲最重要的文化和经济中心之一。", "法国的首都是哪里？"),
    # a Chinese prompt answered in English (with code): Latin is never drift
    ("Use `collections.Counter`:\n\n```python\nfrom collections import Counter\nprint(Counter(words).most_common(3))\n"
     "```\n\nThis prints the three most common words.", "如何用 Python 统计列表中出现最多的三个词？"),
    # a short term quoted in an English paragraph
    ("In Mandarin, 'thank you' is 谢谢 (xièxie), and a polite reply is 不客气 (bú kèqi), meaning 'you are welcome'.",
     "How do people say thanks in Beijing?"),
    # Greek letters of a formula: not a language
    ("The wave is y = A·sin(ωt − φ):\n\nα β γ δ ε ζ η θ ι κ λ μ ν ξ ο π ρ σ τ υ φ χ ψ ω are the symbols used below.",
     "Explain the wave equation."),
    # Chinese text inside code: a test fixture, not the answer's language
    ("```python\nassert greet('zh') == '你好，世界！欢迎来到我们的网站，希望你在这里度过愉快的时光。'\n```",
     "Write a test for greet()."),
])
def test_asked_for_or_short_foreign_text_is_no_drift(content, prompt):
    assert "language_drift" not in hits(said(content, prompt=prompt))[0]


# Twins written for the wider drift rules (a whole short answer in another script; a Latin
# paragraph after an answer begun in the prompt's script), apart from tests/labelled_cases.py.
@pytest.mark.parametrize("content, prompt, drifts", [
    ("Встреча перенесена на пятницу.", "Make this sound friendlier: The meeting moved to Friday.", True),
    ("ありがとうございます", "Reply to this message: Thanks for the gift!", True),
    ("ありがとうございます", "How do you say 'thank you very much' in Japanese?", False),
    ("Merci beaucoup !", "Reply to this message: Thanks for the gift!", False),
    ("東京の人口は約千四百万人です。\n\nIn other words, Tokyo is home to roughly fourteen million people, which makes it "
     "one of the largest cities in the world.", "東京の人口は何人ですか？", True),
    ("东京人口约一千四百万。\n\nTokyo Metropolis, Shinjuku, Shibuya", "东京有多少人口？", False),
    ("下面是一个英文例句：\n\nThe committee will review every application carefully before it makes a final "
     "decision next month.", "给我一个关于 review 的英文例句。", False),
])
def test_the_wider_drift_rules_have_twins(content, prompt, drifts):
    assert ("language_drift" in hits(said(content, prompt=prompt))[0]) is drifts


# -- thinking_in_answer --------------------------------------------------------------------------

@pytest.mark.parametrize("content", [
    "Okay, the user is asking about the capital of France. I know it is Paris, so I will answer that.",
    "Let me think about this again. France's capital is Paris.",
    "Hmm, wait. The capital of France is Paris, not Lyon.",
    "We need to figure out the capital of France. It is Paris.",
    "嗯，用户问的是法国的首都。我知道是巴黎，所以直接回答。",
    "Right, so this is about French geography. Let me think it through once more: the capital is Paris.",
])
def test_an_answer_that_starts_reasoning_again_is_caught(content):
    assert "thinking_in_answer" in hits(said(content))[0]


@pytest.mark.parametrize("content", [
    "Okay, here is the answer: the capital of France is Paris.",
    "Okay! The capital of France is Paris, a city of about two million people.",
    "\"Okay, the user is asking\" is how reasoning models often open their thinking; the answer should not.",
    "好的，法国的首都是巴黎，也是法国最大的城市。",
    "Good question. Let me walk you through it: the capital of France is Paris.",
    "The capital is Paris.\n\nLet me think of a mnemonic for you: Paris, the city of light.",
])
def test_an_answer_opening_like_reasoning_but_answering_passes(content):
    assert "thinking_in_answer" not in hits(said(content))[0]


# -- stub_answer and trivial ---------------------------------------------------------------------

@pytest.mark.parametrize("content", ["See my reasoning above.", "The answer is in my thinking.", "As computed above.",
                                     "Please refer to the analysis above for the final answer.", "答案见上面的推理。",
                                     "如上所述。", "I've already solved this above.", "I have shown the answer earlier."])
def test_an_answer_that_only_points_at_the_reasoning_is_caught(content):
    assert "stub_answer" in hits(said(content))[0]


@pytest.mark.parametrize("prompt, content, reasoning", [
    ("2+2?", "4", "The user asks for 2+2. Two plus two is four, a basic sum; I answer with the number alone."),
    ("Capital of France, one word.", "Paris", REASONING),
    ("What is 17 * 3?", "As computed above, 17 × 3 = 51.", "17 times 3: 10 times 3 is 30, 7 times 3 is 21, so 51."),
    ("法国的首都？一个词。", "巴黎", ZH_REASONING),
    ("Is 91 prime?", "I worked it out above: 91 = 7 × 13, so it is not prime.", "91: divisible by 7? 7 × 13 = 91. Yes."),
])
def test_very_short_correct_answers_with_real_reasoning_pass(prompt, content, reasoning):
    """trivial counts the whole text, reasoning included: a one-word answer after real thinking is fine."""
    assert hits(said(content, prompt=prompt, reasoning=reasoning))[0] == []


# -- truncated_stop ------------------------------------------------------------------------------

def capped(rec, completion_tokens, max_tokens=64):
    return {**rec, "usage": {**rec["usage"], "completion_tokens": completion_tokens},
            "generation": {**rec["generation"],
                           "sampling": {**rec["generation"]["sampling"], "max_tokens": max_tokens}}}


OPEN_FENCE = "Here is the function:\n\n```python\ndef capital(country):\n    return {'France': 'Paris'}.get(countr"


@pytest.mark.parametrize("rec", [
    capped(said("The capital of France is Paris, a city on the Seine with many"), 64),
    said(OPEN_FENCE),
    said("代码如下：\n\n```python\ndef capital(country):\n    # 返回首都\n    return CAPITALS[coun"),
])
def test_a_stop_that_was_a_cut_is_caught(rec):
    found, details = hits(rec)
    assert "truncated_stop" in found and details["truncated_stop"].startswith("finish_reason stop")


@pytest.mark.parametrize("rec", [
    capped(said("The capital of France is Paris."), 63),  # just under the cap
    said(OPEN_FENCE + "ry)\n```\n\nIt returns None for other countries."),  # a closed fence
    # an odd number of ``` lines, inside a four-backtick example that is closed
    said("A fenced block in Markdown:\n\n````markdown\n```python\nprint('Paris')\n````\n\nThe outer fence is longer."),
    said("Wrap code in ``` fences; the capital of France is Paris."),  # backticks inside a line, no fence
    said("Paris\n~~~~~~~~~~~~\nThe capital of France."),  # a tilde line drawn as a separator
])
def test_a_stop_under_the_cap_or_with_closed_fences_passes(rec):
    assert "truncated_stop" not in hits(rec)[0]


def test_a_fence_inside_a_tool_call_argument_is_not_the_answers():
    content = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis ```\n</parameter>\n</function>\n"
               "</tool_call>")
    rec = {**said(content), "category": "tool", "tools": [WEATHER]}
    assert "truncated_stop" not in hits(rec)[0]


# -- duplicate_completion ------------------------------------------------------------------------

LONG_ANSWER = ("The capital of France is Paris. It lies on the Seine in the north of the country, is its largest city, "
               "and has been the seat of government for most of French history since the Capetian kings.")


def test_the_same_substantial_completion_on_another_prompt_is_caught(tmp_path):
    first = {**said(LONG_ANSWER), "id": "a", "prompt_id": "a"}
    again = {**said(LONG_ANSWER.replace(". ", ".  \n")), "id": "b", "prompt_id": "b"}  # whitespace only differs
    again["messages"] = [{"role": "user", "content": "Write a haiku about autumn."}]
    same_prompt = {**said(LONG_ANSWER), "id": "a-g1", "prompt_id": "a"}  # a replay step of the same prompt
    hello = [{**said("Hello! How can I help you today?"), "id": f"h{i}", "prompt_id": f"h{i}"} for i in range(3)]
    write_jsonl_zst(tmp_path / "c.jsonl.zst", [first, same_prompt, again, *hello])
    report = validate_shard(tmp_path / "c.jsonl.zst", tmp_path / "v.jsonl.zst", tmp_path / "r.jsonl.zst",
                            tmp_path / "qa.json", CFG)
    [rejected] = read_jsonl(tmp_path / "r.jsonl.zst")
    assert rejected["id"] == "b" and rejected["qa"]["reasons"] == ["duplicate_completion"]
    assert rejected["qa"]["details"]["duplicate_completion"].endswith("as record a (prompt a)")
    assert report["kept"] == 5


def test_a_chinese_duplicate_is_caught_too():
    memory = ShardMemory()
    answer = ZH_REASONING * 3
    assert "duplicate_completion" not in hits({**said(answer), "id": "x", "prompt_id": "x"}, memory)[0]
    assert "duplicate_completion" in hits({**said(answer), "id": "y", "prompt_id": "y"}, memory)[0]
