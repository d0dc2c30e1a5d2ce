"""The GPU stages' share of the plan and the whole bill, per node kind: hidden states (with a
cache), training (the config's rows spread over the nodes of each count, or on one of them) and
the eval, from the pilot's training burst where it ran (measured) and from ``dflash.plan.train_cost``'s
arithmetic elsewhere (assumed), added to generation per node count. Every figure says where it
comes from."""
from __future__ import annotations

import math

from dflash.core.units import human_count, human_duration
from dflash.eval.acceptance import decodings
from dflash.plan.train_cost import allreduce_seconds, drafter_trained_params, seconds, step_flops, target_forward_flops

FLOOR = "assumed, a floor: decoding one prompt at a time is bound by memory, not FLOPs"


def _rows(config: dict, pilot: dict | None) -> tuple[float, float, str]:
    """Tokens of a training row, the answer's share of them, and where the two come from."""
    if pilot and pilot.get("supervised_per_row"):
        return pilot["tokens_per_row"], pilot["supervised_per_row"], "the pilot's rows"
    longest = config["tokenize"]["max_length"]
    return longest, min(config["generate"]["sampling"]["max_tokens"], longest), "no pilot: rows as long as allowed"


def _step(config: dict, kind: str, k: dict, flops: float, burst: dict | None) -> dict:
    """Seconds a training step takes on one GPU of ``kind`` (its ``train.batch_size`` rows, the
    all-reduce apart) and the set-up: the pilot's measured figures where the burst ran, scaled by
    bf16 rate to the kinds with one, else FLOPs at the kind's bf16 rate and utilisation."""
    profiles = config["plan"]["profiles"]
    gpus = min(config["train"]["gpus"], k["gpus_per_node"])
    burst = burst if burst and "seconds_per_step" in burst else None  # a skipped burst measured nothing
    where = (burst or {}).get("kind")
    setup = 0.0
    if burst and where == kind:
        per_step, setup, source = burst["seconds_per_step"], burst["setup_seconds"], "measured by the pilot"
    elif burst and (profiles.get(where) or {}).get("bf16_tflops") and k.get("bf16_tflops"):
        per_step = burst["seconds_per_step"] * profiles[where]["bf16_tflops"] / k["bf16_tflops"]
        source = f"the pilot's rate on {where} x its bf16 TFLOPS / this kind's"
    elif k.get("bf16_tflops"):
        per_step = seconds(flops, k["bf16_tflops"], k["utilisation"])
        source = f"assumed: {k['bf16_tflops']:,g} TFLOPS bf16 x {k['utilisation']:.0%}"
    else:
        return {"gpus": gpus, "seconds_per_step": None, "from": f"no rate: set plan.profiles.{kind}.bf16_tflops, or "
                                                                 f"run the pilot there"}
    return {"gpus": gpus, "seconds_per_step": per_step, "setup_seconds": setup, "from": source}


def _spread(config: dict, k: dict, step: dict, nodes: int, gradient_bytes: float) -> dict:
    """Training over ``nodes`` nodes of a kind: the config's rows (``train.steps`` of its global
    batch) in the steps a batch ``nodes`` times wider needs, each step a GPU's compute and the
    all-reduce of the drafter's gradients."""
    train = config["train"]
    rows = train["steps"] * train["batch_size"] * train["gpus"] * train["nodes"]
    rows_per_step = train["batch_size"] * step["gpus"] * nodes
    steps = math.ceil(rows / rows_per_step)
    allreduce, missing = allreduce_seconds(gradient_bytes, step["gpus"], nodes, k.get("interconnect_gb_s"),
                                           k.get("network_gb_s"), train["parallel"])
    hours = (None if step["seconds_per_step"] is None
             else (step["setup_seconds"] + steps * (step["seconds_per_step"] + allreduce)) / 3600)
    return {"nodes": nodes, "steps": steps, "rows_per_step": rows_per_step, "allreduce_seconds": allreduce,
            "missing": missing, "hours": hours}


