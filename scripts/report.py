from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.report.stage import report_job  # noqa: E402

i, o = snakemake.input, snakemake.output
# the storage's answer leaves out this job's own files: written and uploaded after it looks
report_job(snakemake.config, i.manifest, i.qa, i.gates, i.checkpoint, i.eval, o.html, o.json, pilot=i.pilot or None,
           plan=i.plan or None, generated=[*i.generated, i.pilot_generated], benchmarks=snakemake.params.benchmarks,
           storage=(snakemake.params.storage_prefix, [o.html, o.json, snakemake.log[0]]))
