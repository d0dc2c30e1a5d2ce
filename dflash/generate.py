"""Generate stage: prompt shard -> completion records (DESIGN.md "completion record").

Backend ``transformers`` runs the target in-process (CPU demo). Every record keeps the exact
prompt and output token ids; ``text`` is the decoding of the output ids without the final stop
token, special tokens kept, so later stages never have to re-tokenize to know what the model saw.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.adopt import adopted_record
from dflash.chat import TokenScreen, finish_reason, output_body, render, served_output, split_reasoning, stop_token_ids
from dflash.config import completed
from dflash.errors import describe
from dflash.io import atomic_files, atomic_path, dumps_line, json_text, naming_full_disk, zst_lines
from dflash.records import checked_records
from dflash.loops import LoopWatch
from dflash.server import wait_for_service
from dflash.storage import PartialMirror
from dflash.toolcalls import parse_tool_calls, text_before_calls
from dflash.workflow import notice, progress

log = logging.getLogger(__name__)


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
    requests decoded together (dflash.decode)."""

    name = "transformers"

    def __init__(self, target_dir: str | Path, cfg: dict, repetition: dict | None = None):
        import transformers

        from dflash.models import load_target

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
        from dflash.decode import sample_batch

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
    ID_REQUESTS = {"openai": {}, "vllm": {"return_token_ids": True, "skip_special_tokens": False},
                   "sglang": {"return_prompt_token_ids": True, "return_token_ids": True, "skip_special_tokens": False}}
    # Dialects whose chat stream carries the exact ids. vLLM 0.32 (vllm/entrypoints/openai/
    # chat_completion/serving.py): with return_token_ids, top-level prompt_token_ids on the first
    # chunk, choices[0].token_ids (the new ids) on every later one, finish_reason on the last,
    # usage in a last choice-less chunk with stream_options.include_usage. SGLang (sgl-project/
    # sglang python/sglang/srt/entrypoints/openai/serving_chat.py at 002897c2, sse_utils.py at
    # 06713058): its stream chunks hold role, content, reasoning_content and logprobs only, and
    # return_prompt_token_ids with stream is refused ("not supported with streaming"), so a
    # streamed SGLang record could not keep its ids. The openai dialect has no ids at all.
    STREAM_IDS = {"vllm"}

    def __init__(self, target_dir: str | Path, cfg: dict, repetition: dict | None = None):
        from transformers import AutoTokenizer, GenerationConfig

        cfg = completed(cfg, "generate")
        server = cfg["server"]
        if not server["url"]:
            raise ValueError("generate.backend 'openai' needs generate.server.url (e.g. http://127.0.0.1:30000/v1), "
                             "or generate.server.launch and a run through Snakemake, which starts the server")
        self.url = server["url"].rstrip("/")
        self.dialect = server["dialect"]
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
        self.engine_version = f"{self.dialect} server at {self.url}"
        stream = server["stream"]
        if stream and self.dialect not in self.STREAM_IDS:
            raise ValueError(f"generate.server.stream is true but the {self.dialect} dialect's chat stream carries no "
                             f"exact token ids (only {', '.join(sorted(self.STREAM_IDS))}'s does): set it to null "
                             f"(stream where the ids come with it) or false")
        self.stream = self.dialect in self.STREAM_IDS if stream is None else stream
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

    def _read_json(self, response) -> dict:
        raw = response.read()
        self._answered()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"malformed response from {self.url}: not JSON: {self.redact(repr(raw[:200]))}") from None

    def _post(self, body: dict, read=None):
        """``read(response)`` of the server's reply to ``body`` (default: its JSON), with retries.
        A stream cut by a connection error is requested again whole (same seed)."""
        read = read or self._read_json
        data = json.dumps(body).encode("utf-8")
        for attempt in range(self.retries + 1):
            if self.down.is_set():
                raise ServerDown(self.down_reason)
            request = urllib.request.Request(f"{self.url}/chat/completions", data=data, headers=self.headers)
            try:
                # Leaving the block closes the connection: how a stream cut for a loop aborts the request.
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return read(response)
            except urllib.error.HTTPError as e:
                self._answered()
                detail = self.redact(e.read().decode("utf-8", "replace")[:500])
                if e.code not in (408, 429) and e.code < 500 or attempt == self.retries:
                    raise RuntimeError(f"HTTP {e.code} from {self.url}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                error = self.redact(str(getattr(e, "reason", e)))
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
                "chat_template_kwargs": {"enable_thinking": thinking}, **self.ID_REQUESTS[self.dialect],
                **self.extra_body}
        if self.dialect != "openai":
            body["top_k"] = sampling["top_k"]
        if prompt.get("tools"):
            body["tools"] = prompt["tools"]
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    def wire_message(self, message: dict) -> dict:
        """A message as the OpenAI API takes it: tool-call arguments as a JSON string (vLLM and SGLang
        parse it back for the template); vLLM reads an earlier turn's reasoning from ``reasoning``."""
        if message["role"] != "assistant":
            return message
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", **call,
                 "function": {**call["function"], "arguments": _json_text(call["function"]["arguments"])}}
                for i, call in enumerate(message["tool_calls"])]
        if self.dialect == "vllm" and message.get("reasoning_content") is not None:
            message["reasoning"] = message.pop("reasoning_content")
        return message

    def generate(self, prompt: dict, sampling: dict, thinking: bool, seed: int) -> Generation:
        body = self.request_body(prompt, sampling, thinking, seed)
        if self.stream:
            return self._post(body, lambda response: self._read_stream(response, sampling["max_tokens"]))
        response = self._post(body)
        try:
            choice = response["choices"][0]
            choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"malformed response from {self.url}: {self.redact(json.dumps(response)[:300])}") from None
        prompt_ids = response.get("prompt_token_ids") or choice.get("prompt_token_ids")
        output_ids = choice.get("token_ids") or choice.get("response_token_ids")
        usage = response.get("usage") or {}
        finish = finish_reason(choice.get("finish_reason"), sampling["max_tokens"], self.stop, output_ids,
                               usage.get("completion_tokens"))
        if output_ids is not None:
            text = self.tokenizer.decode(output_body(output_ids, self.stop), skip_special_tokens=False)
            reconstructed = False
        else:
            server = "vllm" if self.dialect == "vllm" else "sglang"  # a plain OpenAI server strips nothing
            text, _ = served_output(prompt, choice["message"], thinking, finish, server, "xml", self.tokenizer)
            reconstructed = True
        return Generation(text, finish, prompt_ids, output_ids, usage.get("prompt_tokens", len(prompt_ids or [])),
                          usage.get("completion_tokens", len(output_ids or [])), reconstructed)

    def _read_stream(self, response, max_tokens: int) -> Generation:
        """The generation an SSE stream carries: the same one the non-streamed reply would give
        (ids, text decoded from them, finish reason, usage), or, when the LoopWatch finds a loop
        before the stream ends, a ``loop_abort`` with the ids received so far."""
        watch = so_far = None
        if self.loop_thresholds:
            watch, so_far = LoopWatch(**self.loop_thresholds), IncrementalText(self.tokenizer)
        prompt_ids, output_ids, reported, usage, answered = None, [], None, {}, False
        for line in response:
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
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                output_ids.extend(ids)
                reported = choice.get("finish_reason") or reported
                # A loop seen in the last chunk changes nothing: the generation is over anyway.
                loop = watch.feed(so_far.add(ids)) if watch and ids and not reported else None
                if loop:
                    received = self.tokenizer.decode(output_ids, skip_special_tokens=False)
                    return Generation(received, "loop_abort", prompt_ids, output_ids, len(prompt_ids or []),
                                      len(output_ids), loop={"pattern": loop, "first_position": watch.first_position})
        if not output_ids and usage.get("completion_tokens"):
            raise ValueError(f"the stream from {self.url} carried no token ids: does the server take "
                             f"return_token_ids (dialect {self.dialect})?")
        finish = finish_reason(reported, max_tokens, self.stop, output_ids, usage.get("completion_tokens"))
        text = self.tokenizer.decode(output_body(output_ids, self.stop), skip_special_tokens=False)
        return Generation(text, finish, prompt_ids, output_ids, usage.get("prompt_tokens", len(prompt_ids or [])),
                          usage.get("completion_tokens", len(output_ids)))


