from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.validate.gates import gate_job  # noqa: E402

gate_job(snakemake.config, snakemake.input.summary, snakemake.input.target, snakemake.output[0])
