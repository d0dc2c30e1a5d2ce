from dflash.workflow import start_job

start_job(snakemake)

from transformers import AutoTokenizer  # noqa: E402

from dflash.tokenize import tokenize_shard  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(snakemake.input.target)
out = snakemake.output
tokenize_shard(snakemake.input.validated, out.tensors, out.index, tokenizer, snakemake.params.tokenize)
