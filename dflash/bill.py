"""The GPU stages' share of the plan and the whole bill, per node kind: hidden states (with a
cache), training (one node, ``train.gpus`` of its GPUs) and the eval, from the pilot's training
burst where it ran (measured) and from ``dflash.train_cost``'s arithmetic elsewhere (assumed),
added to generation per node count. Every figure says where it comes from."""
from __future__ import annotations

from dflash.acceptance import decodings
from dflash.train_cost import seconds, step_flops, target_forward_flops
from dflash.units import human_duration

FLOOR = "assumed, a floor: decoding one prompt at a time is bound by memory, not FLOPs"


def _rows(config: dict, pilot: dict | None) -> tuple[float, float, str]:
    """Tokens of a training row, the answer's share of them, and where the two come from."""
    if pilot and pilot.get("supervised_per_row"):
        return pilot["tokens_per_row"], pilot["supervised_per_row"], "the pilot's rows"
    longest = config["tokenize"]["max_length"]
    return longest, min(config["generate"]["sampling"]["max_tokens"], longest), "no pilot: rows as long as allowed"


def _training(config: dict, kind: str, k: dict, flops: float, burst: dict | None) -> dict:
    """Hours of ``train.steps`` on one node of ``kind``: the pilot's measured seconds per step
    where the burst ran (and its set-up), scaled by bf16 rate to the kinds with one, else FLOPs
    at the kind's bf16 rate and utilisation."""
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
        return {"gpus": gpus, "hours": None, "from": f"no rate: set plan.profiles.{kind}.bf16_tflops, or run the "
                                                       f"pilot there"}
    return {"gpus": gpus, "seconds_per_step": per_step, "setup_seconds": setup,
            "hours": (setup + config["train"]["steps"] * per_step) / 3600, "from": source}


def gpu_bill(config: dict, kinds: dict, generation: dict, text: dict, row_tokens_total: float,
             pilot: dict | None, burst: dict | None, heldout: int | None) -> dict:
    """Per node kind: training, hidden states and eval hours, and per node count the whole bill
    (generation + hidden states + training + eval, hours and cost of the nodes rented)."""
    row, supervised, rows_from = _rows(config, pilot)
    flops = step_flops(config, text, row, supervised)
    offline = config["train"]["hidden_states"] != "online"
    hidden_flops = row_tokens_total * target_forward_flops(text, round(row)) / row if offline else 0.0
    # trained, untrained (and thinking off), a forward per token
    forwards = len(decodings(config["eval"])) * (heldout or 0) * config["eval"]["max_new_tokens"]
    eval_flops = forwards * target_forward_flops(text, config["drafter"]["block_size"])
    stages = {}
    for kind, k in kinds.items():
        profile = {**config["plan"]["profiles"].get(kind, {}), **k}
        rate = profile.get("bf16_tflops")
        train = _training(config, kind, profile, flops["total"], burst)
        eval_hours = (seconds(eval_flops, rate, profile["utilisation"]) / config["eval"]["jobs"] / 3600
                      if rate and heldout is not None else None)
        bills = []
        for g in generation[kind]["forecast"] or [{"nodes": 1, "hours": 0.0, "cost": None}]:
            nodes = g["nodes"]
            hidden = (seconds(hidden_flops, rate, profile["utilisation"]) / (nodes * k["gpus_per_node"]) / 3600
                      if offline and rate else 0.0 if not offline else None)
            parts = {"generation": g["hours"] if generation[kind]["forecast"] else None, "hidden": hidden,
                     "training": train["hours"], "eval": eval_hours}
            hours = sum(h for h in parts.values() if h)
            # generation and the hidden states on every node; training and the eval on one, the others given back
            node_hours = nodes * ((parts["generation"] or 0) + (hidden or 0)) + (train["hours"] or 0) + (eval_hours or 0)
            price = k["gpu_hour_price"]
            bills.append({"nodes": nodes, **{f"{p}_hours": h for p, h in parts.items()}, "hours": hours,
                          "node_hours": node_hours, "complete": None not in parts.values(),
                          "cost": None if price is None else node_hours * k["gpus_per_node"] * price})
        stages[kind] = {"training": train, "eval_hours": eval_hours, "bill": bills,
                        "hidden_from": f"assumed: {rate:,g} TFLOPS bf16 x {profile['utilisation']:.0%}" if rate else None}
    return {"step_flops": flops, "train_gpus": config["train"]["gpus"], "batch_size": config["train"]["batch_size"],
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
    for kind, s in g["kinds"].items():
        t = s["training"]
        step = (f"{t['seconds_per_step']:.3g} s/step" + (f" + {t['setup_seconds']:.0f} s set-up" if t["setup_seconds"]
                                                          else "")) if t["hours"] is not None else ""
        fewer = (f" (train.gpus {g['train_gpus']}: a global batch of {t['gpus'] * g['batch_size']} rows, not "
                 f"{g['train_gpus'] * g['batch_size']})" if t["gpus"] < g["train_gpus"] else "")
        where = "this machine" if kind == "local" else f"{t['gpus']} GPU{'s' * (t['gpus'] > 1)}{fewer}"
        lines.append(f"  {kind}: training on {where}: "
                     + (f"{step} = {_hours(t['hours'])} ({t['from']})" if t["hours"] is not None else t["from"])
                     + (f"; eval {_hours(s['eval_hours'])} ({FLOOR})" if s["eval_hours"] is not None else ""))
        for b in s["bill"]:
            shown = [f"{p} {_hours(b[f'{p}_hours'])}" for p in ("generation", "hidden", "training", "eval")
                     if b[f"{p}_hours"] != 0.0]
            lines.append(f"    x{b['nodes']} node{'s' * (b['nodes'] > 1)}: {' + '.join(shown)} = {_hours(b['hours'])}"
                         + (f", ${b['cost']:,.0f}" if b["cost"] is not None else ", cost unknown (no gpu_hour_price)")
                         + ("" if b["complete"] else " (so far: ? is a stage with no figure)"))
    return lines