def _json_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


BACKENDS = {"transformers": TransformersBackend, "openai": OpenAIBackend}


# Past the serve job's own startup timeout, so that its failure report, with the server's log, wins.
SERVICE_GRACE_S = 60


def use_started_server(cfg: dict, service_file: str | Path) -> dict:
    """``cfg`` pointed at the server the pipeline started (``generate.server.launch``), once its
    service file says it is ready; its failure as an error when it failed."""
    server = cfg["server"]
    info = wait_for_service(service_file, server["launch"]["startup_timeout_s"] + SERVICE_GRACE_S)
    return {**cfg, "server": {**server, "url": info["url"], "model": info["model"]}}


def sample_seed(base: int, prompt_id: str, step: int = 0) -> int:
    """Per-sample seed: the same sample draws the same tokens whatever shard it lands in."""
    return (base * 1_000_003 + int(prompt_id[:12], 16) + step) % (2**63)


def attempt(backend, prompt: dict, sampling: dict, thinking: bool, step: int = 0) -> Generation | Exception:
    """One request to ``backend``, or the exception that failed it; a server that stopped answering
    is raised: no prompt can succeed, the job stops."""
    try:
        return backend.generate(prompt, sampling, thinking, sample_seed(sampling["seed"], prompt["id"], step))
    except ServerDown:
        raise
    except Exception as e:  # one bad prompt must not cost the shard: it becomes an error record
        return e


