"""Adopting completions a server already produced: chat-completion request/response pairs become
completion records, so paid-for generations are not generated again.

A server with a reasoning and a tool-call parser returns the model's output split into
``reasoning_content`` (vLLM 0.32: ``reasoning``), ``content`` and ``tool_calls``; ``text`` is
rebuilt from them. What each server keeps of the raw output decides whether that is exact
(measured on SGLang 0.5.23 with ``--reasoning-parser qwen3`` and ``--tool-call-parser
qwen3_coder``/``qwen25``, and vLLM 0.32.0 with ``qwen3`` and ``qwen3_coder``/``hermes``):

- reasoning keeps its trailing newline and content its leading ones on both, so a reply without
  tool calls is exact: reasoning + ``</think>`` + content;
- SGLang ``qwen3_coder`` keeps the text before the first call unstripped (``"\\n\\n"`` for a
  call-only reply), so calls rendered back in the XML format make it exact too;
- SGLang ``qwen25`` and vLLM ``qwen3_coder`` strip that text, and vLLM drops it when it is only
  whitespace: the whitespace is restored as the chat template renders an assistant turn, and the
  record says ``generation.verbatim: false``.

A response that carries token ids (SGLang ``return_token_ids``, vLLM ``return_token_ids``) needs
none of this: its ids are kept and its text is their decoding (done by the tokenize stage).
"""
from __future__ import annotations

import json
from pathlib import Path

THINK_CLOSE = "</think>"
# Which (server, tool format) pairs strip the text before the first tool call.
STRIPS_TEXT_BEFORE_CALLS = {("vllm", "xml"), ("sglang", "hermes")}


def _arguments(fn: dict) -> dict:
    args = fn.get("arguments")
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return args or {}


def render_call(call: dict, tool_format: str) -> str:
    """One parsed tool call in the model's raw format (as the Qwen templates render it)."""
    fn = call.get("function") or call
    if tool_format == "hermes":
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
        return f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args}}}\n</tool_call>'
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                     for k, v in _arguments(fn).items())
    return f"<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>"


def reasoning_of(message: dict) -> str | None:
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"]
    return message.get("reasoning")


def rebuild_text(message: dict, thinking: bool, finish_reason: str = "stop", server: str = "sglang",
                 tool_format: str = "xml") -> tuple[str, bool]:
    """(raw output, verbatim) behind a parsed chat message; ``verbatim`` is false when whitespace
    the server stripped was restored from the template's rules rather than read back."""
    reasoning = reasoning_of(message)
    content = message.get("content") or ""
    calls = [render_call(c, tool_format) for c in message.get("tool_calls") or []]
    body, verbatim = content + "\n".join(calls), True
    if calls and ((server, tool_format) in STRIPS_TEXT_BEFORE_CALLS or not content):
        # Qwen3.6 writes "\n\n" after </think>; the template joins text and first call with
        # "\n\n" (XML) or "\n" (Hermes).
        lead = "\n\n" if thinking else ""
        sep = ("\n\n" if tool_format == "xml" else "\n") if content.strip() else ""
        body = lead + content.strip() + sep + "\n".join(calls)
        verbatim = body == content + "\n".join(calls)
    if not thinking:
        if reasoning:
            raise ValueError("reasoning in a reply generated with thinking off")
        return body, verbatim
    if not body and finish_reason == "length":
        return reasoning or "", verbatim  # cut inside the reasoning: no </think> was written
    return (reasoning or "") + THINK_CLOSE + body, verbatim


def detect_server(choice: dict, message: dict) -> str | None:
    """The server behind a response, from fields only one of them sends."""
    if "matched_stop" in choice or "reasoning_content" in message:
        return "sglang"
    if "stop_reason" in choice or "reasoning" in message:
        return "vllm"
    return None


def history_message(message: dict) -> dict:
    """A request message as the chat template takes it: tool-call arguments as mappings (the
    servers parse the wire's JSON strings before rendering) and vLLM's ``reasoning`` named
    ``reasoning_content``."""
    if message.get("role") != "assistant":
        return message
    message = dict(message)
    if message.get("reasoning") is not None and message.get("reasoning_content") is None:
        message["reasoning_content"] = message.pop("reasoning")
    if message.get("tool_calls"):
        message["tool_calls"] = [{"type": "function", "function": {"name": (c.get("function") or c)["name"],
                                                                 "arguments": _arguments(c.get("function") or c)}}
                                 for c in message["tool_calls"]]
    return message


def split_exchange(raw: dict) -> tuple[dict, dict]:
    """(request, response) of one logged exchange: ``{request, response}``, an OpenAI batch line
    (``{body: request, response: {body: response}}``), or a request with a ``response`` field."""
    if "response" not in raw:
        raise KeyError("response")
    request = raw.get("request") or raw.get("body") or raw
    response = raw["response"]
    if isinstance(response, dict) and "choices" not in response and isinstance(response.get("body"), dict):
        response = response["body"]
    if not isinstance(response, dict) or not response.get("choices"):
        raise ValueError("the response has no choices")
    if "messages" not in request:
        raise KeyError("messages")
    return request, response


