from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.validate.stage import validate_job  # noqa: E402

i, o = snakemake.input, snakemake.output
# the pilot's job validates with no exclusions: its rule gives excluded={}
validate_job(snakemake.config, i.completions, i.target, o.validated, o.rejected, o.qa, snakemake.params.excluded)
