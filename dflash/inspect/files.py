"""``dflash inspect``: records of any stage's shard, readable in a terminal or as JSON lines.

Reads prompt, completion, validated and rejected shards (``.jsonl[.zst]``), tokenized shards
(``.safetensors`` with their ``.json`` index beside) and hidden-state shards, local or ``s3://``;
and the eval's report (``eval/<run>.json``): its figures per category.
"""
from __future__ import annotations

import json
import posixpath
import shutil
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterator

from dflash.core.config import defaults
from dflash.core.io import check_zstd, iter_jsonl, read_json
from dflash.core.reasons import EXCLUDED
from dflash.core.storage import folder_files, local_copy
from dflash.core.tensors import open_safetensors
from dflash.core.vocabulary import CATEGORIES, terminal_safe

# What a record is whole from its head (a JSONL record is its own head).
Entry = tuple[dict, Callable[[], dict]]


def _tensor_rows(path: Path, index_path: Path | None) -> Iterator[Entry]:
    """(index entry, its row) of a tokenized or hidden-state shard: a row is sliced from the file
    only when it is shown, so matching and counting read the index alone."""
    index = read_json(index_path)["rows"] if index_path else None
    with open_safetensors(path, ("input_ids", "offsets"), "a tokenized or hidden-state shard") as f:
        meta = f.metadata() or {}
        offsets = f.get_tensor("offsets").tolist()
        names = set(f.keys())
        if index is not None and len(index) != len(offsets) - 1:
            raise ValueError(f"{index_path}: {len(index)} rows listed, {path} has {len(offsets) - 1}: the two are "
                             f"from different runs; re-run the rules that write them")

        def row(head: dict, a: int, b: int) -> dict:
            rec = {**head, "input_ids": f.get_slice("input_ids")[a:b].tolist()}
            if "loss_mask" in names:
                rec["loss_mask"] = f.get_slice("loss_mask")[a:b].tolist()
            if "hidden_states" in names:
                h = f.get_slice("hidden_states")[a:b].float()
                rec["hidden"] = {"shape": list(h.shape), "dtype": meta.get("dtype"),
                                 "target_layer_ids": json.loads(meta.get("target_layer_ids", "[]")),
                                 "rms_per_layer": [round(x, 4) for x in h.pow(2).mean(dim=(0, 2)).sqrt().tolist()]}
            return rec

        for n, (a, b) in enumerate(zip(offsets, offsets[1:])):
            head = {"row": n, **(index[n] if index else {})}
            yield head, lambda head=head, a=a, b=b: row(head, a, b)


def not_jsonl(path: str, local: Path) -> str | None:
    """Why a file is no shard inspect can read, when it is a JSON document rather than records."""
    with open(local, "rb") as f:
        first = f.read(64).lstrip()
    if not (local.suffix == ".json" or first[:1] == b"[" or first.startswith(b"{\n")):
        return None
    beside = str(path)[: -len(".json")] + ".safetensors" if str(path).endswith(".json") else None
    hint = (f" (the rows of this tokenized shard are in {beside})" if beside and Path(beside).exists()
            else f"; read it with `python -m json.tool {path}`")
    return f"{path}: a JSON document, not JSONL records: inspect reads shards (.jsonl.zst, .jsonl, .safetensors){hint}"


SHARD_SUFFIXES = (".jsonl.zst", ".jsonl", ".safetensors")


def shards_of(path: str) -> list[str]:
    """``path`` itself, or the shards a local folder holds (a stage's output folder), sorted."""
    if not Path(path).is_dir():
        return [path]
    shards = folder_files(path, lambda name: name.endswith(SHARD_SUFFIXES))
    if not shards:
        raise ValueError(f"{path}: a folder with no shards ({', '.join(SHARD_SUFFIXES)}) in it: give a stage's "
                         f"output folder (results/validated) or its shards")
    return shards


def read_entries(path: str) -> Iterator[Entry]:
    """(head, whole record) of every record of a shard; a tensor shard's rows with their index
    entries. A zstd shard is checked to its end first: a cut one prints nothing."""
    with ExitStack() as stack:
        local = stack.enter_context(local_copy(path))
        if local.suffix != ".safetensors":
            problem = not_jsonl(path, local)
            if problem:
                raise ValueError(problem)
            if local.suffix == ".zst":
                check_zstd(local)
            for rec in iter_jsonl(local):
                yield rec, lambda rec=rec: rec
            return
        # The rows' index: beside a tokenized shard; a hidden-state shard has its tokenized shard's.
        # posixpath, not Path: it keeps the "//" of s3:// URLs.
        stem = str(path)[: -len(".safetensors")]
        stage_dir = posixpath.dirname(posixpath.dirname(stem))
        index_local = None
        for index in (f"{stem}.json", posixpath.join(stage_dir, "tokenized", posixpath.basename(stem) + ".json")):
            try:
                index_local = stack.enter_context(local_copy(index))
                break
            except FileNotFoundError:
                continue
        yield from _tensor_rows(local, index_local)


