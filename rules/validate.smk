rule validate:
    """Kept and rejected records (every rejection has reason codes) and the shard's QA counts."""
    input:
        f"{OUT}/completions/shard-{{shard}}.jsonl.zst",
    output:
        validated=f"{OUT}/validated/shard-{{shard}}.jsonl.zst",
        rejected=f"{OUT}/rejected/shard-{{shard}}.jsonl.zst",
        qa=f"{OUT}/qa/shard-{{shard}}.json",
    params:
        validate=config["validate"],
    log:
        f"{LOGS}/validate/{{shard}}.log",
    benchmark:
        f"{BENCH}/validate/{{shard}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/validate.py"
