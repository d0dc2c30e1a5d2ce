from dflash.workflow import start_job

start_job(snakemake)

from dflash.report import write_report  # noqa: E402

i, o = snakemake.input, snakemake.output
write_report(snakemake.config, i.manifest, i.qa, i.gates, i.checkpoint, i.eval, o.html, o.json)