def matches(rec: dict, categories: list[str], reasons: list[str], flags: list[str], ids: list[str]) -> bool:
    qa = rec.get("qa") or {}
    return ((not categories or rec.get("category") in categories)
            and (not reasons or bool(set(reasons) & set(qa.get("reasons", []))))
            and (not flags or bool(set(flags) & set(qa.get("flags", []) + (rec.get("meta") or {}).get("flags", []))))
            and (not ids or rec.get("id") in ids or rec.get("prompt_id") in ids))


def _block(title: str, text: str, limit: int | None) -> list[str]:
    if limit and len(text) > limit:
        cut = len(text) - limit
        text = f"{text[: limit // 2]}\n[... {cut} characters left out; --full shows all ...]\n{text[-limit // 2:]}"
    width = shutil.get_terminal_size((100, 24)).columns - 4
    body = [wrapped for line in text.split("\n") for wrapped in (textwrap.wrap(line, width, replace_whitespace=False,
                                                                               drop_whitespace=False) or [""])]
    return [f"  {title}:"] + [f"    {line}" for line in body]


def render(rec: dict, limit: int | None = 1200, tokenizer=None) -> str:
    """One record as a few labelled blocks: header, prompt, reasoning, answer, calls, QA."""
    qa = rec.get("qa") or {}
    head = [rec.get("id", f"row {rec.get('row')}"), f"[{rec.get('category', '?')}]"]
    if rec.get("source"):
        head.append(rec["source"])
    if rec.get("finish_reason"):
        head.append(f"finish={rec['finish_reason']}")
    if rec.get("usage"):
        u = rec["usage"]
        head.append(f"tokens={u['prompt_tokens']}+{u['completion_tokens']}" if u.get("prompt_tokens") is not None
                    else f"output tokens={u.get('completion_tokens')}")
    if qa.get("reasons"):
        head.append("REJECTED: " + ", ".join(qa["reasons"]))
    if qa.get("flags"):
        head.append("flags: " + ", ".join(qa["flags"]))
    lines = ["── " + "  ".join(head)]
    if rec.get("tools"):
        lines.append("  tools offered: " + ", ".join(t["function"]["name"] for t in rec["tools"]))
    messages = rec.get("messages") or []
    for m in messages[-2:] if "text" in rec else messages:  # a completion: the turn it answers
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content += "\n" + "\n".join(json.dumps(c.get("function", c), ensure_ascii=False) for c in m["tool_calls"])
        lines += _block(m["role"], content, limit)
    for step, r in enumerate((rec.get("meta") or {}).get("replay") or [], 1):
        lines.append(f"  replay step {step}: " + ", ".join(c["name"] for c in r["calls"]))
    if rec.get("reasoning") is not None:
        lines += _block(f"reasoning ({len(rec['reasoning'])} chars)", rec["reasoning"], limit)
    if "content" in rec:
        lines += _block(f"answer ({len(rec['content'] or '')} chars)", rec["content"] or "", limit)
    elif "text" in rec:
        lines += _block("text", rec["text"], limit)
    for call in qa.get("tool_calls") or []:
        lines.append(f"  tool call: {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})")
    for code, detail in (qa.get("details") or {}).items():
        lines.append(f"  {code}: {detail}")
    if "input_ids" in rec:
        mask = rec.get("loss_mask")
        lines.append(f"  tokens: {len(rec['input_ids'])}" + (f", trainable: {sum(mask)}" if mask else ""))
        if tokenizer is not None and mask:
            start = mask.index(1) if 1 in mask else len(mask)
            lines += _block("prompt (loss 0)", tokenizer.decode(rec["input_ids"][:start]), limit)
            lines += _block("output (loss 1)", tokenizer.decode(rec["input_ids"][start:]), limit)
    if "hidden" in rec:
        h = rec["hidden"]
        lines.append(f"  hidden: shape {h['shape']} ({h['dtype']}), layers {h['target_layer_ids']}, "
                     f"rms per layer {h['rms_per_layer']}")
    return "\n".join(lines)


def known_values() -> dict[str, list[str]]:
    """The values each filter can match: the categories, the reason codes and the flag codes."""
    checks = list(defaults("validate")["checks"])
    return {"category": list(CATEGORIES), "reason": [*checks, EXCLUDED],
            "flag": [*checks, "special_tokens_in_content"]}


def check_filters(**given: list[str]) -> None:
    """An error listing the valid values when a filter names a value no record can have (a
    misspelt code would otherwise match nothing, silently)."""
    known = known_values()
    for name, values in given.items():
        unknown = [v for v in values if v not in known[name]]
        if unknown:
            raise ValueError(f"unknown --{name} {', '.join(map(repr, unknown))}; valid: {', '.join(known[name])}")


def eval_report(path: str) -> dict | None:
    """The eval stage's report at ``path``, or None when it is some other file."""
    if not str(path).endswith(".json"):
        return None
    with local_copy(path) as local:
        try:
            doc = read_json(local)
        except ValueError:
            return None
    return doc if isinstance(doc, dict) and {"overall", "per_category", "settings"} <= set(doc) else None


