from dflash.core.workflow import start_job

start_job(snakemake)

from dflash.eval.stage import eval_decode_job  # noqa: E402

i, w = snakemake.input, snakemake.wildcards
# the untrained drafter has no checkpoint: the job makes one of the config's shape
eval_decode_job(snakemake.config, i.checkpoint or None, i.target, i.heldout, snakemake.output[0], w.drafter,
                int(w.part), snakemake.log[0])