def gpu_bill(config: dict, kinds: dict, generation: dict, text: dict, row_tokens_total: float,
             pilot: dict | None, burst: dict | None, heldout: int | None) -> dict:
    """Per node kind: a training step's time, the hidden states and eval hours, and per node count
    the whole bill (generation + hidden states + training + eval, hours and cost of the nodes
    rented), with training spread over the nodes, and as it would be on one node of them."""
    row, supervised, rows_from = _rows(config, pilot)
    flops = step_flops(config, text, row, supervised)
    gradient_bytes = 4 * drafter_trained_params(config, text)  # fp32: the weights train in fp32 under autocast
    offline = config["train"]["hidden_states"] != "online"
    hidden_flops = row_tokens_total * target_forward_flops(text, round(row)) / row if offline else 0.0
    # trained, untrained (and thinking off), a forward per token
    forwards = len(decodings(config["eval"])) * (heldout or 0) * config["eval"]["max_new_tokens"]
    eval_flops = forwards * target_forward_flops(text, config["drafter"]["block_size"])
    stages = {}
    for kind, k in kinds.items():
        profile = {**config["plan"]["profiles"].get(kind, {}), **k}
        rate = profile.get("bf16_tflops")
        step = _step(config, kind, profile, flops["total"], burst)
        eval_hours = (seconds(eval_flops, rate, profile["utilisation"]) / config["eval"]["jobs"] / 3600
                      if rate and heldout is not None else None)
        forecast = generation[kind]["forecast"]
        counts = sorted({1, *(g["nodes"] for g in forecast)})
        spread = {n: _spread(config, profile, step, n, gradient_bytes) for n in counts}
        bills = []
        for g in forecast or [{"nodes": 1, "hours": 0.0, "cost": None}]:
            nodes = g["nodes"]
            hidden = (seconds(hidden_flops, rate, profile["utilisation"]) / (nodes * k["gpus_per_node"]) / 3600
                      if offline and rate else 0.0 if not offline else None)
            parts = {"generation": g["hours"] if forecast else None, "hidden": hidden,
                     "training": spread[nodes]["hours"], "eval": eval_hours}
            price = k["gpu_hour_price"]
            # generation and the hidden states on every node; training on every node, or on one of them
            # with the others given back; the eval on one
            held = nodes * ((parts["generation"] or 0) + (hidden or 0)) + (eval_hours or 0)
            shared = sum(h for p, h in parts.items() if h and p != "training")
            whole = {}
            for way, training, on in (("spread", spread[nodes]["hours"], nodes), ("one_node", spread[1]["hours"], 1)):
                node_hours = held + on * (training or 0)
                whole[way] = {"hours": shared + (training or 0), "node_hours": node_hours,
                              "cost": None if price is None else node_hours * k["gpus_per_node"] * price}
            # a re-run from validation on (samples dropped, a check changed): all but generation
            rerun_node_hours = whole["spread"]["node_hours"] - nodes * (parts["generation"] or 0)
            rerun = {"hours": whole["spread"]["hours"] - (parts["generation"] or 0), "node_hours": rerun_node_hours,
                     "cost": None if price is None else rerun_node_hours * k["gpus_per_node"] * price}
            bills.append({"nodes": nodes, **{f"{p}_hours": h for p, h in parts.items()}, **whole["spread"],
                          "complete": None not in parts.values(), "training_on_one_node": whole["one_node"],
                          "rerun_after_validation": rerun})
        stages[kind] = {"training": {**step, "spread": list(spread.values())}, "eval_hours": eval_hours, "bill": bills,
                        "links": {key: profile.get(key) for key in ("interconnect_gb_s", "network_gb_s")},
                        "hidden_from": f"assumed: {rate:,g} TFLOPS bf16 x {profile['utilisation']:.0%}" if rate else None}
    return {"step_flops": flops, "train_gpus": config["train"]["gpus"], "batch_size": config["train"]["batch_size"],
            "train_rows": config["train"]["steps"] * config["train"]["batch_size"] * config["train"]["gpus"]
            * config["train"]["nodes"], "gradient_bytes": gradient_bytes,
            "row_tokens": row, "supervised_per_row": supervised, "rows_from": rows_from,
            "hidden_flops": hidden_flops, "eval_flops": eval_flops, "heldout": heldout, "kinds": stages}


def _flops(x: float) -> str:
    return f"{x:.2g}".replace("e+", "e")


def _hours(h: float | None) -> str:
    return "?" if h is None else human_duration(h * 3600)


