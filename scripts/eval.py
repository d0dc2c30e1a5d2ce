from dflash.workflow import start_job

start_job(snakemake)

from dflash.acceptance import eval_result, merge_parts, write_eval  # noqa: E402
from dflash.io import read_json  # noqa: E402

i = snakemake.input
cfg = {**snakemake.params.eval, "fast_kernels": snakemake.config["target"]["fast_kernels"]}  # as the decodings had it
trained, untrained = (merge_parts([read_json(path) for path in paths]) for paths in (i.trained, i.untrained))
write_eval(eval_result(trained, untrained, cfg), snakemake.output[0])