def completion_record(prompt: dict, backend, sampling: dict, thinking: bool, step: int,
                      g: Generation | Exception) -> dict:
    """The record of generation ``g`` for ``prompt["messages"]`` (an error record when ``g`` is the
    exception that failed it); step N > 0 of a replayed conversation gets id ``-gN``."""
    base = {k: prompt[k] for k in ("source", "category", "messages", "tools")}
    record = {"id": f"{prompt['id']}-g{step}" if step else prompt["id"], "prompt_id": prompt["id"], **base}
    generation = {"backend": backend.name, "engine_version": backend.engine_version, "model": backend.model_name,
                  "sampling": sampling, "enable_thinking": thinking}
    if isinstance(g, Exception):
        log.warning("prompt %s failed: %s: %s", record["id"], type(g).__name__, g)
        return {**record, "text": "", "reasoning": None, "content": "", "finish_reason": "error",
                "prompt_token_ids": None, "output_token_ids": None,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0},
                "generation": generation, "error": f"{type(g).__name__}: {g}"}
    if g.reconstructed:
        generation["reconstructed"] = True
    if g.loop:
        generation["loop"] = g.loop
        generation["max_tokens_saved"] = sampling["max_tokens"] - g.completion_tokens
    reasoning, content = split_reasoning(g.text, thinking)
    return {**record, "text": g.text, "reasoning": reasoning, "content": content, "finish_reason": g.finish_reason,
            "prompt_token_ids": g.prompt_ids, "output_token_ids": g.output_ids,
            "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens},
            "generation": generation, "error": None}


def replay_stop(rec: dict, step: dict | None) -> tuple[str | None, str | None]:
    """(reason code, detail) why a replayed conversation ends after ``rec``; (None, None) when the
    model called exactly the tools of the source's next ``step``, whose cached results come next."""
    if rec["finish_reason"] != "stop":
        return f"finish_{rec['finish_reason']}", f"the generation ended with finish_reason {rec['finish_reason']}"
    calls = [c["name"] for c in parse_tool_calls(rec["content"])]
    if step is None:
        if calls:
            return "extra_call", f"called {', '.join(calls)} after the last cached result"
        return "completed", None
    expected = step["calls"]
    if not calls:
        return "no_call", f"answered without a tool call; the source called {', '.join(expected)}"
    if len(calls) > len(expected):
        return "parallel_calls", f"called {', '.join(calls)}; the source called {', '.join(expected)}"
    if calls != expected:
        return "other_tool", f"called {', '.join(calls)}; the source called {', '.join(expected)}"
    return None, None


