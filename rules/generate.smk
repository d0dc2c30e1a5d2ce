rule serve:
    """The inference server of generate.server.launch for the generate jobs that use it: they form
    one group job (on SLURM: one sbatch job, one node) and run at once; Snakemake stops the server
    (SIGTERM) when the last one ends.
    A shell rule: Snakemake 9.27 stops only shell jobs (a script service would never be stopped),
    and exec lets its SIGTERM reach the launcher. Snakemake's own Python runs the launcher, so the
    conda env only needs the server."""
    input:
        target=TARGET_INPUT,
    output:
        # on the node of its group, whatever the default storage: it only says where the server is
        local(service(f"{OUT}/servers/{{server}}.json")),
    params:
        python=sys.executable,
        # a name, the target's path unless set, that the generate jobs send as the model: no file is
        # read by it (a function, which `snakemake --lint` does not take for a hardcoded file prefix)
        served_model_name=lambda wildcards: config["generate"]["server"]["model"] or TARGET,
        # the pilot's server runs before any other (their generate jobs wait for the pilot): port + 0
        index=lambda wildcards: 0 if wildcards.server == "pilot" else int(wildcards.server),
    group:
        # the pilot's server and its one job apart: the other generate jobs wait for the pilot
        lambda wildcards: "pilot" if wildcards.server == "pilot" else "generate"
    threads: 1
    resources:
        gpu=LAUNCH["gpus"] if LAUNCH else 0,
    log:
        launcher=f"{LOGS}/serve/{{server}}.log",
        server=f"{LOGS}/serve/{{server}}.server.log",
    conda:
        # the launched server's: envs/sglang.yaml, envs/vllm.yaml, or for a plain OpenAI-compatible
        # server the pipeline's own (transformers serve needs its serving extra there)
        f"../envs/{DIALECTS[config['generate']['server']['dialect']].env}"
    # generate.server.launch comes as $DFLASH_LAUNCH (rules/common.smk sets it): on the command line its
    # env (HF_TOKEN) would show in ps to every user of the node, in printshellcmds and in .snakemake/metadata.
    shell:
        "exec {params.python:q} -m dflash.generate.server --service {output:q} --model {input.target:q}"
        " --served-model-name {params.served_model_name:q} --index {params.index}"
        " --log {log.launcher:q} --server-log {log.server:q}"


rule generate:
    """One completion record per prompt (exact token ids, raw text, reasoning/content split)."""
    input:
        prompts=lambda wildcards: prompt_file(f"shard-{wildcards.shard}.jsonl.zst"),
        target=TARGET_INPUT,
        server=server_file,
        # Its records of this shard are taken as they are. There even with pilot.enabled false (empty
        # then), and remade only when the prompts or the record settings change, which re-run every
        # shard anyway: turning the pilot off or on, or resizing it, re-runs no shard. (Not ancient:
        # Snakemake 9.27 would then skip this job's own params check whenever the pilot re-runs.)
        pilot=f"{OUT}/pilot/completions.jsonl.zst",
    output:
        completions=f"{OUT}/completions/shard-{{shard}}.jsonl.zst",
        summary=f"{OUT}/completions/shard-{{shard}}.summary.json",
    params:
        # What shapes the records: changing it re-runs the shards; where the server runs and how hard
        # the client pushes it (url, launch, concurrency, timeouts) does not. The script reads config.
        settings=record_settings(config["generate"]),
    group:
        "generate" if LAUNCH else None
    # A client of a started server claims no core: a group's jobs all run at once and Snakemake sums
    # their cores, so one core each would make even a dry run need --cores >= shards_per_server + 1.
    threads: 0 if LAUNCH else 1
    resources:
        # The in-process model needs the GPU; a server holds its own (the serve job claims them).
        gpu=1 if config["generate"]["backend"] == "transformers" else 0,
    log:
        f"{LOGS}/generate/{{shard}}.log",
    benchmark:
        f"{BENCH}/generate/{{shard}}.tsv"
    conda:
        "../envs/torch.yaml"
    script:
        "../scripts/generate.py"
