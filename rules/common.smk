# Input helpers shared by the rules: which prompt shards exist is known once the prompts checkpoint ran.
import functools
import os

from dflash.storage import fetch_from_storage
from dflash.validate import exclusions_by_shard, read_exclusions


def prompt_file(name):
    """A file of the prompts checkpoint; asking for it schedules the checkpoint when needed. Named
    by the rule's path, not the checkpoint's output object: with a default storage that object is
    the local copy, which the storage would take for another file."""
    checkpoints.prompts.get()
    return f"{OUT}/prompts/{name}"


def prompts_dir():
    """The prompts checkpoint's folder on this machine. With a default storage (S3) that is a local
    copy, which Snakemake removes after use and a fresh machine never had: the small files read to
    plan (the manifest, the id index) are fetched from the storage when missing."""
    out = checkpoints.prompts.get().output[0]
    if out.is_storage:
        fetch_from_storage(out, ["manifest.json", "ids.tsv"])
    return str(out)


def shards():
    return shard_ids(prompts_dir())


def per_shard(pattern):
    """Input function: ``pattern`` for every prompt shard (known once the prompts exist)."""
    return lambda wildcards: expand(pattern, shard=shards())


def after_prompts(pattern):
    """Input function: ``pattern``, named only once the prompts checkpoint is known. A job whose
    params read the checkpoint's files (its id index) then waits for it, as Snakemake requires,
    with the same input files as before."""

    def files(wildcards):
        checkpoints.prompts.get()
        return pattern.format(**wildcards)

    return files


def server_file(wildcards):
    """Input function: the service file of the started server (generate.server.launch) a shard's
    generate job uses: consecutive blocks of shards_per_server shards share one; none when the
    server is the user's."""
    if not LAUNCH:
        return []
    # Only once the prompts exist: a group formed before the checkpoint ran is reused by Snakemake
    # 9.27 with the generate jobs the checkpoint replaced still in it, and they would run twice.
    checkpoints.prompts.get()
    return f"{OUT}/servers/{int(wildcards.shard) // LAUNCH['shards_per_server']}.json"


@functools.cache
def _exclusions_by_shard(folder, files, _prompts_written):
    by_shard, unknown = exclusions_by_shard(read_exclusions(files), folder)
    if unknown:
        logger.warning(f"validate.exclude: {len(unknown)} id(s) held by no prompt shard (held out or mistyped): "
                       + ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else ""))
    return by_shard


def excluded_in_shard(wildcards):
    """Params function: the excluded ids (with reasons) a shard holds. As a param, not an input,
    a new id re-runs only the validate job of its shard; the exclusion files themselves are no input."""
    files = tuple(config["validate"]["exclude"])
    if not files:
        return {}
    folder = prompts_dir()
    # Keyed on the prompts' write time too: a prompts job re-run in this process moves ids.
    written = os.path.getmtime(os.path.join(folder, "ids.tsv"))
    return _exclusions_by_shard(folder, files, written).get(wildcards.shard, {})


def eval_parts(run, drafter):
    """The files of one eval decoding, a part per eval job."""
    return [f"{OUT}/eval/{run}/{drafter}.{part}.json" for part in range(config["eval"]["jobs"])]
