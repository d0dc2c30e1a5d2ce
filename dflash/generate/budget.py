"""What generation has cost so far, and the guard that starts no generate job the budget cannot
finish (config generate.budget). Spend is node time: the wall time during which any generate job
(the pilot's included) ran, times the nodes held (generate.budget.nodes), priced by the node kind
of plan.profiles that generate.budget.profile names.
"""
from __future__ import annotations

from pathlib import Path

from dflash.core.io import read_json
from dflash.core.storage import read_json_here_or_stored, stored_json


class BudgetError(RuntimeError):
    pass


def node_price(config: dict) -> float | None:
    """Price of one node-hour of the budget's node kind; None when no price is set."""
    kind = config["generate"]["budget"]["profile"]
    if kind is None:
        return None
    profile = config["plan"]["profiles"].get(kind)
    if profile is None:
        raise ValueError(f"generate.budget.profile {kind!r} is no node kind of plan.profiles "
                         f"({', '.join(config['plan']['profiles'])})")
    return None if profile["gpu_hour_price"] is None else profile["gpu_hour_price"] * profile["gpus_per_node"]


def _wall_seconds(summaries: list[dict]) -> float:
    """Seconds during which at least one of these generate jobs ran (overlaps counted once)."""
    spans = sorted((s["started_at"], s["started_at"] + s["seconds"]) for s in summaries if s.get("started_at") is not None)
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def generated_prompts(summary: dict) -> int:
    """Prompts a generate job asked the model for (not taken from the pilot or a resume file)."""
    return summary["prompts"] - summary.get("from_pilot", 0) - summary.get("resumed", 0) - summary.get("adopted", 0)


def spend(summaries: list[dict], config: dict) -> dict:
    """Generation's wall hours, node-hours and cost over these generate summaries."""
    wall = _wall_seconds(summaries) / 3600
    nodes = config["generate"]["budget"]["nodes"]
    price = node_price(config)
    return {"wall_hours": wall, "node_hours": wall * nodes, "cost": wall * nodes * price if price is not None else None,
            "prompts_generated": sum(generated_prompts(s) for s in summaries),
            "output_tokens": sum(s["output_tokens"] for s in summaries)}


def check_budget(config: dict, finished: list[dict], pilot: dict | None, prompts_total: int) -> dict | None:
    """Raise BudgetError when what generation has spent plus the forecast for the prompts still to
    generate would pass generate.budget; the forecast is the node time per prompt measured so
    far (finished shards and the pilot). Returns the spend and forecast (None: no budget set)."""
    budget = config["generate"]["budget"]
    if budget["max_node_hours"] is None and budget["max_cost"] is None:
        return None
    measured = finished + ([pilot] if pilot else [])
    spent = spend(measured, config)
    if not spent["prompts_generated"]:
        return {**spent, "forecast_node_hours": None}  # nothing measured yet: nothing to forecast from
    taken = sum(s["prompts"] for s in finished)
    pilot_left = (pilot["prompts"] if pilot else 0) - sum(s.get("from_pilot", 0) for s in finished)
    left = max(0, prompts_total - taken - pilot_left)
    forecast = left * spent["node_hours"] / spent["prompts_generated"]
    price = node_price(config)
    checks = [("max_node_hours", budget["max_node_hours"], spent["node_hours"], forecast, "node-hours", "{:.3g}")]
    if budget["max_cost"] is not None:
        if price is None:
            raise BudgetError("generate.budget.max_cost needs a price: set generate.budget.profile to a node kind of "
                              "plan.profiles with its gpu_hour_price")
        checks.append(("max_cost", budget["max_cost"], spent["cost"], forecast * price, "$", "{:,.2f}"))
    for key, limit, used, coming, unit, fmt in checks:
        if limit is not None and used + coming > limit:
            def show(x):
                return f"${fmt.format(x)}" if unit == "$" else f"{fmt.format(x)} {unit}"
            raise BudgetError(f"generate budget: spent {show(used)} + forecast {show(coming)} for the {left:,} prompts "
                              f"left = {show(used + coming)}, over generate.budget.{key} {show(limit)}: no further "
                              f"generate job starts (finished shards are kept); raise it and re-run to go on")
    return {**spent, "forecast_node_hours": forecast, "prompts_left": left}


def read_summaries(folder: Path) -> list[dict]:
    """The summaries of the finished generate jobs in a completions folder: here, or in the
    storage when the folder is Snakemake's local copy of a stored one."""
    stored = stored_json(folder, "shard-", ".summary.json")
    return stored if stored is not None else [read_json(p) for p in sorted(Path(folder).glob("shard-*.summary.json"))]


def read_beside(path: Path, name: str) -> dict | None:
    """The JSON file ``name`` in the folder of ``path``: here, or fetched from the storage when the
    folder is Snakemake's local copy of a stored one; None when it is in neither."""
    return read_json_here_or_stored(Path(path).parent / name)


def budget_watch(config: dict, summary_path: Path, pilot: Path | None, prompts_path: Path):
    """generate.budget for one generate job, before it starts: BudgetError when the run would pass
    it; else, under a budget, the job's summary annotation (the run's spend once its shard is
    done), None without one. The pilot's own job (``pilot`` None) is never stopped: it measures
    what the forecast needs. Every job reads every finished summary, which grows with the square of
    the shards: only under a budget (without one the report sums the spend once)."""
    budget = config["generate"]["budget"]
    if not pilot or (budget["max_node_hours"] is None and budget["max_cost"] is None):
        return None
    finished, pilot_run = read_summaries(Path(summary_path).parent), read_beside(pilot, "generate.json")
    check_budget(config, finished, pilot_run, read_beside(prompts_path, "manifest.json")["prompts"])
    measured = finished + ([pilot_run] if pilot_run else [])
    return lambda summary: {"run_spend": spend(measured + [summary], config)}
