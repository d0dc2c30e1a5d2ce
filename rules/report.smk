rule qa_report:
    """The QA page: rates per check and category, length distributions, examples per reason.
    It needs no gate, so it can be built to see why one failed. The page's date, config digest and
    pipeline commit are found by the job itself: a commit alone does not re-run it."""
    input:
        f"{OUT}/qa/summary.json",
    output:
        report(f"{OUT}/report/qa.html", caption="../report/qa.rst", category="Quality"),
    log:
        f"{LOGS}/qa_report.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/qa_report.py"


rule report:
    """One page that leads with the answer (records kept, trainable tokens, acceptance trained vs
    untrained, gates, generation's cost, time per stage), then counts per stage, QA rates, the
    gates, the loss curve, acceptance per category, and whether the run's outputs are in the
    storage (safe to destroy the machine)."""
    input:
        manifest=lambda wildcards: prompt_file("manifest.json"),
        qa=f"{OUT}/qa/summary.json",
        gates=f"{OUT}/qa/gates.json",
        checkpoint=f"{OUT}/checkpoints/{RUN}",
        eval=f"{OUT}/eval/{RUN}.json",
        # last of the run, so its check of what this machine alone holds sees every other job done
        qa_page=f"{OUT}/report/qa.html",
        pilot=f"{OUT}/pilot/summary.json" if PILOT else [],
        plan=f"{OUT}/plan.json" if PLANNED else [],
        # what generation took and cost: every generate job's summary, the pilot's included
        generated=per_shard(f"{OUT}/completions/shard-{{shard}}.summary.json"),
        pilot_generated=f"{OUT}/pilot/generate.json",
    params:
        storage_prefix=STORAGE_PREFIX,
        # time per stage: read as found (every job upstream has written its benchmark file by then)
        benchmarks=BENCH,
    output:
        html=report(f"{OUT}/report/summary.html", caption="../report/summary.rst", category="Summary"),
        json=f"{OUT}/report/summary.json",
    log:
        f"{LOGS}/report.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/report.py"


rule safe_to_destroy:
    """Would anything be lost if this machine vanished now? Every file of the run here that the
    storage lacks or holds otherwise, and every job output marked incomplete; fails unless it is
    safe to destroy. No output: it checks anew each time it is named (snakemake safe_to_destroy)."""
    params:
        prefix=STORAGE_PREFIX,
    log:
        f"{LOGS}/safe_to_destroy.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/safe_to_destroy.py"
