"""Generate backends: where a completion comes from. ``transformers`` runs the target in process,
requests decoded in batches (``dflash.generate.decode``); ``openai`` asks any OpenAI-compatible chat
server, its ``dialect`` deciding what is asked for and where the exact token ids come back. Each
request gives a :class:`Generation`."""
from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.core.chat import TokenScreen, finish_reason, output_body, render, served_output, stop_token_ids
from dflash.core.config import completed
from dflash.core.dialects import DIALECTS
from dflash.core.loops import LoopWatch
from dflash.generate.decode import sample_batch
from dflash.target.models import load_target


def resolve_sampling(cfg: dict, generation_config) -> dict:
    """Sampling params from config, unset ones taken from the model's generation_config."""
    s = dict(cfg["sampling"])
    for key in ("temperature", "top_p", "top_k"):
        if s.get(key) is None:
            s[key] = getattr(generation_config, key, None)
    if s["temperature"] is None:
        s["temperature"] = 1.0
    return s


@dataclass
class Generation:
    """What a backend returns for one prompt. Ids are None when the engine does not report them."""

    text: str
    finish_reason: str
    prompt_ids: list[int] | None
    output_ids: list[int] | None
    prompt_tokens: int
    completion_tokens: int
    reconstructed: bool = False  # text rebuilt from parsed server fields, not decoded from ids
    loop: dict | None = None  # {pattern, first_position} when the client cut a looping stream (loop_abort)


class TransformersBackend:
    """In-process generation with a transformers causal LM (the CPU backend), ``batch_size``
    requests decoded together (dflash.generate.decode)."""

    name = "transformers"

    def __init__(self, target_dir: str | Path, cfg: dict, repetition: dict | None = None):
        import transformers  # heavy: the in-process target only

        self.model, self.tokenizer = load_target(target_dir)
        self.token_screen = TokenScreen(self.tokenizer)
        self.model_name = Path(target_dir).name
        self.engine_version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self.stop = stop_token_ids(self.tokenizer, self.model.generation_config)
        cfg = completed(cfg, "generate")
        self.loop_thresholds = repetition if cfg["loop_abort"] else None
        self.batch_size = cfg["batch_size"]

    def generation_config(self):
        return self.model.generation_config

    def generate_batch(self, requests: list[tuple[dict, int]], sampling: dict,
                       thinking: bool) -> list[Generation | Exception]:
        """A Generation for each (prompt, seed), or the exception that stopped it (a conversation
        the template refuses fails alone)."""
        results: list[Generation | Exception | None] = [None] * len(requests)
        rows = []
        for k, (prompt, seed) in enumerate(requests):
            try:
                text = render(prompt["messages"], prompt.get("tools"), self.tokenizer, thinking)
            except ValueError as e:
                results[k] = e
                continue
            rows.append((k, self.tokenizer.encode(text, add_special_tokens=False), seed))
        if not rows:
            return results
        watches = [LoopStop(self.tokenizer, self.loop_thresholds) for _ in rows] if self.loop_thresholds else None
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.stop)
        try:
            decoded = sample_batch(self.model, [ids for _, ids, _ in rows], [seed for *_, seed in rows], sampling,
                                   self.stop, pad, watches,
                                   getattr(self.model.generation_config, "repetition_penalty", None) or 1.0)
        except Exception as e:  # the batch failed as a whole (memory, say): each of its prompts says so
            for k, _, _ in rows:
                results[k] = e
            return results
        for n, ((k, prompt_ids, _), d) in enumerate(zip(rows, decoded)):
            body = output_body(d.ids, self.stop) if d.finish == "stop" else d.ids
            results[k] = Generation(self.tokenizer.decode(body, skip_special_tokens=False), d.finish, prompt_ids,
                                    d.ids, len(prompt_ids), len(d.ids),
                                    loop=watches[n].loop if d.finish == "loop_abort" else None)
        return results

    def generate(self, prompt: dict, sampling: dict, thinking: bool, seed: int) -> Generation:
        (g,) = self.generate_batch([(prompt, seed)], sampling, thinking)
        if isinstance(g, Exception):
            raise g
        return g


