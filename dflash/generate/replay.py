"""A prompt's conversation with the backend: one request, or for a prompt with ``meta.replay`` a
replayed tool conversation (the model's turn, the source's cached tool results, the next turn) while
the model calls the tools whose results come next; each generation becomes a completion record."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor, as_completed

from dflash.core.chat import TokenScreen
from dflash.core.records import make_completion
from dflash.core.toolcalls import parse_tool_calls, text_before_calls
from dflash.generate.backends import Generation, ServerDown, TransformersBackend, WrongModel

log = logging.getLogger(__name__)


def sample_seed(base: int, prompt_id: str, step: int = 0) -> int:
    """Per-sample seed: the same sample draws the same tokens whatever shard it lands in."""
    return (base * 1_000_003 + int(prompt_id[:12], 16) + step) % (2**63)


def attempt(backend, prompt: dict, sampling: dict, thinking: bool, step: int = 0) -> Generation | Exception:
    """One request to ``backend``, or the exception that failed it; a server that stopped answering
    or answers as another model is raised: no prompt can succeed, the job stops."""
    try:
        return backend.generate(prompt, sampling, thinking, sample_seed(sampling["seed"], prompt["id"], step))
    except ServerDown:
        raise
    except WrongModel as e:
        raise WrongModel(f"record {prompt['id']}{f'-g{step}' if step else ''}: {e}") from None
    except Exception as e:  # one bad prompt must not cost the shard: it becomes an error record
        return e


def completion_record(prompt: dict, backend, sampling: dict, thinking: bool, step: int,
                      g: Generation | Exception) -> dict:
    """The record of generation ``g`` for ``prompt["messages"]`` (an error record when ``g`` is the
    exception that failed it); step N > 0 of a replayed conversation gets id ``-gN``."""
    generation = {"backend": backend.name, "engine_version": backend.engine_version, "model": backend.model_name,
                  "sampling": sampling, "enable_thinking": thinking}
    if isinstance(g, Exception):
        record = make_completion(prompt, "", "error", generation, step=step, error=f"{type(g).__name__}: {g}")
        log.warning("prompt %s failed: %s: %s", record["id"], type(g).__name__, g)
        return record
    if g.reconstructed:
        generation["reconstructed"] = True
    if g.loop:
        generation["loop"] = g.loop
        generation["max_tokens_saved"] = sampling["max_tokens"] - g.completion_tokens
    return make_completion(prompt, g.text, g.finish_reason, generation, step=step,
                           token_ids=(g.prompt_ids, g.output_ids), usage=(g.prompt_tokens, g.completion_tokens))


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
