from dflash.workflow import start_job

start_job(snakemake)

from dflash.generate import generate_shard  # noqa: E402

generate_shard(snakemake.input.prompts, snakemake.output[0], snakemake.input.target, snakemake.params.generate)