def imported_generations(raw: dict, source: dict) -> list[dict]:
    """What the prompts stage keeps of a logged exchange, one entry per choice:
    ``{messages, tools, imported}``; ``imported`` is what ``adopted_record`` needs."""
    request, response = split_exchange(raw)
    kwargs = request.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking", source.get("enable_thinking", True))
    messages = [history_message(m) for m in request["messages"]]
    sampling = {"temperature": request.get("temperature"), "top_p": request.get("top_p"),
                "top_k": request.get("top_k"), "seed": request.get("seed"),
                "max_tokens": request.get("max_tokens", request.get("max_completion_tokens"))}
    out = []
    for choice in response["choices"]:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ValueError(f"choice {choice.get('index', 0)} has no message")
        server = source.get("server", "auto")
        if server == "auto":
            server = detect_server(choice, message)
            if server is None:
                raise ValueError("cannot tell whether SGLang or vLLM answered; set the source's server")
        finish = {"tool_calls": "stop", None: "stop"}.get(choice.get("finish_reason"), choice.get("finish_reason"))
        if finish not in ("stop", "length", "abort"):
            raise ValueError(f"unknown finish_reason {choice.get('finish_reason')!r}")
        prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
        output_ids = choice.get("token_ids") or choice.get("response_token_ids")
        out.append({"messages": messages, "tools": request.get("tools") or None, "imported": {
            "server": server, "tool_format": source.get("tool_format", "xml"), "model": response.get("model") or "",
            "enable_thinking": thinking, "sampling": sampling, "message": message, "finish_reason": finish,
            "usage": response.get("usage") or {}, "prompt_token_ids": prompt_ids, "output_token_ids": output_ids}})
    return out


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a raw generation.

    Split at the first ``</think>``, nothing stripped (as SGLang's qwen3 parser does); with
    thinking on and no ``</think>`` everything is reasoning (a truncated or broken think block).
    """
    if not thinking:
        return None, text
    if THINK_CLOSE not in text:
        return text.removeprefix("<think>"), ""
    reasoning, content = text.split(THINK_CLOSE, 1)
    return reasoning.removeprefix("<think>"), content


def opens_think(prompt: dict, tokenizer) -> bool:
    """Whether the template's generation prompt already opens the think block (Qwen3.5/3.6 do)."""
    from dflash.tokenize import render_prompt

    rendered = render_prompt({**prompt, "generation": {"enable_thinking": True}}, tokenizer)
    return rendered.rstrip("\n").endswith("<think>")


def served_output(prompt: dict, message: dict, thinking: bool, finish_reason: str, server: str, tool_format: str,
                  tokenizer) -> tuple[str, bool]:
    """``rebuild_text`` for a reply to ``prompt``: with a template whose generation prompt stops
    before ``<think>`` (Qwen3 hybrid) the model wrote the tag itself, and both servers' reasoning
    parsers drop it."""
    text, verbatim = rebuild_text(message, thinking, finish_reason, server, tool_format)
    if thinking and text and not opens_think(prompt, tokenizer):
        text = "<think>" + text
    return text, verbatim


def adopted_record(prompt: dict, tokenizer, stop_ids: set[int]) -> dict:
    """The completion record of an imported generation (``prompt["meta"]["imported"]``): with
    token ids, ``text`` is their decoding; without, it is rebuilt from the parsed fields."""
    from dflash.target import output_body  # torch: not for the prompts stage, which imports this module

    imp = prompt["meta"]["imported"]
    thinking = imp["enable_thinking"]
    has_ids = imp["prompt_token_ids"] is not None and imp["output_token_ids"] is not None
    if has_ids:
        out = imp["output_token_ids"]
        text, verbatim = tokenizer.decode(output_body(out, stop_ids), skip_special_tokens=False), True
    else:
        text, verbatim = served_output(prompt, imp["message"], thinking, imp["finish_reason"], imp["server"],
                                       imp["tool_format"], tokenizer)
    reasoning, content = split_reasoning(text, thinking)
    usage = imp["usage"]
    return {"id": prompt["id"], "prompt_id": prompt["id"],
            **{k: prompt[k] for k in ("source", "category", "messages", "tools")},
            "text": text, "reasoning": reasoning, "content": content, "finish_reason": imp["finish_reason"],
            "prompt_token_ids": imp["prompt_token_ids"] if has_ids else None,
            "output_token_ids": imp["output_token_ids"] if has_ids else None,
            "usage": {"prompt_tokens": usage.get("prompt_tokens") or 0,
                      "completion_tokens": usage.get("completion_tokens") or 0},
            "generation": {"backend": "imported", "engine_version": imp["server"], "model": imp["model"],
                           "sampling": imp["sampling"], "enable_thinking": thinking,
                           "reconstructed": not has_ids, "verbatim": verbatim},
            "error": None}


def adopt_files(paths: list[str], out_path, tokenizer, options: dict) -> dict:
    """Logged exchanges (local or ``s3://``) -> one completion shard, without the pipeline: what
    ``dflash adopt`` runs. ``options`` are a chat_completions source's (server, tool_format,
    enable_thinking, category). Returns the counts it logs."""
    from collections import Counter

    from dflash.io import write_jsonl_zst
    from dflash.prompts import read_source
    from dflash.target import stop_token_ids

    stop = stop_token_ids(tokenizer)
    counts = Counter()

    def records():
        for path in paths:
            source = {**options, "name": Path(str(path).rstrip("/")).name.split(".")[0] or "logged",
                      "path": str(path), "format": "chat_completions"}
            for prompt in read_source(source):
                rec = adopted_record(prompt, tokenizer, stop)
                counts["records"] += 1
                counts[f"finish_{rec['finish_reason']}"] += 1
                counts["with_ids"] += not rec["generation"]["reconstructed"]
                counts["whitespace_restored"] += not rec["generation"]["verbatim"]
                yield rec

    write_jsonl_zst(out_path, records())
    return dict(counts)