class IncrementalText:
    """The text of a growing list of token ids, handed out as deltas whose concatenation is the
    decoding of all ids (as far as it goes): a token ending inside a multi-byte character is held
    back until the character is complete, and each step decodes only the last few tokens, so a
    long stream costs linear time (the usual prefix/read-offset detokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=False)
        now = decode(self.ids[self.prefix:], skip_special_tokens=False)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]


class LoopStop:
    """The loop watch of one decoded row: fed each new token, it says (True) once the row's text is
    certainly looping; ``loop`` is then ``{pattern, first_position}``."""

    def __init__(self, tokenizer, thresholds: dict):
        self.text, self.watch, self.loop = IncrementalText(tokenizer), LoopWatch(**thresholds), None

    def __call__(self, token: int) -> bool:
        if self.watch.feed(self.text.add([token])) and self.loop is None:
            self.loop = {"pattern": self.watch.loop, "first_position": self.watch.first_position}
        return self.loop is not None


class ServerDown(ConnectionError):
    """The server stopped answering: every recent request failed to connect, none succeeded."""


class Unfinished(ConnectionError):
    """A reply that never said the generation finished (no finish reason): a stream that ended
    early (a dropped connection, a killed server, an empty stream), a body cut short of its
    Content-Length, or ``finish_reason: null``. Its
    text is a cut answer, never a ``stop``: the request failed, and is retried like a dropped
    connection."""


class WrongModel(RuntimeError):
    """The server answered with another model than the one asked for: every record of the shard
    would be that model's, so the job stops instead of making error records one by one."""


