"""Streamed generation of the ``openai`` backend, the parts that need no server: the incremental
detokenizer that feeds the loop watch, and which dialects stream. The streamed records themselves,
and a looping stream cut short, are tested against the real vLLM CPU server (test_generate_vllm)."""
from pathlib import Path

import pytest

from dflash.generate.backends import IncrementalText, OpenAIBackend
from dflash.target.teach import build_tokenizer, load_conversations


@pytest.fixture(scope="module")
def tokenizer(demo_sources, tmp_path_factory):
    """The demo target's tokenizer (byte-level BPE, Qwen's specials), saved for the backend to load."""
    tok = build_tokenizer(load_conversations([Path(s["path"]) for s in demo_sources], split=None), 2048)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return tok, out


TEXTS = [
    "<think>\nLet me see: 3 × 4 = 12.\n</think>\n\nThe answer is **12**.<|im_end|>",
    "Ünïcödé, 日本語のテキスト, emoji 🙂🚀 and a table:\n| a | b |\n|---|---|\n| 1 | 2 |\n" * 3,
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_deltas_add_up_to_the_decoded_ids(tokenizer, text, step):
    """Fed a few ids at a time (vLLM sends one per chunk, more under load), the deltas never hold a
    broken character and join into exactly the decoding of all the ids: the loop watch sees the
    text the validator will see, at the same offsets."""
    tok, _ = tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    if "🙂" in text:  # a character split over tokens: the case where a delta must wait for the rest
        assert any(tok.decode(ids[:k], skip_special_tokens=False).endswith("\ufffd") for k in range(len(ids)))
    stream = IncrementalText(tok)
    deltas = [stream.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == text


def backend_cfg(dialect, stream, loop_abort=True):
    return {"backend": "openai", "loop_abort": loop_abort,
            "server": {"url": "http://127.0.0.1:9/v1", "dialect": dialect, "model": "tiny", "api_key_env": None,
                       "timeout_s": 5, "retries": 0, "extra_body": {}, "concurrency": 1,
                       "max_connection_failures": 16, "stream": stream}}


REPETITION = {"min_repeats": 4, "min_chars": 200}


@pytest.mark.parametrize("dialect,stream,streams", [
    ("vllm", None, True), ("vllm", False, False), ("vllm", True, True),
    ("sglang", None, False), ("sglang", False, False), ("openai", None, False)])
def test_which_dialects_stream(tokenizer, dialect, stream, streams):
    backend = OpenAIBackend(tokenizer[1], backend_cfg(dialect, stream), REPETITION)
    body = backend.request_body({"messages": [{"role": "user", "content": "hi"}]},
                                {"max_tokens": 8, "temperature": 0, "top_p": 1, "top_k": -1}, True, 0)
    assert backend.stream is streams and body.get("stream", False) is streams
    assert ("stream_options" in body) is streams
    assert (backend.loop_thresholds == REPETITION) is streams  # a watch needs the stream


@pytest.mark.parametrize("dialect", ["sglang", "openai"])
def test_stream_forced_on_a_dialect_without_ids_in_its_stream_is_an_error(tokenizer, dialect):
    with pytest.raises(ValueError, match=f"generate.server.stream is true but the {dialect} dialect's chat stream "
                                         f"carries no exact token ids"):
        OpenAIBackend(tokenizer[1], backend_cfg(dialect, True), REPETITION)


def test_no_loop_watch_when_loop_abort_is_off_or_without_thresholds(tokenizer):
    assert OpenAIBackend(tokenizer[1], backend_cfg("vllm", None, loop_abort=False), REPETITION).loop_thresholds is None
    assert OpenAIBackend(tokenizer[1], backend_cfg("vllm", None), None).loop_thresholds is None
