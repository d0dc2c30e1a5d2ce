from dflash.workflow import start_job

start_job(snakemake)

from dflash.acceptance import eval_result, merge_parts, write_eval  # noqa: E402
from dflash.curves import log_eval  # noqa: E402
from dflash.io import read_json  # noqa: E402

i = snakemake.input
cfg = {**snakemake.params.eval, "fast_kernels": snakemake.config["target"]["fast_kernels"]}  # as the decodings had it
trained, untrained, thinking_off = (merge_parts([read_json(path) for path in paths]) if paths else None
                                    for paths in (i.trained, i.untrained, i.thinking_off))
result = eval_result(trained, untrained, cfg, thinking_off)
write_eval(result, snakemake.output[0])
log_eval(snakemake.config, snakemake.wildcards.run, result)
