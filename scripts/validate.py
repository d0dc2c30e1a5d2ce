from dflash.workflow import start_job

start_job(snakemake)

from dflash.text_checks import target_special_tokens  # noqa: E402
from dflash.validate import validate_shard  # noqa: E402

out = snakemake.output
validate_shard(snakemake.input.completions, out.validated, out.rejected, out.qa, snakemake.params.validate,
               snakemake.params.excluded, target_special_tokens(snakemake.input.target))
