from dflash.workflow import start_job

start_job(snakemake)

from dflash.target import target_job  # noqa: E402

# the drafter section from the config, not a param: a new drafter must not remake the target
target_job(list(snakemake.input.sources), snakemake.output[0], snakemake.params.build, snakemake.config["drafter"])