def assistant_turn(rec: dict) -> dict:
    """The model's generation as a chat message, for the template to render into the next prompt."""
    calls = parse_tool_calls(rec["content"])
    turn = {"role": "assistant", "content": text_before_calls(rec["content"]),
            "tool_calls": [{"type": "function", "function": c} for c in calls]}
    if rec["reasoning"] is not None:
        turn["reasoning_content"] = rec["reasoning"]
    return turn


def conversation(prompt: dict, token_screen: TokenScreen, thinking: bool):
    """The completion records of one prompt, as a generator: it yields each ``(prompt, step)`` to
    generate, is sent that generation's completion record, and returns the records: one, or for a
    prompt with ``meta.replay`` one per assistant generation while the model calls the tools whose
    cached results come next.

    Each replayed record has ``replay = {step, steps, stop, detail}``; ``stop`` is set on the last
    one (``completed`` or the mismatch: ``no_call``, ``other_tool``, ``parallel_calls``,
    ``extra_call``, ``finish_<reason>``, ``special_tokens``).
    """
    steps = prompt.get("meta", {}).get("replay") or []
    rec = yield prompt, 0
    if not steps:
        return [rec]
    records = []
    for n in range(len(steps) + 1):
        if n:
            rec = yield prompt, n
        stop, detail = replay_stop(rec, steps[n] if n < len(steps) else None)
        if stop is None and (forged := token_screen.found([assistant_turn(rec)], None, thinking)):
            # the next prompt would encode it as a real control token: a turn the model never ended
            stop, detail = "special_tokens", f"a control token as text in the model's turn ({forged})"
        rec["replay"] = {"step": n, "steps": len(steps), "stop": stop, "detail": detail}
        records.append(rec)
        if stop:
            return records
        prompt = {**prompt, "messages": prompt["messages"] + [assistant_turn(rec), *steps[n]["results"]]}
    raise AssertionError("unreachable: the last step always stops")


def generate_conversation(prompt: dict, backend, sampling: dict, thinking: bool) -> list[dict]:
    """The completion records of one prompt (:func:`conversation`), one request at a time."""
    talk = conversation(prompt, backend.token_screen, thinking)
    prompt, step = next(talk)
    while True:
        rec = completion_record(prompt, backend, sampling, thinking, step,
                                attempt(backend, prompt, sampling, thinking, step))
        try:
            prompt, step = talk.send(rec)
        except StopIteration as done:
            return done.value


def generate_batched(prompts: list[dict], backend: TransformersBackend, sampling: dict, thinking: bool, finish) -> None:
    """The conversations of ``prompts`` (:func:`conversation`), their requests decoded
    ``backend.batch_size`` at a time: a batch holds the next request of each conversation under
    way, topped up with new prompts. ``finish(records)`` gets each prompt's records once done."""
    waiting, talks = iter(prompts), {}  # conversation -> its next (prompt, step)
    while True:
        while len(talks) < backend.batch_size and (prompt := next(waiting, None)) is not None:
            talk = conversation(prompt, backend.token_screen, thinking)
            talks[talk] = next(talk)
        if not talks:
            return
        batch = list(talks.items())
        results = backend.generate_batch([(p, sample_seed(sampling["seed"], p["id"], step)) for _, (p, step) in batch],
                                         sampling, thinking)
        for (talk, (p, step)), g in zip(batch, results):
            try:
                talks[talk] = talk.send(completion_record(p, backend, sampling, thinking, step, g))
            except StopIteration as done:
                del talks[talk]
                finish(done.value)


def generate_pending(prompts: list[dict], backend, cfg: dict, sampling: dict, thinking: bool, finish) -> None:
    """Each prompt's records, handed to ``finish`` as its conversation ends: in batches in process,
    else one request at a time or ``server.concurrency`` of them in flight."""
    if cfg["backend"] == "transformers":
        generate_batched(prompts, backend, sampling, thinking, finish)
    elif (concurrency := cfg["server"]["concurrency"]) == 1:
        for prompt in prompts:
            finish(generate_conversation(prompt, backend, sampling, thinking))
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(generate_conversation, p, backend, sampling, thinking) for p in prompts]
            try:
                for future in as_completed(futures):
                    finish(future.result())
            finally:
                pool.shutdown(cancel_futures=True)


