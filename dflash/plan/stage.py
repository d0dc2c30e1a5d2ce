"""Plan before renting: output tokens, generation hours and cost per node kind and count, data
sizes and jobs per rule, from the prompt counts and what the pilot measured (or figures the user
gives). docs/design.md: the story's run was sized by hand (17.45 h and ~$471 on 7x B200; ~16.5 days
estimated on a 4x RTX PRO 6000 node); none of the reference tools forecasts anything.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from dflash.core.io import read_json, write_json
from dflash.core.run_stamp import foreign_run
from dflash.core.shapes import cache_plan, text_config
from dflash.core.units import human_bytes, human_count, human_duration
from dflash.core.workflow import target_dir, to_console
from dflash.eval.acceptance import decodings
from dflash.plan.bill import bill_lines, gpu_bill
from dflash.prompts.stage import read_source

Z95 = 1.96  # the ranges: 95% intervals of the pilot's sampling error
# The story's completions: 7.25 GB of zstd JSONL for 1.64e9 output tokens (used without a pilot).
STORY_BYTES_PER_OUTPUT_TOKEN = 7.25e9 / 1.64e9


def prompt_counts(config: dict, manifest: Path | None = None, outputs: bool = True) -> dict:
    """Training prompts per category and the shards they make: from the prompts manifest when the
    prompts stage has run (and ``outputs``: the output folder is this run's), else by reading the
    sources (before the checkpoint; duplicates and prompts the target cannot take are still in, so
    it errs high)."""
    manifest = Path(manifest or Path(config["output_dir"]) / "prompts" / "manifest.json")
    if manifest.exists() and outputs:
        m = read_json(manifest)
        return {"prompts": m["prompts"], "categories": m["categories"], "shards": len(m["shards"]),
                "heldout": m.get("heldout"), "from": str(manifest)}

    categories: Counter = Counter()
    heldout = 0
    for source in config["prompts"]["sources"]:
        for r in read_source(source):
            if r["meta"].get("split") == "heldout":
                heldout += 1
            else:
                categories[r["category"]] += 1
    counted = "the sources, counted"
    if not heldout and (share := config["prompts"]["heldout_share"]):  # as the prompts stage will draw them
        cap = config["prompts"]["heldout_max_per_category"]
        drawn = {c: min(cap, math.ceil(share * n)) if n > 1 else 0 for c, n in categories.items()}
        categories = Counter({c: n - drawn[c] for c, n in categories.items()})
        heldout, counted = sum(drawn.values()), f"{counted}; held out: prompts.heldout_share {share:g}"
    prompts = sum(categories.values())
    return {"prompts": prompts, "categories": dict(categories), "heldout": heldout,
            "shards": math.ceil(prompts / config["prompts"]["shard_size"]), "from": counted}


def _tokens_from_pilot(categories: dict, pilot: dict) -> tuple[float, float]:
    """Total output tokens (stratified: each category's prompts x the pilot's mean per prompt)
    and the half-width of its 95% interval (finite-population sampling error)."""
    every = [c["output_tokens_per_prompt"] for c in pilot["categories"].values()]
    overall = sum(c["mean"] * c["n"] for c in every) / max(1, sum(c["n"] for c in every))
    total = variance = 0.0
    for cat, n_cat in categories.items():
        measured = pilot["categories"].get(cat)
        if not measured:  # a category the pilot missed: the overall mean, no spread known
            total += n_cat * overall
            continue
        per = measured["output_tokens_per_prompt"]
        total += n_cat * per["mean"]
        if per["n"] > 1:
            variance += n_cat ** 2 * per["sd"] ** 2 / per["n"] * max(0.0, 1 - per["n"] / max(n_cat, per["n"]))
    return total, Z95 * math.sqrt(variance)


def _rates(config: dict, pilot: dict | None) -> dict[str, dict]:
    """Per node kind: GPUs, price, output tokens/s of one node and where that figure comes from."""
    plan = config["plan"]
    measured = (pilot or {}).get("throughput", {})
    kinds = {}
    for kind, p in plan["profiles"].items():
        rate, source = p["output_tokens_per_s"], "plan.profiles"
        if pilot and plan["pilot_profile"] == kind and measured.get("output_tokens_per_s_per_gpu"):
            rate, source = measured["output_tokens_per_s_per_gpu"] * p["gpus_per_node"], "pilot"  # measured wins
        kinds[kind] = {"gpus_per_node": p["gpus_per_node"], "gpu_hour_price": p["gpu_hour_price"],
                       "output_tokens_per_s": rate, "rate_from": source if rate else None}
    if pilot and plan["pilot_profile"] is None:
        kinds = {"local": {"gpus_per_node": measured.get("gpus") or 1, "gpu_hour_price": None,
                           "output_tokens_per_s": measured["output_tokens_per_s"], "rate_from": "pilot"}, **kinds}
    return kinds


def forecast(config: dict, counts: dict, pilot: dict | None = None, output_tokens: float | None = None,
             target: str | Path | None = None, burst: dict | None = None) -> dict:
    """The plan: output tokens (with its range), and per node kind and node count the generation
    hours and cost; completions size, the hidden-state cache (or online mode); the hidden-state,
    training and eval hours and the whole bill (``dflash.plan.bill``; ``burst``: the pilot's training
    burst, by default the one in ``pilot``); jobs per rule. ``output_tokens``: the user's own total,
    instead of the pilot's."""
    burst = burst or (pilot or {}).get("train_burst")
    prompts = counts["prompts"]
    spread = 0.0
    pilot = pilot if pilot and pilot["records"] else None  # an empty pilot (turned off, or all adopted)
    if output_tokens is not None:
        tokens, tokens_from = float(output_tokens), "given"
    elif pilot:
        tokens, spread = _tokens_from_pilot(counts["categories"], pilot)
        tokens_from = "pilot"
    elif config["plan"]["mean_output_tokens"]:
        tokens, tokens_from = prompts * config["plan"]["mean_output_tokens"], "plan.mean_output_tokens"
    else:
        raise ValueError("no figure to forecast output tokens from: run the pilot (snakemake pilot), or give "
                         "plan.mean_output_tokens or --output-tokens")
    low, high = max(0.0, tokens - spread), tokens + spread
    # The pilot's tokens per prompt count a generation cut for looping at the tokens it received:
    # the forecast already holds the saving; this says how much it is.
    aborts = (pilot or {}).get("loop_aborts") or {}
    loop_abort = None
    if tokens_from == "pilot" and aborts.get("records"):
        saved = aborts["tokens_saved"] / max(1, pilot["throughput"]["output_tokens"])
        loop_abort = {**aborts, "saved_per_output_token": saved, "output_tokens_without": tokens * (1 + saved)}
    kinds = _rates(config, pilot)
    generation = {}
    for kind, k in kinds.items():
        rows = []
        for nodes in config["plan"]["nodes"] if kind != "local" else [1]:
            if not k["output_tokens_per_s"]:
                continue
            rate = k["output_tokens_per_s"] * nodes
            hours = [t / rate / 3600 for t in (tokens, low, high)]
            price = k["gpu_hour_price"]
            cost = [h * nodes * k["gpus_per_node"] * price for h in hours] if price is not None else None
            rows.append({"nodes": nodes, "hours": hours[0], "hours_range": hours[1:],
                         "cost": cost[0] if cost else None, "cost_range": cost[1:] if cost else None})
        generation[kind] = {**k, "forecast": rows}

    per_token = (pilot["bytes_per_output_token"] if pilot and pilot.get("bytes_per_output_token")
                 else STORY_BYTES_PER_OUTPUT_TOKEN)
    sizes = {"completions_bytes": tokens * per_token, "completions_bytes_range": [low * per_token, high * per_token],
             "completions_from": "pilot" if pilot else "the story's 4.42 bytes per output token"}
    if pilot:
        kept = 1 - pilot["reject_rate"]
        row_tokens = prompts * pilot["records_per_prompt"] * kept * pilot["rows_per_record"] * pilot["tokens_per_row"]
    else:
        row_tokens = tokens  # prompt tokens unknown: at least the output tokens
    local = bool(target) and Path(target).exists()  # its folder or its config.json; a hub name: nothing is downloaded
    if config["train"]["hidden_states"] == "online":
        sizes["hidden"] = "train.hidden_states online: no cache"
    else:
        if local:
            sizes["hidden"] = cache_plan(config, target, int(row_tokens))["text"]
        else:
            sizes["hidden"] = (f"{row_tokens:.3g} tokens; the target ({target}) is not on this machine: "
                               f"`dflash cache-size --tokens {row_tokens:.3g} --target <its folder or config.json>` sizes the cache")

    if local:
        gpus = gpu_bill(config, kinds, generation, text_config(target), row_tokens, pilot, burst, counts.get("heldout"))
    else:
        gpus = {"error": f"the target ({target}) is not on this machine: give --target its folder or config.json "
                         f"for the training, hidden-state and eval forecasts"}

    return {"prompts": prompts, "categories": counts["categories"], "counted_from": counts["from"],
            "heldout": counts.get("heldout"), "max_tokens": config["generate"]["sampling"]["max_tokens"],
            "output_tokens": tokens, "output_tokens_range": [low, high], "output_tokens_from": tokens_from,
            "loop_abort": loop_abort,
            "generation": generation, "sizes": sizes, "gpu_stages": gpus, "jobs": _jobs(config, counts["shards"])}


def _jobs(config: dict, shards: int) -> dict[str, int]:
    """Jobs per rule of the whole run."""
    launch = config["generate"]["server"]["launch"]
    return {"prompts": 1, "generate": shards, "validate": shards, "tokenize": shards,
            **({"serve": math.ceil(shards / launch["shards_per_server"])} if launch else {}),
            **({"hidden": shards} if config["train"]["hidden_states"] != "online" else {}),
            "train": 1, "eval_decode": len(decodings(config["eval"])) * config["eval"]["jobs"], "eval": 1, "qa_summary": 1, "gate": 1, "report": 1}


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:,.0f}"


