rule report:
    """One page: counts per stage, QA rates, the loss curve and acceptance per category."""
    input:
        manifest=lambda wildcards: prompt_file("manifest.json"),
        qa=per_shard(f"{OUT}/qa/shard-{{shard}}.json"),
        tokenized=per_shard(f"{OUT}/tokenized/shard-{{shard}}.json"),
        checkpoint=f"{OUT}/checkpoints/{RUN}",
        eval=f"{OUT}/eval/{RUN}.json",
    output:
        html=report(f"{OUT}/report/summary.html", caption="../report/summary.rst", category="Summary"),
        json=f"{OUT}/report/summary.json",
    log:
        f"{LOGS}/report.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/report.py"