def settings_digest(cfg: dict, target_dir: str | Path) -> str:
    """What decides a shard's records, as one short digest each record carries: the settings that
    shape them (``workflow.record_settings``) and the model that writes them. A resumed shard keeps
    only records of the same digest, so a re-run with another model or sampling never mixes the two."""
    from dflash.workflow import record_settings

    model = ((cfg.get("server") or {}).get("model") or str(target_dir)) if cfg["backend"] == "openai" \
        else os.path.abspath(target_dir)
    blob = json.dumps({"records": record_settings(cfg), "model": model}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def partial_path(out_path: str | Path) -> Path:
    """Where finished records of an unfinished shard accumulate: beside the output, never
    mistaken for it, and not a Snakemake output (so a failed job does not delete it)."""
    out_path = Path(out_path)
    return out_path.with_name(f".{out_path.name}.partial.jsonl")


@contextlib.contextmanager
def shard_lock(out_path: Path, poll_s: float = 5.0):
    """Hold the shard's lock file while writing it. A job left running by a killed snakemake (its
    SLURM job lives on) and its re-run would both append to the partial file: the re-run waits
    here until the first one ends. Needs flock on the shared file system (NFSv4; Lustre mounted
    with -o flock); where it has none, the job goes on with a warning."""
    lock = Path(out_path).with_name(f".{Path(out_path).name}.lock")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another job is writing this shard (an earlier run's job still running?); "
                        "waiting for it to end", out_path)
            while True:
                time.sleep(poll_s)
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    continue
            log.info("%s: the other job ended; going on from what it left", out_path)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            log.warning("%s: no file locks on this file system (%s): run one job per shard at a time", lock, e)
        yield


def keep_finished_output(out_path: Path, partial: Path) -> None:
    """A shard file already there (an earlier job finished it after Snakemake had cleared the
    outputs for this one, or a CLI run onto an existing output): its good records join the
    partial file, where ``load_partial`` keeps those of this run's settings, so none is generated
    twice and none of other settings is kept."""
    if not out_path.exists():
        return
    # read whole before anything is written: a file that is no completion shard (an --out slip onto
    # a user's file) is refused as it stands, never taken apart
    kept = "".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in checked_records(
        out_path, "completion", f"{out_path} is there already and is not a completion shard this stage wrote: give "
                                f"--out a path of its own") if r["finish_reason"] != "error")
    with naming_full_disk(partial), open(partial, "a", encoding="utf-8") as sink:
        sink.write(kept)
    out_path.unlink()


def finished(records: list[dict]) -> bool:
    """A prompt's records are complete: its single generation, or a replay whose last record stops."""
    return bool(records) and ("replay" not in records[-1] or records[-1]["replay"]["stop"] is not None)


def load_partial(path: Path, wanted: set[str], settings: str) -> dict[str, list[dict]]:
    """Finished prompts of an interrupted run (prompt id -> records), rewritten clean: a line torn
    by a kill is dropped (appending after it would corrupt the next record), as are a replay cut
    short by it, ids not in this shard, a second copy of a record (an earlier job killed between
    writing its shard and removing this file) and records generated with other settings or
    another model (``settings``: ``settings_digest``), said in the log and on the console."""
    found: dict[str, list[dict]] = {}
    seen: set[str] = set()
    other = set()
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict) or rec.get("prompt_id") not in wanted or rec.get("id") in seen:
                continue  # a record kept twice counts once
            if (rec.get("generation") or {}).get("settings") != settings:
                other.add(rec["prompt_id"])
                continue
            seen.add(rec["id"])
            found.setdefault(rec["prompt_id"], []).append(rec)
    if other:
        notice(log, f"{path}: {len(other)} finished prompt(s) were generated with other generate settings or "
                    f"another model than this run's; they are dropped and generated again")
    done = {pid: recs for pid, recs in found.items() if finished(recs)}
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for recs in done.values() for r in recs),
                       encoding="utf-8")
    return done