def plan_lines(plan: dict) -> list[str]:
    """The plan for a terminal: one line per node kind and count, then sizes, training, jobs."""
    if "error" in plan:
        return [f"plan: {plan['error']}"]
    low, high = plan["output_tokens_range"]
    span = f" ({human_count(low)} to {human_count(high)})" if high > low else ""
    lines = [f"plan: {plan['prompts']:,} prompts (from {plan['counted_from']}), {human_count(plan['output_tokens'])} "
             f"output tokens{span} (from {plan['output_tokens_from']})"]
    if foreign := plan.get("foreign_outputs"):
        lines.append(f"  warning: not read: {foreign}")
    per_prompt = plan["output_tokens"] / max(1, plan["prompts"])
    if per_prompt > plan["max_tokens"]:
        lines.append(f"  warning: {per_prompt:,.0f} output tokens per prompt, over generate.sampling.max_tokens "
                     f"{plan['max_tokens']:,}: one completion cannot be that long, so the total is too high unless "
                     f"the prompts are replayed conversations (a completion per turn); check --output-tokens "
                     f"(the total) or give --mean-output-tokens")
    if plan.get("heldout") == 0:
        lines.append("  warning: no held-out prompts: the eval will have nothing to measure, and the bill has no eval; "
                     "set prompts.heldout_share or mark a source split: heldout (or give --heldout)")
    if a := plan.get("loop_abort"):
        lines.append(f"  loop aborts: the pilot cut {a['records']:,} looping generation{'s' * (a['records'] != 1)}, "
                     f"{a['tokens_saved']:,} tokens not generated; the forecast counts them as cut (without "
                     f"generate.loop_abort: {human_count(a['output_tokens_without'])} output tokens, "
                     f"{a['saved_per_output_token']:+.1%})")
    for kind, g in plan["generation"].items():
        if not g["forecast"]:
            lines.append(f"  {kind}: no generation rate: set plan.profiles.{kind}.output_tokens_per_s, or run the "
                         f"pilot there (plan.pilot_profile: {kind})")
        for f in g["forecast"]:
            h0, h1 = f["hours_range"]
            hours = human_duration(f["hours"] * 3600) + (
                f" ({human_duration(h0 * 3600)} to {human_duration(h1 * 3600)})" if h1 > h0 else "")
            cost = ("" if f["cost"] is None else f", {_money(f['cost'])}"
                    + (f" ({_money(f['cost_range'][0])} to {_money(f['cost_range'][1])})" if h1 > h0 else ""))
            lines.append(f"  {kind} x{f['nodes']} ({f['nodes'] * g['gpus_per_node']} GPUs, "
                         f"{g['output_tokens_per_s'] * f['nodes']:,.0f} tok/s from {g['rate_from']}): "
                         f"generation {hours}{cost}")
    s = plan["sizes"]
    c0, c1 = s["completions_bytes_range"]
    lines.append(f"  completions: {human_bytes(s['completions_bytes'])}"
                 + (f" ({human_bytes(c0)} to {human_bytes(c1)})" if c1 > c0 else "")
                 + f" zstd (from {s['completions_from']}); hidden states: {s['hidden']}")

    lines += bill_lines(plan["gpu_stages"])
    lines.append("  jobs: " + ", ".join(f"{rule} {n:,}" for rule, n in plan["jobs"].items()))
    return lines