class OpenAIBackend:
    """Any OpenAI-compatible chat server (SGLang, vLLM, ``transformers serve`` ...), one request
    at a time. The ``dialect`` decides which non-standard fields are sent (servers such as
    ``transformers serve`` refuse unknown ones) and where exact token ids come back. Without ids,
    ``text`` is rebuilt from the parsed reasoning, content and tool calls and the record is marked
    ``generation.reconstructed``.

    With ``stream`` (SSE), the ids come chunk by chunk; given ``repetition`` thresholds (the
    validator's) and ``loop_abort``, the text so far goes through a ``LoopWatch``, and once it is
    certainly looping the client closes the connection, which makes the server abort the request
    (vLLM: ``vllm:generation_tokens_total`` stops growing), and the generation ends as
    ``loop_abort`` with the ids received.

    ``max_connection_failures`` connection failures in a row (over all threads, no reply in
    between) mean the server is gone: every request then ends at once with ``ServerDown`` instead
    of retrying each remaining prompt with backoff (an hour for a 5,000-prompt shard)."""

    name = "openai"

    def __init__(self, target_dir: str | Path, cfg: dict, repetition: dict | None = None):
        from transformers import AutoTokenizer, GenerationConfig  # heavy: not for the in-process target's jobs

        cfg = completed(cfg, "generate")
        server = cfg["server"]
        if not server["url"]:
            raise ValueError("generate.backend 'openai' needs generate.server.url (e.g. http://127.0.0.1:30000/v1), "
                             "or generate.server.launch and a run through Snakemake, which starts the server")
        self.url = server["url"].rstrip("/")
        self.dialect = DIALECTS[server["dialect"]]
        self.timeout = server["timeout_s"]
        self.retries = server["retries"]
        self.extra_body = server["extra_body"]
        self.retries_done = 0
        self.max_failures = server["max_connection_failures"]
        self.failures_in_a_row = 0
        self.lock = threading.Lock()
        self.down = threading.Event()  # set once the server is judged gone; wakes threads in backoff
        self.down_reason = ""
        self.model_name = server["model"] or str(target_dir)
        self.key = key = os.environ.get(server["api_key_env"]) if server["api_key_env"] else None
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.token_screen = TokenScreen(self.tokenizer)
        try:
            self._generation_config = GenerationConfig.from_pretrained(target_dir)
        except OSError:
            self._generation_config = GenerationConfig()
        self.stop = stop_token_ids(self.tokenizer, self._generation_config)
        self.engine_version = f"{self.dialect.name} server at {self.url}"
        stream = server["stream"]
        if stream and not self.dialect.stream_ids:
            streaming = sorted(name for name, d in DIALECTS.items() if d.stream_ids)
            raise ValueError(f"generate.server.stream is true but the {self.dialect.name} dialect's chat stream carries "
                             f"no exact token ids (only {', '.join(streaming)}'s does): set it to null "
                             f"(stream where the ids come with it) or false")
        self.stream = self.dialect.stream_ids if stream is None else stream
        # The LoopWatch thresholds: the validator's, so that an aborted record is one it rejects.
        self.loop_thresholds = repetition if self.stream and cfg["loop_abort"] and repetition else None

    def generation_config(self):
        return self._generation_config

    def redact(self, text: str) -> str:
        """``text`` (a server's error body, say) with the API key blanked out, for logs and records."""
        return text.replace(self.key, "[API key]") if self.key else text

    def _answered(self) -> None:
        with self.lock:
            self.failures_in_a_row = 0

    def _unreachable(self, error: str) -> None:
        with self.lock:
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.max_failures and not self.down.is_set():
                self.down_reason = (f"{self.url}: {self.failures_in_a_row} connection failures in a row and no "
                                    f"reply since (last: {error})")
                self.down.set()

    def _lines(self, response, deadline: float):
        """The reply's lines as they come, until ``deadline``: the socket's read timeout alone lets
        a server that sends something now and then (SSE keep-alive comments, ``: ping``) hold a
        request open as long as it likes."""
        for line in response:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no complete reply within generate.server.timeout_s ({self.timeout:g} s)")
            yield line
        if response.length:  # iteration ends quietly where a reply is cut short of its Content-Length
            raise Unfinished(f"the reply ended {response.length} bytes short of its Content-Length (a dropped "
                             f"connection?)")

    def _read_json(self, response, deadline: float) -> dict:
        raw = b"".join(self._lines(response, deadline))
        self._answered()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"malformed response from {self.url}: not JSON: {self.redact(repr(raw[:200]))}") from None

    def _post(self, body: dict, read):
        """``read(response, deadline)`` of the server's reply to ``body``, with retries; each try
        ends by ``timeout_s`` (its ``deadline``, ``time.monotonic``). A stream cut by a connection
        error, or that ends unfinished, is requested again whole (same seed)."""
        data = json.dumps(body).encode("utf-8")
        for attempt in range(self.retries + 1):
            if self.down.is_set():
                raise ServerDown(self.down_reason)
            request = urllib.request.Request(f"{self.url}/chat/completions", data=data, headers=self.headers)
            try:
                deadline = time.monotonic() + self.timeout
                # Leaving the block closes the connection: how a stream cut for a loop aborts the request.
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return read(response, deadline)
            except urllib.error.HTTPError as e:
                self._answered()
                detail = self.redact(e.read().decode("utf-8", "replace")[:500])
                if e.code not in (408, 429) and e.code < 500 or attempt == self.retries:
                    raise RuntimeError(f"HTTP {e.code} from {self.url}: {detail}") from None
            # http.client.HTTPException: a body cut short (IncompleteRead of a chunked reply)
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
                error = self.redact(str(getattr(e, "reason", e)) or type(e).__name__)
                self._unreachable(error)
                if attempt == self.retries:
                    raise ConnectionError(f"{self.url}: {error}") from None
            self.retries_done += 1  # a plain int: a lost update under threads only blurs a statistic
            if self.down.wait(min(30.0, 2 ** attempt) * (0.5 + random.random())):
                raise ServerDown(self.down_reason)
        raise AssertionError("unreachable")

    def request_body(self, prompt: dict, sampling: dict, thinking: bool, seed: int) -> dict:
        body = {"model": self.model_name, "messages": [self.wire_message(m) for m in prompt["messages"]],
                "max_tokens": sampling["max_tokens"],
                "temperature": sampling["temperature"], "top_p": sampling["top_p"], "seed": seed % 2**31,
                "chat_template_kwargs": {"enable_thinking": thinking}, **self.dialect.id_request,
                **self.extra_body}
        if self.dialect.top_k:
            body["top_k"] = sampling["top_k"]
        if prompt.get("tools"):
            body["tools"] = prompt["tools"]
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def wire_message(self, message: dict) -> dict:
        """A message as the OpenAI API takes it: tool-call arguments as a JSON string (vLLM and SGLang
        parse it back for the template); the reasoning where the dialect reads it."""
        if message["role"] != "assistant":
            return message
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", **call,
                 "function": {**call["function"], "arguments": _json_text(call["function"]["arguments"])}}
                for i, call in enumerate(message["tool_calls"])]
        field = self.dialect.reasoning_field
        if field != "reasoning_content" and message.get("reasoning_content") is not None:
            message[field] = message.pop("reasoning_content")
        return message

    def generate(self, prompt: dict, sampling: dict, thinking: bool, seed: int) -> Generation:
        body = self.request_body(prompt, sampling, thinking, seed)
        # Rendered before the request: the prompt ids a server returns must be these.
        ours = self.tokenizer.encode(render(prompt["messages"], prompt.get("tools"), self.tokenizer, thinking),
                                     add_special_tokens=False) if self.dialect.id_request else None
        if self.stream:
            g = self._post(body, lambda response, deadline: self._read_stream(response, deadline, sampling["max_tokens"]))
        else:
            g = self._post(body, lambda response, deadline: self._reply(self._read_json(response, deadline), prompt,
                                                                         sampling, thinking))
        if ours is not None and g.prompt_ids is not None and g.prompt_ids != ours:
            at = next((i for i, (a, b) in enumerate(zip(g.prompt_ids, ours)) if a != b),
                      min(len(ours), len(g.prompt_ids)))
            raise ValueError(f"the server's prompt ids differ from ours at position {at} (server {len(g.prompt_ids)} "
                             f"ids, ours {len(ours)}): a prompt the server truncated (its max_model_len?) or "
                             f"rendered with another chat template or tokenizer, so the record's ids would not be "
                             f"its conversation")
        return g

    def _same_model(self, reply: dict) -> None:
        """Refuse a reply of another model than the one asked for (a server that does not serve the
        model named in the request may answer with its own)."""
        model = reply.get("model")
        # `transformers serve` names the revision it loaded: "<model>@main"
        if model is not None and model != self.model_name and model.partition("@")[0] != self.model_name:
            raise WrongModel(f"server {self.url} answered with model {model}, asked for {self.model_name}: every "
                             f"record would be another model's; point generate.server.url at the target's server, or "
                             f"set generate.server.model to the name that server gives the target")

    def _in_vocabulary(self, ids: list[int]) -> None:
        """Refuse output ids the target's tokenizer has no token for (decoding drops them silently):
        another model's or tokenizer's output."""
        vocabulary = len(self.tokenizer)
        if (bad := next((i for i in ids if not 0 <= i < vocabulary), None)) is not None:
            raise ValueError(f"output id {bad} outside the target's vocabulary of {vocabulary}: the server runs "
                             f"another model or tokenizer than the target's")

    def _reply(self, response: dict, prompt: dict, sampling: dict, thinking: bool) -> Generation:
        """The generation a whole (non-streamed) reply carries."""
        try:
            choice = response["choices"][0]
            choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"malformed response from {self.url}: {self.redact(json.dumps(response)[:300])}") from None
        self._same_model(response)
        if choice.get("finish_reason") is None:
            raise Unfinished("the reply has finish_reason null: the server never said the generation finished")
        prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
        output_ids = choice.get("token_ids") or choice.get("response_token_ids")
        usage = response.get("usage") or {}
        finish = finish_reason(choice["finish_reason"], sampling["max_tokens"], self.stop, output_ids,
                               usage.get("completion_tokens"))
        if output_ids is not None:
            self._in_vocabulary(output_ids)
            text = self.tokenizer.decode(output_body(output_ids, self.stop), skip_special_tokens=False)
            reconstructed = False
        else:
            text, _ = served_output(prompt, choice["message"], thinking, finish, self.dialect.name, "xml",
                                    self.tokenizer)
            reconstructed = True
        return Generation(text, finish, prompt_ids, output_ids, usage.get("prompt_tokens", len(prompt_ids or [])),
                          usage.get("completion_tokens", len(output_ids or [])), reconstructed)

    def _read_stream(self, response, deadline: float, max_tokens: int) -> Generation:
        """The generation an SSE stream carries: the same one the non-streamed reply would give
        (ids, text decoded from them, finish reason, usage), or, when the LoopWatch finds a loop
        before the stream ends, a ``loop_abort`` with the ids received so far. A stream that ends
        before a chunk gives the finish reason is ``Unfinished``: a kill -9 of the server ends it
        as cleanly as ``[DONE]`` does."""
        watch = so_far = None
        if self.loop_thresholds:
            watch, so_far = LoopWatch(**self.loop_thresholds), IncrementalText(self.tokenizer)
        prompt_ids, output_ids, reported, usage, answered = None, [], None, {}, False
        for line in self._lines(response, deadline):
            if not line.startswith(b"data:"):
                continue  # blank separators, SSE comments
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if not answered:
                self._answered()
                answered = True
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                raise ValueError(f"malformed stream from {self.url}: not JSON: "
                                 f"{self.redact(repr(data[:200]))}") from None
            if "error" in chunk:  # vLLM reports a failure after the 200 as a data line
                raise RuntimeError(f"error in the stream from {self.url}: {self.redact(json.dumps(chunk)[:500])}")
            self._same_model(chunk)
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                self._in_vocabulary(ids)
                output_ids.extend(ids)
                reported = choice.get("finish_reason") or reported
                # A loop seen in the last chunk changes nothing: the generation is over anyway.
                loop = watch.feed(so_far.add(ids)) if watch and ids and not reported else None
                if loop:
                    received = self.tokenizer.decode(output_ids, skip_special_tokens=False)
                    return Generation(received, "loop_abort", prompt_ids, output_ids, len(prompt_ids or []),
                                      len(output_ids), loop={"pattern": loop, "first_position": watch.first_position})
        if reported is None:
            raise Unfinished(f"the stream ended after {len(output_ids)} tokens without a finish reason (a dropped "
                             f"connection, a killed server?): the generation is unfinished")
        if not output_ids and usage.get("completion_tokens"):
            raise ValueError(f"the stream from {self.url} carried no token ids: does the server take "
                             f"return_token_ids (dialect {self.dialect.name})?")
        finish = finish_reason(reported, max_tokens, self.stop, output_ids, usage.get("completion_tokens"))
        text = self.tokenizer.decode(output_body(output_ids, self.stop), skip_special_tokens=False)
        return Generation(text, finish, prompt_ids, output_ids, usage.get("prompt_tokens", len(prompt_ids or [])),
                          usage.get("completion_tokens", len(output_ids)))


def _json_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


BACKENDS = {"transformers": TransformersBackend, "openai": OpenAIBackend}