def generate_shard(prompts_path: Path, out_path: Path, target_dir: Path, cfg: dict,
                   summary_path: Path | None = None, pilot: Path | None = None, annotate=None,
                   repetition: dict | None = None) -> dict:
    """Generate the completion records of every prompt of the shard, resumably; returns a summary.

    Each prompt's records are appended (and flushed) to the partial file once all are finished; a
    re-run skips the prompts already there. Failed prompts are not kept there, so a re-run retries
    them. The shard and its summary appear only when every prompt id has exactly one set of
    records; more failed prompts than ``max_error_fraction``, or a server that stopped answering,
    fail the job instead (finished ones stay for the re-run). ``pilot``: the pilot's completions,
    whose records of this shard's prompts are taken as they are. ``annotate(summary)``: fields
    added to the summary (the run's spend so far). ``repetition``: validate.repetition, the
    thresholds of the loop watch of a streamed generation (``generate.loop_abort``); None: no watch.
    """
    cfg = completed(cfg, "generate")
    prompts = [rec for _, rec in checked_records(prompts_path, "prompt", "generate reads the prompts/ shards of the "
                                                                         "prompts stage")]
    ids = [p["id"] for p in prompts]
    twice = [i for i, n in Counter(ids).items() if n > 1]
    if twice:
        raise ValueError(f"{prompts_path}: prompt id {twice[0]} appears more than once ({len(twice)} duplicated ids); "
                         f"every prompt id must be unique: re-run the prompts rule")
    partial = partial_path(out_path)
    partial.parent.mkdir(parents=True, exist_ok=True)  # as every stage does: the lock and resume files go there first
    save = cfg["save_every"]
    mirror = PartialMirror(partial, save["records"], save["seconds"])
    with shard_lock(out_path):
        keep_finished_output(Path(out_path), partial)
        mirror.fetch()  # a run on another machine that the node it ran on did not outlive
        from_pilot = seed_from_pilot(partial, pilot, set(ids))
        return _generate_shard(prompts, ids, prompts_path, out_path, partial, target_dir, cfg, summary_path, mirror,
                               from_pilot, annotate, repetition)


def generate_job(config: dict, prompts_path: Path, out_path: Path, target_dir: Path, summary_path: Path | None,
                 pilot: Path | None = None, server: Path | None = None) -> dict:
    """One generate job as the rule and ``dflash generate`` run it: the server the job's group
    started (``server``: its service file), the run's budget (``dflash.budget.budget_watch``), then
    the shard, its streams watched for loops with the validator's thresholds."""
    from dflash.budget import budget_watch

    cfg = use_started_server(config["generate"], server) if server else config["generate"]
    annotate = budget_watch(config, summary_path, pilot, prompts_path)
    return generate_shard(prompts_path, out_path, target_dir, cfg, summary_path, pilot=pilot, annotate=annotate,
                          repetition=config["validate"]["repetition"])


def seed_from_pilot(partial: Path, pilot: Path | None, ids: set[str]) -> set[str]:
    """Add the pilot's finished records of these prompts to the resume file (load_partial drops a
    record already there); the prompt ids taken from the pilot."""
    from dflash.pilot import pilot_records

    found = {pid: recs for pid, recs in pilot_records(pilot, ids).items() if finished(recs)}
    if found:
        with naming_full_disk(partial), open(partial, "a", encoding="utf-8") as sink:
            sink.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for recs in found.values() for r in recs))
    return set(found)