def plan_job(config: dict, manifest: Path, pilot: Path | None, target: Path, out_path: Path) -> dict:
    """The plan rule's job: the forecast from the run's own prompts manifest and pilot, written and
    shown on the console. Nothing to forecast from (an empty pilot) is said in the plan, and the
    report goes on."""
    try:
        plan = forecast(config, prompt_counts(config, manifest), read_json(pilot) if pilot else None, target=target)
    except ValueError as e:
        plan = {"error": str(e)}
    to_console("\n".join(plan_lines(plan)))
    write_json(out_path, plan)
    return plan


def plan_command(config: dict, config_path: Path, prompts: float | None = None, heldout: float | None = None,
                 output_tokens: float | None = None, mean_output_tokens: float | None = None,
                 pilot: Path | None = None, target: Path | None = None, json_path: Path | None = None) -> dict:
    """``dflash plan``: the forecast before renting, from the figures given or this run's own
    outputs (never another run's: its prompts manifest and pilot would price this one), printed."""
    if mean_output_tokens is not None:
        if output_tokens is not None:
            raise ValueError("give --output-tokens (the total) or --mean-output-tokens (per prompt), not both")
        config["plan"]["mean_output_tokens"] = float(mean_output_tokens)
    out = Path(config["output_dir"])
    foreign = foreign_run(out, config, str(config_path))
    if prompts is not None:
        counts = {"prompts": int(prompts), "categories": {"given": int(prompts)},
                  "shards": -(-int(prompts) // config["prompts"]["shard_size"]), "from": "--prompts",
                  "heldout": None if heldout is None else int(heldout)}
    else:
        counts = prompt_counts(config, outputs=not foreign)
    pilot = pilot or (None if foreign else out / "pilot" / "summary.json")
    measured = read_json(pilot) if pilot and pilot.exists() else None
    given = output_tokens is not None or mean_output_tokens is not None  # the user's figure beats the pilot's
    plan = forecast(config, counts, None if given else measured, output_tokens, target or target_dir(config),
                    (measured or {}).get("train_burst"))
    plan["foreign_outputs"] = foreign
    print("\n".join(plan_lines(plan)))
    if json_path:
        write_json(json_path, plan)
    return plan


def cache_size_command(config: dict, tokens: float | None, tokenized: list[Path], target: Path | None) -> None:
    """``dflash cache-size``: the hidden-state cache a run would write, planned from a token count or
    measured from tokenized shards, against ``hidden.max_cache_bytes``."""
    if tokens is None and not tokenized:
        raise ValueError("give --tokens N (planned) or --tokenized results/tokenized/shard-*.json (measured)")
    tokens = int(tokens) if tokens is not None else sum(read_json(p)["stats"]["tokens"] for p in tokenized)
    plan = cache_plan(config, target or target_dir(config), tokens)
    limit = config["hidden"]["max_cache_bytes"]
    print(f"hidden-state cache: {plan['text']} ({plan['bytes']} bytes, dtype {plan['dtype']})")
    if config["train"]["hidden_states"] == "online":
        print("train.hidden_states is online: no cache is written")
    elif limit is not None and plan["bytes"] > limit:
        print(f"above hidden.max_cache_bytes ({human_bytes(limit)}): the gate will stop the run; "
              "set train.hidden_states: online, or hidden.dtype: float8_e4m3fn")
    else:
        print(f"within hidden.max_cache_bytes ({human_bytes(limit) if limit is not None else 'no limit'})")
