from dflash.workflow import start_job

start_job(snakemake)

from dflash.generate import generate_shard, use_started_server  # noqa: E402

cfg = snakemake.config["generate"]
if snakemake.input.server:  # generate.server.launch: this group's serve job is starting the server
    cfg = use_started_server(cfg, snakemake.input.server)
out = snakemake.output
generate_shard(snakemake.input.prompts, out.completions, snakemake.input.target, cfg, out.summary)
