"""Generate stage: prompt shard -> completion records (docs/design.md "completion record").

The shard driver: a job's server and budget, the resume file, the records of every prompt. Where a
completion comes from is ``dflash.generate.backends``; a prompt's conversation (one request, or a replayed
tool conversation) is ``dflash.generate.replay``; resuming a shard is ``dflash.generate.resume``. Every record keeps
the exact prompt and output token ids; ``text`` is the decoding of the output ids without the
final stop token, special tokens kept, so later stages never have to re-tokenize to know what the
model saw.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

from dflash.core.chat import stop_token_ids
from dflash.core.config import completed
from dflash.core.errors import describe
from dflash.core.io import atomic_files, dumps_line, json_text, naming_full_disk, zst_lines
from dflash.core.records import checked_records
from dflash.core.storage import PartialMirror
from dflash.core.workflow import progress
from dflash.generate.adopt import adopted_record
from dflash.generate.backends import BACKENDS, ServerDown, WrongModel, resolve_sampling
from dflash.generate.budget import budget_watch
from dflash.generate.replay import generate_pending
from dflash.generate.resume import (keep_finished_output, load_partial, partial_path, seed_from_pilot, settings_digest,
                                    shard_lock)
from dflash.generate.server import wait_for_service

log = logging.getLogger(__name__)


# Past the serve job's own startup timeout, so that its failure report, with the server's log, wins.
SERVICE_GRACE_S = 60


def use_started_server(cfg: dict, service_file: str | Path) -> dict:
    """``cfg`` pointed at the server the pipeline started (``generate.server.launch``), once its
    service file says it is ready; its failure as an error when it failed."""
    server = cfg["server"]
    info = wait_for_service(service_file, server["launch"]["startup_timeout_s"] + SERVICE_GRACE_S)
    return {**cfg, "server": {**server, "url": info["url"], "model": info["model"]}}


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
    with naming_full_disk(partial.parent):  # as every stage does: the lock and resume files go there first
        partial.parent.mkdir(parents=True, exist_ok=True)
    mirror = PartialMirror(partial, cfg["mirror_every"]["records"], cfg["mirror_every"]["seconds"])
    with shard_lock(out_path):
        keep_finished_output(Path(out_path), partial)
        mirror.fetch()  # a run on another machine that the node it ran on did not outlive
        from_pilot = seed_from_pilot(partial, pilot, set(ids))
        return _generate_shard(prompts, ids, prompts_path, out_path, partial, target_dir, cfg, summary_path, mirror,
                               from_pilot, annotate, repetition)


def generate_job(config: dict, prompts_path: Path, out_path: Path, target_dir: Path, summary_path: Path | None,
                 pilot: Path | None = None, server: Path | None = None) -> dict:
    """One generate job as the rule and ``dflash generate`` run it: the server the job's group
    started (``server``: its service file), the run's budget (``dflash.generate.budget.budget_watch``), then
    the shard, its streams watched for loops with the validator's thresholds."""
    cfg = use_started_server(config["generate"], server) if server else config["generate"]
    annotate = budget_watch(config, summary_path, pilot, prompts_path)
    return generate_shard(prompts_path, out_path, target_dir, cfg, summary_path, pilot=pilot, annotate=annotate,
                          repetition=config["validate"]["repetition"])


def adopted_records(prompts: list[dict], target_dir: Path):
    """The records of prompts whose generations a logged server exchange already holds: only the
    target's tokenizer is needed, no model or server."""
    if not prompts:
        return
    from transformers import AutoTokenizer  # heavy: adopted logs only

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stop = stop_token_ids(tokenizer)
    for prompt in prompts:
        try:
            yield adopted_record(prompt, tokenizer, stop)
        except Exception as e:  # the template refusing the request, say: name the logged line
            raise ValueError(f"adopted record {prompt['id']} (source {prompt['source']}, line "
                             f"{prompt['meta']['index'] + 1}): {describe(e)}") from None


def record_counts(records: list[dict]) -> dict:
    """A shard summary's counts of how its records ended."""
    aborted = [r for r in records if r["finish_reason"] == "loop_abort"]
    return {
        "finish_reasons": {r: sum(x["finish_reason"] == r for x in records)
                           for r in ("stop", "length", "abort", "loop_abort", "error")},
        # Streams cut for a loop: the tokens they had produced, and those their max_tokens would have added.
        "loop_aborts": {"records": len(aborted),
                        "tokens_received": sum(r["usage"]["completion_tokens"] for r in aborted),
                        "tokens_saved": sum(r["generation"]["max_tokens_saved"] for r in aborted)},
        "replay_stops": dict(Counter(r["replay"]["stop"] for r in records if r.get("replay", {}).get("stop"))),
    }


def rate(tokens: int, t0: float) -> dict:
    seconds = time.time() - t0
    return {"output_tokens": tokens, "seconds": round(seconds, 2),
            "started_at": round(t0, 1),  # epoch seconds: when the shard's generation ran, for what it cost
            "output_tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


def write_shard(out_path: Path, records: list[dict], summary_path: Path | None, summary: dict) -> None:
    """The finished shard, and its summary only beside it: a failed job's summary would read like one."""
    with atomic_files(out_path, *([summary_path] if summary_path is not None else [])) as temps:
        with zst_lines(temps[0], shown=out_path) as write:
            for rec in records:
                write(dumps_line(rec))
        if summary_path is not None:
            with naming_full_disk(summary_path):
                temps[1].write_text(json_text(summary), encoding="utf-8")


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

        for rec in adopted_records(adopted, target_dir):
            finish([rec])
        try:
            if pending:
                generate_pending(pending, backend, cfg, sampling, thinking, finish)
        except ServerDown as e:
            bar.close()
            mirror.push()
            raise ServerDown(f"{e}: is the server down? The {len(done)} finished prompts of {name} are kept in "
                             f"{partial}: start the server and re-run to resume") from None
        except WrongModel as e:  # the finished prompts passed the same check: they are the target's
            bar.close()
            mirror.push()
            raise WrongModel(f"{name}: {e} (the {len(done)} finished prompts are kept in {partial})") from None
    bar.close()
    records = [r for i in ids for r in (done.get(i) or errors[i])]
    summary = {"shard": name, "prompts": len(prompts), "records": len(records), "resumed": resumed,
               "from_pilot": len(from_pilot), "requests": requests - len(adopted), "adopted": len(adopted),
               "retries": getattr(backend, "retries_done", 0), "errors": len(errors),
               **record_counts(records), **rate(tokens, t0)}
    if annotate:
        summary.update(annotate(summary))
    log.info("generate %s: %s", name, summary)
    if len(errors) > cfg["max_error_fraction"] * len(prompts):
        mirror.push()
        example = next(f"record {r['id']}: {r['error']}" for recs in errors.values() for r in recs if r["error"])
        raise RuntimeError(f"{name}: {len(errors)} of {len(prompts)} prompts failed (e.g. {example}); "
                           f"the {len(done)} finished ones are kept in {partial}: re-run to resume")
    write_shard(out_path, records, summary_path, summary)
    partial.unlink()
    # Until Snakemake has uploaded the shard, a lost node costs this shard's generation, never a
    # duplicate: a stale resume file would resume a later re-run with other settings.
    mirror.discard()
    return summary
