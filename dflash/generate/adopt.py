"""Adopting completions a server already produced: chat-completion request/response pairs become
completion records, so paid-for generations are not generated again.

The prompts stage reads the logged exchanges (``format: chat_completions``) into prompt records
with ``meta.imported``; the generate job turns each into a completion record here, without a model
or a server. A response that carries token ids (SGLang ``return_token_ids``, vLLM
``return_token_ids``) keeps them and its text is their decoding; otherwise ``text`` is rebuilt from
the parsed fields (``chat.served_output``, which says how exact that is).
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from dflash.core.chat import finish_reason, output_body, served_output, stop_token_ids
from dflash.core.io import write_jsonl_zst
from dflash.core.records import make_completion
from dflash.prompts.stage import read_source


def adopted_record(prompt: dict, tokenizer, stop_ids: set[int]) -> dict:
    """The completion record of an imported generation (``prompt["meta"]["imported"]``): with
    token ids, ``text`` is their decoding; without, it is rebuilt from the parsed fields."""
    imp = prompt["meta"]["imported"]
    thinking = imp["enable_thinking"]
    has_ids = imp["prompt_token_ids"] is not None and imp["output_token_ids"] is not None
    usage = imp["usage"]
    finish = finish_reason(imp["finish_reason"], imp["sampling"]["max_tokens"], stop_ids,
                           imp["output_token_ids"] if has_ids else None, usage.get("completion_tokens"))
    generation = {"backend": "imported", "engine_version": imp["server"], "model": imp["model"],
                  "sampling": imp["sampling"], "enable_thinking": thinking, "reconstructed": not has_ids}
    if imp["finish_reason"] is None and finish == "stop" and not (has_ids and imp["output_token_ids"]
                                                                   and imp["output_token_ids"][-1] in stop_ids):
        # chat.finish_reason reads a missing reason as stop; only a stop token proves one here
        return make_completion(prompt, "", "error", generation, error=(
            "ValueError: the logged reply has finish_reason null and no stop token ends its output: an unfinished "
            "generation (a dropped stream?), never a stop record; drop its line from the log, or raise "
            "generate.max_error_fraction to keep the shard's other records"))
    if has_ids:
        out = imp["output_token_ids"]
        text, verbatim = tokenizer.decode(output_body(out, stop_ids), skip_special_tokens=False), True
    else:
        text, verbatim = served_output(prompt, imp["message"], thinking, finish, imp["server"], imp["tool_format"],
                                       tokenizer)
    generation["verbatim"] = verbatim
    return make_completion(prompt, text, finish, generation,
                           token_ids=(imp["prompt_token_ids"], imp["output_token_ids"]) if has_ids else (None, None),
                           usage=(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0))


def adopt_files(paths: list[str], out_path, tokenizer, options: dict) -> dict:
    """Logged exchanges (local or ``s3://``) -> one completion shard, without the pipeline: what
    ``dflash adopt`` runs. ``options`` are a chat_completions source's (server, tool_format,
    enable_thinking, category). Returns the counts it logs."""
    stop = stop_token_ids(tokenizer)
    counts = Counter()

    def records():
        for path in paths:
            source = {**options, "name": Path(str(path).rstrip("/")).name.split(".")[0] or "logged",
                      "path": str(path), "format": "chat_completions"}
            for prompt in read_source(source, counts):
                rec = adopted_record(prompt, tokenizer, stop)
                counts["records"] += 1
                counts[f"finish_{rec['finish_reason']}"] += 1
                counts["with_ids"] += not rec["generation"]["reconstructed"]
                counts["whitespace_restored"] += rec["generation"].get("verbatim") is False  # (none: an error)
                yield rec

    write_jsonl_zst(out_path, records())
    return dict(counts)


def adopt_command(logs: list[str], target: Path, out: Path, options: dict) -> None:
    """``dflash adopt``: logged exchanges into one completion shard, and what they held, counted."""
    from transformers import AutoTokenizer  # heavy: only the command that reads a tokenizer pays for it

    counts = adopt_files(logs, out, AutoTokenizer.from_pretrained(target), options)
    print(f"{out}: {counts.get('records', 0)} completion records; "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "records"), file=sys.stderr)