def _generate_shard(prompts: list[dict], ids: list[str], prompts_path: Path, out_path: Path, partial: Path,
                    target_dir: Path, cfg: dict, summary_path: Path | None, mirror: PartialMirror,
                    from_pilot: set[str], annotate, repetition: dict | None) -> dict:
    settings = settings_digest(cfg, target_dir)
    done = load_partial(partial, set(ids), settings)
    resumed = len(done.keys() - from_pilot)
    pending = [p for p in prompts if p["id"] not in done]
    adopted = [p for p in pending if "imported" in p.get("meta", {})]
    pending = [p for p in pending if "imported" not in p.get("meta", {})]
    # A shard of imported generations needs no model and no server, only the tokenizer.
    backend = BACKENDS[cfg["backend"]](target_dir, cfg, repetition) if pending else None
    sampling = resolve_sampling(cfg, backend.generation_config()) if pending else None
    thinking = cfg["enable_thinking"]
    name = Path(prompts_path).name
    if done:
        log.info("generate %s: resuming, %d of %d prompts already finished", name, len(done), len(prompts))
    t0 = time.time()
    errors: dict[str, list[dict]] = {}
    requests = tokens = 0
    bar = progress(total=len(pending) + len(adopted), desc=f"generate {name}", unit="prompt")
    with naming_full_disk(partial), open(partial, "a", encoding="utf-8") as sink:
        def finish(recs: list[dict]) -> None:
            nonlocal requests, tokens
            requests += len(recs)
            for r in recs:
                r["generation"]["settings"] = settings
            if any(r["finish_reason"] == "error" for r in recs):
                errors[recs[0]["prompt_id"]] = recs
            else:
                sink.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
                sink.flush()
                mirror.added(len(recs))
                done[recs[0]["prompt_id"]] = recs
                tokens += sum(r["usage"]["completion_tokens"] for r in recs)
            bar.update()
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}", errors=len(errors), refresh=False)

        if adopted:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target_dir)
            stop = stop_token_ids(tokenizer)
            for prompt in adopted:
                try:
                    rec = adopted_record(prompt, tokenizer, stop)
                except Exception as e:  # the template refusing the request, say: name the logged line
                    raise ValueError(f"adopted record {prompt['id']} (source {prompt['source']}, line "
                                     f"{prompt['meta']['index'] + 1}): {describe(e)}") from None
                finish([rec])
        try:
            if pending:
                generate_pending(pending, backend, cfg, sampling, thinking, finish)
        except ServerDown as e:
            bar.close()
            mirror.push()
            raise ServerDown(f"{e}: is the server down? The {len(done)} finished prompts of {name} are kept in "
                             f"{partial}: start the server and re-run to resume") from None
    bar.close()
    seconds = time.time() - t0
    records = [r for i in ids for r in (done.get(i) or errors[i])]
    aborted = [r for r in records if r["finish_reason"] == "loop_abort"]
    summary = {
        "shard": name,
        "prompts": len(prompts),
        "records": len(records),
        "resumed": resumed,
        "from_pilot": len(from_pilot),
        "requests": requests - len(adopted),
        "adopted": len(adopted),
        "retries": getattr(backend, "retries_done", 0),
        "errors": len(errors),
        "finish_reasons": {r: sum(x["finish_reason"] == r for x in records)
                           for r in ("stop", "length", "abort", "loop_abort", "error")},
        # Streams cut for a loop: the tokens they had produced, and those their max_tokens would have added.
        "loop_aborts": {"records": len(aborted),
                        "tokens_received": sum(r["usage"]["completion_tokens"] for r in aborted),
                        "tokens_saved": sum(r["generation"]["max_tokens_saved"] for r in aborted)},
        "replay_stops": dict(Counter(r["replay"]["stop"] for r in records if r.get("replay", {}).get("stop"))),
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "started_at": round(t0, 1),  # epoch seconds: when the shard's generation ran, for what it cost
        "output_tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
    }
    if annotate:
        summary.update(annotate(summary))
    log.info("generate %s: %s", name, summary)
    if len(errors) > cfg["max_error_fraction"] * len(prompts):
        mirror.push()
        example = next(r["error"] for recs in errors.values() for r in recs if r["error"])
        raise RuntimeError(f"{name}: {len(errors)} of {len(prompts)} prompts failed (e.g. {example}); "
                           f"the {len(done)} finished ones are kept in {partial}: re-run to resume")
    # Only beside a finished shard, and only with it: a failed job's summary would read like one.
    with atomic_files(out_path, *([summary_path] if summary_path is not None else [])) as temps:
        with zst_lines(temps[0], shown=out_path) as write:
            for rec in records:
                write(dumps_line(rec))
        if summary_path is not None:
            with naming_full_disk(summary_path):
                temps[1].write_text(json_text(summary), encoding="utf-8")
    partial.unlink()
    # Until Snakemake has uploaded the shard, a lost node costs this shard's generation, never a
    # duplicate: a stale resume file would resume a later re-run with other settings.
    mirror.discard()
    return summary
