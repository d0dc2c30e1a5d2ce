from dflash.workflow import start_job

start_job(snakemake)

from dflash.eval import eval_result, write_eval  # noqa: E402
from dflash.io import read_json  # noqa: E402

i = snakemake.input
cfg = {**snakemake.params.eval, "fast_kernels": snakemake.config["target"]["fast_kernels"]}  # as the decodings had it
write_eval(eval_result(read_json(i.trained), read_json(i.untrained), cfg), snakemake.output[0])
