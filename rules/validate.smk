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


rule gate:
    """Quality gates over every shard's QA and token statistics. The QA summary appears only when
    every gate passes; hidden-state and training jobs need it, so a failed gate stops them all."""
    input:
        qa=per_shard(f"{OUT}/qa/shard-{{shard}}.json"),
        tokenized=per_shard(f"{OUT}/tokenized/shard-{{shard}}.json"),
    output:
        f"{OUT}/qa/summary.json",
    params:
        gates=config["gates"],
    log:
        f"{LOGS}/gate.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/gate.py"
