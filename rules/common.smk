# Input helpers shared by the rules: which prompt shards exist is known once the prompts checkpoint ran.


def prompt_file(name):
    """A file of the prompts checkpoint; asking for it schedules the checkpoint when needed."""
    return f"{checkpoints.prompts.get().output[0]}/{name}"


def shards():
    return shard_ids(checkpoints.prompts.get().output[0])


def per_shard(pattern):
    """Input function: ``pattern`` for every prompt shard (known once the prompts exist)."""
    return lambda wildcards: expand(pattern, shard=shards())


def server_file(wildcards):
    """Input function: the service file of the started server (generate.server.launch) a shard's
    generate job uses, round robin over the instances; none when the server is the user's."""
    if not LAUNCH:
        return []
    # Only once the prompts exist: a group formed before the checkpoint ran is reused by Snakemake
    # 9.27 with the generate jobs the checkpoint replaced still in it, and they would run twice.
    checkpoints.prompts.get()
    return f"{OUT}/servers/{int(wildcards.shard) % LAUNCH['instances']}.json"
