rule tokenize:
    """Flat token rows (prompt ids + output ids, loss mask on the output) the trainer memory-maps."""
    input:
        validated=f"{OUT}/validated/shard-{{shard}}.jsonl.zst",
        target=TARGET_INPUT,
    output:
        tensors=f"{OUT}/tokenized/shard-{{shard}}.safetensors",
        index=f"{OUT}/tokenized/shard-{{shard}}.json",
    params:
        tokenize=config["tokenize"],
    log:
        f"{LOGS}/tokenize/{{shard}}.log",
    benchmark:
        f"{BENCH}/tokenize/{{shard}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/tokenize.py"
