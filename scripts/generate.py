from dflash.workflow import start_job

start_job(snakemake)

from dflash.generate import generate_shard  # noqa: E402

out = snakemake.output
generate_shard(snakemake.input.prompts, out.completions, snakemake.input.target, snakemake.params.generate, out.summary)