def bill_lines(g: dict) -> list[str]:
    """The GPU stages and the whole bill for a terminal: the FLOPs of a step, then per node kind
    training and eval, then the bill per node count, each figure with where it comes from."""
    if "error" in g:
        return [f"  training, hidden states, eval: {g['error']}"]
    f = g["step_flops"]
    parts = ", ".join(f"{p} {_flops(f[p])}" for p in ("target", "drafter", "lm_head") if f[p])
    lines = [f"  training step, per GPU: {_flops(f['total'])} FLOPs ({parts}); rows of {g['row_tokens']:,.0f} tokens, "
             f"{g['supervised_per_row']:,.0f} of them the answer's ({g['rows_from']})"]
    lines.append(f"  training rows: {human_count(g['train_rows'])} (train.steps x batch_size x gpus x nodes); over N "
                 f"nodes they take 1/N of the steps, each of N times the rows (set train.nodes and train.steps so, "
                 f"and lr for that batch); each step averages the drafter's {human_count(g['gradient_bytes'] / 4)} "
                 f"gradients ({g['gradient_bytes'] / 1e9:.3g} GB in fp32)")
    for kind, s in g["kinds"].items():
        t = s["training"]
        where = "this machine" if kind == "local" else f"{t['gpus']} GPU{'s' * (t['gpus'] > 1)} a node" + (
            f" (train.gpus {g['train_gpus']} is more than a node has: set {t['gpus']})" if t["gpus"] < g["train_gpus"]
            else "")
        if t["seconds_per_step"] is None:
            step = t["from"]
        else:
            setup = f" + {t['setup_seconds']:.0f} s set-up" if t["setup_seconds"] else ""
            step = f"{t['seconds_per_step']:.3g} s/step{setup} ({t['from']})"
            shared = [x for x in t["spread"] if x["nodes"] > 1 or t["gpus"] > 1]
            missing = sorted({m for x in shared for m in x["missing"]})
            if shared and not missing:
                step += (" + all-reduce " + ", ".join(f"{x['allreduce_seconds']:.2g} s (x{x['nodes']})" for x in shared)
                         + f" ({_links(s['links'])})")
            elif shared:
                step += f" + all-reduce not counted (set plan.profiles.{kind}.{' and '.join(missing)})"
        lines.append(f"  {kind}: training on {where}: {step}"
                     + (f"; eval {_hours(s['eval_hours'])} ({FLOOR})" if s["eval_hours"] is not None else ""))
        steps = {x["nodes"]: x["steps"] for x in t["spread"]}
        for b in s["bill"]:
            n = b["nodes"]
            shown = [f"{p} {_hours(b[f'{p}_hours'])}" + (f" ({steps[n]:,} steps)" if p == "training" else "")
                     for p in ("generation", "hidden", "training", "eval") if b[f"{p}_hours"] != 0.0]
            one = b["training_on_one_node"]
            lines.append(f"    x{n} node{'s' * (n > 1)}: {' + '.join(shown)} = {_hours(b['hours'])}{_cost(b)}"
                         + (f"; training on one node: {_hours(one['hours'])}{_cost(one)}" if n > 1 else "")
                         + ("" if b["complete"] else " (so far: ? is a stage with no figure)"))
        if s["bill"] and s["bill"][0]["generation_hours"]:
            reruns = [b["rerun_after_validation"] | {"nodes": b["nodes"]} for b in s["bill"]]
            priced = reruns[0]["cost"] is not None
            lines.append("    a re-run from validation on (samples dropped, a check changed; no generation): "
                         + ", ".join(f"x{r['nodes']} {_hours(r['hours'])}" + (f", ${r['cost']:,.0f}" if priced else "")
                                     for r in reruns) + ("" if priced else " (cost unknown: no gpu_hour_price)"))
    return lines


def _cost(b: dict) -> str:
    return f", ${b['cost']:,.0f}" if b["cost"] is not None else ", cost unknown (no gpu_hour_price)"


def _links(links: dict) -> str:
    return (f"assumed: {links['interconnect_gb_s']:,g} GB/s within a node, {links['network_gb_s']:,g} GB/s a node "
            f"between nodes, at link speed, not overlapped with the backward")
