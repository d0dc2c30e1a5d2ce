from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.core.storage import safe_to_destroy_job  # noqa: E402

safe_to_destroy_job(snakemake.config, ".", snakemake.params.prefix)
