# The pilot (config pilot): a stratified sample of every source and category through generate,
# validate and tokenize with the run's own settings, before the full generation. The stage rules
# are reused as they are, on the pilot's files.

rule pilot_prompts:
    """The sample: of each source and category, share x its prompts, at least min_per_category.
    The pilot section is read by the script, not a param: resizing a pilot that ran re-runs
    nothing (every generate job takes the pilot's records); --forcerun pilot_prompts makes it
    again, and every generate job after it. Turning it off or on once generate jobs finished is
    refused before the plan (dflash.plan.pilot.toggle_problem)."""
    input:
        f"{OUT}/prompts",
    output:
        prompts=f"{OUT}/pilot/prompts.jsonl.zst",
        selection=f"{OUT}/pilot/selection.json",
    log:
        f"{LOGS}/pilot/prompts.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/pilot_prompts.py"


if PILOT:

    use rule generate as pilot_generate with:
        input:
            prompts=f"{OUT}/pilot/prompts.jsonl.zst",
            target=TARGET_INPUT,
            server=f"{OUT}/servers/pilot.json" if LAUNCH else [],
        output:
            completions=f"{OUT}/pilot/completions.jsonl.zst",
            summary=f"{OUT}/pilot/generate.json",
        group:
            "pilot" if LAUNCH else None
        log:
            f"{LOGS}/pilot/generate.log",
        benchmark:
            f"{BENCH}/pilot/generate.tsv"

else:

    localrules:
        pilot_skipped,

    rule pilot_skipped:
        """pilot.enabled false: the pilot's files written empty, where snakemake runs (every
        generate job reads them)."""
        output:
            completions=f"{OUT}/pilot/completions.jsonl.zst",
            summary=f"{OUT}/pilot/generate.json",
        log:
            f"{LOGS}/pilot/generate.log",
        conda:
            "../envs/torch.yaml"
        script:
            "../scripts/pilot_skipped.py"


use rule validate as pilot_validate with:
    input:
        completions=f"{OUT}/pilot/completions.jsonl.zst",
        target=TARGET_INPUT,  # a `with: input:` replaces the rule's inputs: its special tokens again
    output:
        validated=f"{OUT}/pilot/validated.jsonl.zst",
        rejected=f"{OUT}/pilot/rejected.jsonl.zst",
        qa=f"{OUT}/pilot/qa.json",
    params:
        validate=validate_settings(config),
        # none: the pilot measures what the model writes; hand-made exclusions come later, and adding
        # ids re-runs only the validate jobs of the shards holding them
        excluded={},
    log:
        f"{LOGS}/pilot/validate.log",
    benchmark:
        f"{BENCH}/pilot/validate.tsv"


use rule tokenize as pilot_tokenize with:
    input:
        validated=f"{OUT}/pilot/validated.jsonl.zst",
        target=TARGET_INPUT,
    output:
        tensors=f"{OUT}/pilot/tokenized.safetensors",
        index=f"{OUT}/pilot/tokenized.json",
    log:
        f"{LOGS}/pilot/tokenize.log",
    benchmark:
        f"{BENCH}/pilot/tokenize.tsv"


if BURST and not ONLINE:

    use rule hidden as pilot_hidden with:
        input:
            tokenized=f"{OUT}/pilot/tokenized.safetensors",
            target=TARGET_INPUT,
        output:
            f"{OUT}/pilot/hidden.safetensors",
        log:
            f"{LOGS}/pilot/hidden.log",
        benchmark:
            f"{BENCH}/pilot/hidden.tsv"


rule pilot_train:
    """The training burst (pilot.train_steps): the run's drafter and train settings on the pilot's
    rows, timed (results/pilot/train_burst.json), the step rate the plan prices training with on
    this node kind. The drafter it trains is made in a temporary folder and thrown away."""
    input:
        tokenized=f"{OUT}/pilot/tokenized.safetensors",
        hidden=f"{OUT}/pilot/hidden.safetensors" if not ONLINE else [],
        target=TARGET_INPUT,
    output:
        f"{OUT}/pilot/train_burst.json",
    params:
        drafter=config["drafter"],
        train=config["train"],
        steps=config["pilot"]["train_steps"],
        kind=config["plan"]["pilot_profile"] or "local",
    threads: config["threads"]
    resources:
        gpu=1,  # one process: a data-parallel run's GPUs each take a step of this size
    log:
        f"{LOGS}/pilot/train.log",
    benchmark:
        f"{BENCH}/pilot/train.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/pilot_train.py"


rule pilot:
    """What the pilot measured (results/pilot/summary.json), printed on the console too: output
    lengths and rejects per category, the throughput seen, the gates' verdicts (not enforced here:
    the gate rule judges the full run)."""
    input:
        selection=f"{OUT}/pilot/selection.json",
        generated=f"{OUT}/pilot/generate.json",
        completions=f"{OUT}/pilot/completions.jsonl.zst",
        qa=f"{OUT}/pilot/qa.json",
        index=f"{OUT}/pilot/tokenized.json",
        burst=f"{OUT}/pilot/train_burst.json" if BURST else [],
    output:
        f"{OUT}/pilot/summary.json",
    params:
        gates=config["gates"],
        # the GPUs behind the measured rate: a started server's, the in-process model's one
        gpus=pilot_gpus(config),
    log:
        f"{LOGS}/pilot/summary.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/pilot.py"


rule plan:
    """The forecast per node kind of plan.profiles (results/plan.json, printed on the console):
    output tokens with their range, generation hours and cost per node count, data sizes, jobs."""
    input:
        manifest=lambda wildcards: prompt_file("manifest.json"),
        pilot=f"{OUT}/pilot/summary.json" if PILOT else [],
        target=TARGET_INPUT,  # its sizes, for the hidden-state cache
    output:
        f"{OUT}/plan.json",
    log:
        f"{LOGS}/plan.log",
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/plan.py"
