rule qa_report:
    """The QA page: rates per check and category, length distributions, examples per reason.
    It needs no gate, so it can be built to see why one failed."""
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
    """One page: counts per stage, QA rates, the gates, the loss curve and acceptance per category."""
    input:
        manifest=lambda wildcards: prompt_file("manifest.json"),
        qa=f"{OUT}/qa/summary.json",
        gates=f"{OUT}/qa/gates.json",
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
