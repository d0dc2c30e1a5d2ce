"""Server dialects: what each kind of OpenAI-compatible chat server takes beyond the standard
fields, where its exact token ids come back, and how its parsed reply maps back to the model's
text. The generate backend (``dflash.generate.backends``), the text rebuilt from a reply (``dflash.core.chat``),
adopted logs (``dflash.prompts.stage``, ``dflash.generate.adopt``) and the serve rule's environment read it here.
A new server: one more ``Dialect`` in ``DIALECTS`` and its name in the schema's
``generate.server.dialect`` enum.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dialect:
    name: str
    # request fields that make the reply carry the exact prompt and output ids ({}: it cannot)
    id_request: dict
    # its chat stream carries the exact ids (see DIALECTS)
    stream_ids: bool
    # takes top_k (a strict server, such as `transformers serve`, refuses unknown fields)
    top_k: bool
    # where its replies put the reasoning, and where it reads an earlier assistant turn's
    reasoning_field: str
    # fields only its replies carry, (where: "choice" or "message", field): how an adopted log's
    # server is told apart
    marks: tuple[tuple[str, str], ...]
    # tool-call formats whose parser drops the text before the first call (rebuilt from the template)
    strips_text_before_calls: frozenset[str]
    # the conda environment (envs/) of the serve rule that launches it
    env: str


# vLLM 0.32 (vllm/entrypoints/openai/chat_completion/serving.py) streams the ids: with
# return_token_ids, top-level prompt_token_ids on the first chunk, choices[0].token_ids (the new
# ids) on every later one, finish_reason on the last, usage in a last choice-less chunk with
# stream_options.include_usage. SGLang (sgl-project/sglang python/sglang/srt/entrypoints/openai/
# serving_chat.py at 002897c2, sse_utils.py at 06713058) does not: its stream chunks hold role,
# content, reasoning_content and logprobs only, and return_prompt_token_ids with stream is refused
# ("not supported with streaming"). A plain OpenAI server (``transformers serve``, a hosted API)
# returns no ids at all, and its parser strips nothing: its text is rebuilt as SGLang's.
DIALECTS = {d.name: d for d in (
    Dialect("openai", {}, stream_ids=False, top_k=False, reasoning_field="reasoning_content", marks=(),
            strips_text_before_calls=frozenset(), env="torch.yaml"),
    Dialect("sglang", {"return_prompt_token_ids": True, "return_token_ids": True, "skip_special_tokens": False},
            stream_ids=False, top_k=True, reasoning_field="reasoning_content",
            marks=(("choice", "matched_stop"), ("message", "reasoning_content")),
            strips_text_before_calls=frozenset({"hermes"}), env="sglang.yaml"),
    Dialect("vllm", {"return_token_ids": True, "skip_special_tokens": False}, stream_ids=True, top_k=True,
            reasoning_field="reasoning", marks=(("choice", "stop_reason"), ("message", "reasoning")),
            strips_text_before_calls=frozenset({"xml"}), env="vllm.yaml"),
)}
# The servers an adopted log can come from: those whose replies can be told apart, SGLang first
# (vLLM before 0.10 sent reasoning_content too).
LOGGING_SERVERS = tuple(name for name, d in DIALECTS.items() if d.marks)


def detect_server(choice: dict, message: dict) -> str | None:
    """The server behind a logged reply, from fields only it sends; None when none matches."""
    for name in LOGGING_SERVERS:
        if any(field in (choice if where == "choice" else message) for where, field in DIALECTS[name].marks):
            return name
    return None
