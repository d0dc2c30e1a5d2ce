"""The validate stage's checks of a completion's text (not its tool calls): the target's control
tokens written as text, think tags out of place, the answer drifting into another script, thinking
again or pointing only at the reasoning, a stop that was a cut, and the same text given to another
prompt. Each function takes what it needs and returns a detail (what was seen) or None; validate's
``CHECKS`` wires them to their reason codes.

Think or tool-call tags quoted in code (a fenced block, an inline span) are an answer explaining
the format, not markup: the checks that look for tags read the text with its code blanked.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Collection

from dflash.core.chat import texts_of
from dflash.core.vocabulary import NON_LATIN, SCRIPTS, STRAY_THINK

# A closed fenced block (its closing fence as long as the opening one at least) or an inline code span.
QUOTED_CODE = re.compile(r"^ {0,3}(`{3,}|~{3,})[^\n]*\n[\s\S]*?^ {0,3}\1[`~]*[ \t]*$|(`+)[^`\n][^\n]*?\2", re.M)
# A backtick fence line (a tilde line is as often a separator drawn in text); a line like ```x``` is none
FENCE = re.compile(r"^ {0,3}(`{3,})([^`\n]*)$", re.M)
TOOL_BLOCK = re.compile(r"<tool_call>[\s\S]*?</tool_call>")


def unquoted(text: str) -> str:
    """``text`` with its code (closed fenced blocks, inline spans) blanked."""
    return QUOTED_CODE.sub(" ", text) if "`" in text or "~~~" in text else text


def target_special_tokens(target_dir: str | Path) -> list[str]:
    """The special tokens of the target's tokenizer (``<|im_end|>``, ``<|vision_start|>`` ...), as
    ``transformers`` marks them in ``added_tokens_decoder`` (what ``chat.TokenScreen`` screens
    prompts for), read from the tokenizer files without loading the tokenizer: a validate job would
    spend seconds on that. ``tokenizer_config.json``'s ``added_tokens_decoder`` wins over
    ``tokenizer.json``'s ``added_tokens``, as in ``transformers``."""
    folder = Path(target_dir)
    added: dict[int, tuple[str, bool]] = {}
    if (path := folder / "tokenizer.json").exists():
        added = {t["id"]: (t["content"], t.get("special", False))
                 for t in json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])}
    if (path := folder / "tokenizer_config.json").exists():
        config = json.loads(path.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        added.update({int(i): (t["content"], t.get("special", False)) for i, t in config.items()})
    if not added:
        raise ValueError(f"{folder}: no tokenizer.json or tokenizer_config.json naming added tokens here (validate "
                         f"reads the target's special tokens there); point target.path, or dflash validate --target, "
                         f"at the target model folder")
    return sorted({content for content, special in added.values() if special})


class ShardMemory:
    """What the text checks keep across one shard's records: the target's special tokens as one
    pattern, and the digest of every substantial completion seen so far with the record holding it."""

    def __init__(self, special_tokens: Collection[str] = ()):
        ordered = sorted(special_tokens, key=len, reverse=True)
        self.control = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.prefix = os.path.commonprefix(ordered)  # "<|" for Qwen: a text without it is skipped at C speed
        self.seen: dict[bytes, tuple[str, str]] = {}


def control_token_text(rec: dict, memory: ShardMemory) -> str | None:
    """A special token of the target's tokenizer written in the generated text: a row tokenized
    from text would read it as the real control token. Lookalikes the tokenizer does not mark
    special (``<|user|>``) are plain text."""
    text = rec.get("text") or ""
    if memory.control is None or memory.prefix not in text:
        return None
    hit = memory.control.search(text)
    if hit is None:
        return None
    where = "reasoning" if hit.start() < len(rec.get("reasoning") or "") else "answer"
    return f"{hit.group()} written as text in the {where} at character {hit.start()}"


def stray_think(rec: dict) -> str | None:
    """A think tag past the one the reasoning parser split at: in the answer, or in the reasoning
    after a leading ``<think>`` (a model that opens its own block). Tags quoted in code are fine."""
    reasoning, content = rec.get("reasoning") or "", rec.get("content") or ""
    for field, text in (("reasoning", reasoning.lstrip().removeprefix("<think>")), ("answer", content)):
        if STRAY_THINK.search(text) and (hit := STRAY_THINK.search(unquoted(text))):
            return f"{hit.group()} inside the {field}"
    return None


SCRIPT_LETTER = {name: re.compile(f"[{chars}]") for name, chars in SCRIPTS.items()}
LETTER = re.compile(r"[^\W\d_]")
# A prompt naming the language, or asking for a translation, allows that language's script.
ASKS_FOR = {
    "Han": r"chinese|mandarin|cantonese|japanese|kanji|hanzi|中文|汉语|漢語|华语|日本語|日语",
    "Kana": r"japanese|hiragana|katakana|日本語|日语",
    "Hangul": r"korean|hangul|한국어",
    "Cyrillic": r"russian|ukrainian|bulgarian|serbian|kazakh|belarusian|cyrillic|русск|по-русски",
    "Arabic": r"arabic|persian|farsi|urdu", "Hebrew": r"hebrew|yiddish",
    "Devanagari": r"hindi|sanskrit|marathi|nepali|devanagari", "Thai": r"\bthai\b",
}
ASKS_FOR_RE = {name: re.compile(words, re.I) for name, words in ASKS_FOR.items()}
TRANSLATE = re.compile(r"translat|翻译|翻譯|перев", re.I)
PARAGRAPH = re.compile(r"\n\s*\n")


def _prompt_scripts(rec: dict) -> set[str] | None:
    """The scripts the answer may use beyond Latin: those of the conversation's own text and of
    the languages it names; None (any) when it asks for a translation."""
    prompt = "\n".join(texts_of(rec.get("messages") or [], keys=False))
    if TRANSLATE.search(prompt):
        return None
    if prompt.isascii():
        return {name for name, asks in ASKS_FOR_RE.items() if asks.search(prompt)}
    return {name for name in SCRIPTS if SCRIPT_LETTER[name].search(prompt) or ASKS_FOR_RE[name].search(prompt)}


def language_drift(rec: dict, min_letters: int) -> str | None:
    """The answer (code left out) drifts out of the prompt's language: a paragraph written mostly
    in a script the prompt neither uses nor asks for, with ``min_letters`` letters of it at least
    (an English prompt, a Chinese paragraph); a whole answer in such a script however short (an
    English text to rewrite, rewritten in Chinese); or, to a prompt written in another script, an
    answer begun in that script that goes on with a paragraph of Latin prose. Short quotes and
    terms inside a paragraph of the prompt's language pass, and an answer wholly in Latin letters
    (code, names, English to a Chinese prompt: common and often wanted)."""
    content = rec.get("content") or ""
    if content.isascii() or not NON_LATIN.search(content):
        return None
    allowed = _prompt_scripts(rec)
    if allowed is None:
        return None
    text = unquoted(content)
    foreign = _letters_outside(frozenset(allowed))
    if foreign.search(text):
        for paragraph in PARAGRAPH.split(text):
            if hit := _foreign_share(paragraph, foreign, min_letters):
                return f"a {hit[0]} paragraph ({hit[1]} of its {hit[2]} letters) in the answer to a prompt in " \
                       f"another script: {paragraph.strip()[:60]!r}"
        if hit := _foreign_share(text, foreign, WHOLE_ANSWER_LETTERS):
            return f"the whole answer in {hit[0]} ({hit[1]} of its {hit[2]} letters) to a prompt in another " \
                   f"script: {text.strip()[:60]!r}"
    return _latin_drift(rec, text)


WHOLE_ANSWER_LETTERS = 4  # an answer wholly in a foreign script is no quoted term, however short
LATIN_PROSE_WORDS = 12  # a paragraph of this many Latin words and no other script is prose, not a term
LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")
# Asking for text in a Latin-script language, not naming one ("如何提高英语口语" is about English)
ASKS_FOR_LATIN = re.compile(r"\bin (?:english|french|german|spanish)\b|english (?:version|sentence|example|text|"
                            r"translation)|英文|用(?:英|法|德|西班牙)语|英语(?:回答|写|例句|句子|版本)|英語で|영어로|"
                            r"по-английски", re.I)


def _foreign_share(text: str, foreign: re.Pattern, least: int) -> tuple[str, int, int] | None:
    """(script, its letters, all letters) when ``text`` is mostly letters of one foreign script,
    ``least`` of them at least."""
    found = foreign.findall(text)
    if len(found) < least:
        return None
    name, n = max(((name, sum(1 for c in found if SCRIPT_LETTER[name].match(c))) for name in SCRIPTS),
                  key=lambda hit: hit[1])
    letters = len(LETTER.findall(text))
    return (name, n, letters) if n >= least and 2 * n > letters else None


def _latin_drift(rec: dict, text: str) -> str | None:
    """A paragraph of Latin prose in an answer to a prompt written mostly in another script, after
    the answer began in that script (a Chinese answer that ends in English)."""
    prompt = "\n".join(texts_of(rec.get("messages") or [], keys=False))
    prompt_letters = LETTER.findall(prompt)
    if ASKS_FOR_LATIN.search(prompt) or 2 * sum(1 for c in prompt_letters if NON_LATIN.match(c)) <= len(prompt_letters):
        return None
    began = False
    for paragraph in PARAGRAPH.split(text):
        if NON_LATIN.search(paragraph):
            began = began or 2 * len(NON_LATIN.findall(paragraph)) > len(LETTER.findall(paragraph))
            continue
        if began and len(words := LATIN_WORD.findall(paragraph)) >= LATIN_PROSE_WORDS:
            return f"a paragraph of Latin prose ({len(words)} words) in an answer begun in the prompt's script: " \
                   f"{paragraph.strip()[:60]!r}"
    return None


@functools.lru_cache(maxsize=None)
def _letters_outside(allowed: frozenset[str]) -> re.Pattern:
    """One pattern for the letters of every script but ``allowed``: one scan of a paragraph."""
    return re.compile(f"[{''.join(chars for name, chars in SCRIPTS.items() if name not in allowed)}]")


# How a reasoning model's thinking opens, when the answer (after </think>) opens the same way.
REASONING_OPENER = re.compile(
    r"\s*(?:(?:okay|ok|alright|all right|hmm+|so|well)[,.!]?\s+(?:so[, ]\s*)?"
    r"(?:the user(?:'s)? (?:is asking|asks|asked|wants|wrote|said|mentioned|needs|question)|let me (?:think|figure|"
    r"see\b|re-?(?:read|check|examine|think|consider))|let's see\b|i need to|we need to|i should|i'll start by "
    r"(?:thinking|figuring)|first,? i (?:need|should|will)|wait\b)"
    r"|let me (?:think|figure out|work (?:this|it) out|re-?(?:read|examine|think|consider))\b|let's think\b"
    r"|hmm+[,.!]|wait[,.!]\s|the user (?:is asking|asks|asked|wants|wrote)\b"
    r"|we need to (?:figure out|find|determine|solve|compute|answer|respond)\b"
    r"|(?:嗯|好的|好吧|好)[，,]\s*(?:用户|我|让我|首先|那)|用户(?:问|想|要|提到|给出|的问题)|让我(?:想|思考|看看|算|检查)|我需要|首先，我|等等[，,])",
    re.I)


OPENING_CHARS = 400  # the part of the answer's first paragraph where a restart of the reasoning shows
SENTENCE_START = re.compile(r"^|(?<=[.!?。！？])\s*")


def thinking_in_answer(rec: dict) -> str | None:
    """The answer opens with reasoning again (``Okay, the user is asking...``, ``Let me think``,
    ``嗯，用户...``). An answer that opens ``Okay, here is...`` or quotes such a phrase passes."""
    content = rec.get("content") or ""
    # Any sentence of the opening paragraph: "Okay, so the question is about trains. Let me think."
    opening = PARAGRAPH.split(content.lstrip(), 1)[0][:OPENING_CHARS]
    for sentence in SENTENCE_START.finditer(opening):
        if REASONING_OPENER.match(opening, sentence.end()):
            return f"the answer starts reasoning again: {opening.strip()[:60]!r}"
    return None


# Phrases that point at the reasoning instead of answering.
POINTER = re.compile(
    r"(?:(?:please )?(?:see|refer to|check|look at|read)|(?:it(?:'s| is)|this is|that is) (?:in|given in|shown in))"
    r" (?:my|the) (?:reasoning|thinking|thoughts|thought process|analysis|working|work|calculations?|steps|"
    r"explanation|derivation)(?: (?:above|earlier|before))?"
    r"|as (?:computed|shown|explained|derived|calculated|discussed|reasoned|worked out|stated|mentioned|noted|found)"
    r" (?:above|earlier|before|in my (?:reasoning|thinking|analysis))"
    r"|(?:the )?(?:final )?answer (?:is|was) (?:in|given in|shown in|above in) (?:my|the) (?:thinking|reasoning|"
    r"analysis|thoughts|thought process)(?: above)?"
    r"|(?:my|the) (?:reasoning|thinking|analysis) above (?:has|contains|shows|gives) (?:the|my) (?:final )?answer"
    r"|i(?:'ve| have)? (?:already )?(?:worked|figured|solved|answered|computed|calculated|explained|shown|derived|"
    r"done) (?:it|this|that|the (?:answer|problem|question))? ?(?:out )?(?:above|earlier|before|in my (?:reasoning|"
    r"thinking|analysis))"
    r"|(?:详见|见|参见|参考|(?<=答案)在)(?:上面|上文|上述|以上|我的思考|思考过程)(?:的)?(?:推理|分析|思考|过程|计算)?(?:中|里)?"
    r"|如上(?:所述|所示|所算)",
    re.I)
# Words that say nothing once the pointer is gone: "See my reasoning above for the answer."
FILLER = frozenset("the a an answer final result solution is was for it this that my above please so thus hence "
                   "therefore you can and of to in as full details detailed".split())
FILLER_ZH = re.compile("最终|答案|结果|请|详细|过程|所以|因此")
STUB_MAX_CHARS = 300  # a pointer with a real answer around it is longer; the scan stays on short answers


def stub_answer(rec: dict) -> str | None:
    """The answer only points at the reasoning (``See my reasoning above.``, ``答案见上面的推理。``):
    nothing but the pointer and filler words. A short answer that says something (``4``, ``As
    computed above, the total is 42.``) passes."""
    content = (rec.get("content") or "").strip()
    if not content or len(content) > STUB_MAX_CHARS or not (hit := POINTER.search(content)):
        return None
    rest = FILLER_ZH.sub(" ", POINTER.sub(" ", content))
    if any(word.lower() not in FILLER for word in re.findall(r"\w+", rest)):
        return None
    return f"the answer only points at the reasoning ({hit.group()!r})"


def truncated_stop(rec: dict) -> str | None:
    """``stop``, but the generation was cut: as many completion tokens as ``max_tokens`` allowed,
    or an answer that ends inside a code fence it opened (tool-call blocks left out: a value may
    hold half a fence)."""
    if rec["finish_reason"] != "stop":
        return None
    cap = rec.get("generation", {}).get("sampling", {}).get("max_tokens")
    if cap is not None and rec["usage"]["completion_tokens"] >= cap:
        return f"finish_reason stop at {rec['usage']['completion_tokens']} completion tokens, the max_tokens {cap}"
    content = rec.get("content") or ""
    if "```" not in content:
        return None
    if "<tool_call>" in content:
        content = TOOL_BLOCK.sub(" ", content)
    opened = None  # the open fence's characters, or None
    for m in FENCE.finditer(content):
        fence, info = m.groups()
        if opened is None:
            opened = fence
        elif len(fence) >= len(opened) and not info.strip():
            opened = None
    if opened is None:
        return None
    last = content.rstrip().rsplit("\n", 1)[-1]
    return f"finish_reason stop inside an open {opened} code fence, the last line {last[-60:]!r}"


def duplicate_completion(rec: dict, memory: ShardMemory, min_chars: int) -> str | None:
    """The same text (whitespace normalised, ``min_chars`` at least) as an earlier record of the
    shard that answers another prompt. Short generic answers (``Hello! How can I help?``) repeat
    legitimately and are not compared."""
    text = " ".join((rec.get("text") or "").split())
    if len(text) < min_chars:
        return None
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    first = memory.seen.setdefault(digest, (rec["id"], rec.get("prompt_id", rec["id"])))
    if first[1] == rec.get("prompt_id", rec["id"]):
        return None
    return f"the same {len(text):,} characters as record {first[0]} (prompt {first[1]})"
