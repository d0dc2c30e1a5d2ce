from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.generate.stage import generate_job  # noqa: E402

i, out = snakemake.input, snakemake.output
# no pilot input: this is the pilot's own job; a server input: this group's serve job starts it
generate_job(snakemake.config, i.prompts, out.completions, i.target, out.summary, pilot=i.get("pilot") or None,
             server=i.server or None)
