from pathlib import Path

from dflash.workflow import start_job

start_job(snakemake)

from dflash.budget import check_budget, read_beside, read_summaries, spend  # noqa: E402
from dflash.generate import generate_shard, use_started_server  # noqa: E402

config, i, out = snakemake.config, snakemake.input, snakemake.output
cfg = config["generate"]
if i.server:  # generate.server.launch: this group's serve job is starting the server
    cfg = use_started_server(cfg, i.server)
pilot = i.get("pilot") or None  # none: this is the pilot's own job
annotate = None
budget = config["generate"]["budget"]
if pilot and (budget["max_node_hours"] is not None or budget["max_cost"] is not None):
    # generate.budget: what the run has spent and will spend, from the finished jobs' summaries
    # (read only under a budget: every job reading every summary grows with the square of the
    # shards; without one, the report sums the spend once)
    finished, pilot_run = read_summaries(Path(out.summary).parent), read_beside(pilot, "generate.json")
    check_budget(config, finished, pilot_run, read_beside(i.prompts, "manifest.json")["prompts"])
    measured = finished + ([pilot_run] if pilot_run else [])

    def annotate(summary):  # the run's spend once this shard is done, as the budget counts it
        return {"run_spend": spend(measured + [summary], config)}

generate_shard(i.prompts, out.completions, i.target, cfg, out.summary, pilot=pilot, annotate=annotate,
               repetition=config["validate"]["repetition"])  # the loop watch judges as validation will
