from dflash.workflow import start_job

start_job(snakemake)

from dflash.validate import validate_job  # noqa: E402

out = snakemake.output
validate_job(snakemake.input.completions, out.validated, out.rejected, out.qa, snakemake.params.validate,
             snakemake.params.excluded, snakemake.input.target)
