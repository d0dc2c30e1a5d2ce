from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.plan.pilot import pilot_job  # noqa: E402

i = snakemake.input
pilot_job(snakemake.config, i.selection, i.generated, i.completions, i.qa, i.index, i.burst, snakemake.output[0])
