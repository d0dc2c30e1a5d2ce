rule validate:
    """Kept and rejected records (every rejection has reason codes) and the shard's QA counts."""
    input:
        # named once the prompts checkpoint is known: the excluded param reads its id index, and
        # waits for it through this input when a single shard is the target
        completions=after_prompts(f"{OUT}/completions/shard-{{shard}}.jsonl.zst"),
        # its special tokens: control_token_text looks for them written as text
        target=TARGET_INPUT,
    output:
        validated=f"{OUT}/validated/shard-{{shard}}.jsonl.zst",
        rejected=f"{OUT}/rejected/shard-{{shard}}.jsonl.zst",
        qa=f"{OUT}/qa/shard-{{shard}}.json",
    params:
        validate=validate_settings(config),
        excluded=excluded_in_shard,
    log:
        f"{LOGS}/validate/{{shard}}.log",
    benchmark:
        f"{BENCH}/validate/{{shard}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/validate.py"


rule qa_summary:
    """Every shard's QA counts, lengths and examples plus the tokenized rows' statistics, summed.
    Written whatever the numbers: the gate judges it, the QA page shows it."""
    input:
        qa=per_shard(f"{OUT}/qa/shard-{{shard}}.json"),
        tokenized=per_shard(f"{OUT}/tokenized/shard-{{shard}}.json"),
    output:
        f"{OUT}/qa/summary.json",
    log:
        f"{LOGS}/qa_summary.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/qa_summary.py"


rule gate:
    """Quality gates over the QA summary. The verdicts appear only when every gate passes;
    hidden-state and training jobs need them, so a failed gate stops them all."""
    input:
        summary=f"{OUT}/qa/summary.json",
        target=TARGET_INPUT,  # its size, for the hidden-state cache estimate
    output:
        f"{OUT}/qa/gates.json",
    params:
        gates=config["gates"],
        cache={"mode": config["train"]["hidden_states"], "max_bytes": config["hidden"]["max_cache_bytes"],
               "dtype": config["hidden"]["dtype"]},
    log:
        f"{LOGS}/gate.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/gate.py"