def render_eval(report: dict, categories=()) -> str:
    """The eval report's figures per category (``categories``: only these), each with its method."""
    settings = report["settings"]
    rows = [(c, e) for c, e in sorted(report["per_category"].items()) if not categories or c in categories]
    rows += [("overall", report["overall"])] if not categories else []
    off = report.get("thinking_off") or {}
    untrained = report.get("untrained") or {}

    def of(part: dict, cat: str) -> dict:
        return (part.get("overall") if cat == "overall" else part.get("per_category", {}).get(cat)) or {}

    def figure(e: dict, key: str) -> str:
        return f"{e[key]:.3f}" if key in e else "-"

    lines = [f"eval report: {report['overall']['prompts']} held-out prompts, max_new_tokens "
             f"{settings.get('max_new_tokens')}, engine {settings.get('engine', 'transformers')}"]
    for key, method in (report.get("methods") or {}).items():
        lines.append(f"  {key}: {method}")
    lines.append(f"  {'category':<12} {'length':>7} {'per step':>8} {'untrained':>9} {'off: length':>11} "
                 f"{'off: per step':>13}")
    for cat, e in rows:
        lines.append(f"  {cat:<12} {figure(e, 'acceptance_length'):>7} {figure(e, 'acceptance_length_per_step'):>8} "
                     f"{figure(of(untrained, cat), 'acceptance_length'):>9} "
                     f"{figure(of(off, cat), 'acceptance_length'):>11} "
                     f"{figure(of(off, cat), 'acceptance_length_per_step'):>13}")
    if any("acceptance_rate_per_position" in e for _, e in rows):
        lines.append("  acceptance rate per draft position k (thinking on | off):")
        for cat, e in rows:
            rates = " ".join(f"{r:.2f}" for r in e.get("acceptance_rate_per_position", []))
            off_rates = " ".join(f"{r:.2f}" for r in of(off, cat).get("acceptance_rate_per_position", []))
            lines.append(f"    {cat:<12} {rates}" + (f" | {off_rates}" if off_rates else ""))
        lines.append("  verify steps by draft tokens accepted, 0 to block size - 1 (thinking on):")
        for cat, e in rows:
            lines.append(f"    {cat:<12} " + " ".join(str(n) for n in e.get("accepted_length_histogram", [])))
    return "\n".join(lines)


def inspect(path: str, categories=(), reasons=(), flags=(), ids=(), limit: int | None = 10, as_json: bool = False,
            full: bool = False, tokenizer=None, out=None, ids_seen: set | None = None) -> tuple[int, int]:
    """Print the matching records of a shard (at most ``limit``; None for all). Returns (how many
    were shown, how many match): the shard is read to its end to count them. ``ids_seen``: gets
    each of ``ids`` that some record has, whatever the other filters (to tell a wrong id from one
    that other filters leave out). An eval report prints its figures (one entry)."""
    out = out or sys.stdout
    if (report := eval_report(path)) is not None:
        out.write((json.dumps({k: v for k, v in report.items() if k != "samples"}) if as_json
                   else terminal_safe(render_eval(report, categories))) + "\n")
        return 1, 1
    shown = matched = 0
    for head, whole in read_entries(path):
        if ids_seen is not None:
            ids_seen.update({head.get("id"), head.get("prompt_id")} & set(ids))
        if not matches(head, list(categories), list(reasons), list(flags), list(ids)):
            continue
        matched += 1
        if limit is not None and shown >= limit:
            continue
        rec = whole()
        out.write((terminal_safe(json.dumps(rec, ensure_ascii=False), json_escapes=True) if as_json
                   else terminal_safe(render(rec, None if full else 1200, tokenizer))) + "\n")
        shown += 1
    return shown, matched


def inspect_command(shards: list[str], categories: list[str], reasons: list[str], flags: list[str], ids: list[str],
                    limit: int, as_json: bool, full: bool, target: Path | None) -> None:
    """``dflash inspect``: the records of the shards given (or of a stage's folder) that match every
    filter, at most ``limit`` (0: all), then how many were shown of how many matched."""
    check_filters(category=categories, reason=reasons, flag=flags)
    tokenizer = None
    if target:
        from transformers import AutoTokenizer  # heavy: only to decode tokenized rows

        tokenizer = AutoTokenizer.from_pretrained(target)
    shown = matched = 0
    ids_seen: set[str] = set()
    for path in [shard for given in shards for shard in shards_of(given)]:
        # past the limit a shard is still read, to count what matches
        more, found = inspect(path, categories, reasons, flags, ids, limit - shown if limit else None,
                              as_json, full, tokenizer, ids_seen=ids_seen)
        shown, matched = shown + more, matched + found
    if absent := [i for i in ids if i not in ids_seen]:
        where = f"the shards given ({', '.join(shards)})" if len(shards) <= 3 else f"the {len(shards)} shards given"
        raise ValueError(f"--id {', '.join(absent)}: in none of {where}; check the id, and that these are shards of "
                         f"the stage that holds it")
    if not as_json:
        print(f"{shown} of {matched} shown" + (f" (--limit {limit}; --limit 0 shows all)" if shown < matched else ""),
              file=sys.stderr)
