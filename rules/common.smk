# The functions of the workflow: the config checks' way out, where inputs and outputs live, the
# prompts checkpoint's shards (known once it ran). Included first: the Snakefile's checks use them.
import functools
import os
import shutil
import sys
from pathlib import Path

from dflash.config import ConfigError
from dflash.errors import debug_requested
from dflash.storage import check_s3_prefix, fetch_from_storage, stored_root
from dflash.validate import exclusion_file_problem, exclusions_by_shard, read_exclusions


def stop(problem):
    """A configuration problem on the console as its own lines, which name the file and the key,
    without Snakemake's traceback frames (DFLASH_DEBUG=1 shows them)."""
    if debug_requested():
        raise ConfigError(problem)
    print(problem, file=sys.stderr, flush=True)
    sys.exit(1)


def external(path):
    """A file from outside the pipeline (a prompt source, a model folder): read where it is, never
    looked up in the default storage that holds the outputs. With outputs in a storage its time
    says nothing (a new machine's copy is newer than the outputs made from it): ancient, so a
    changed source is re-run with --forcerun prompts."""
    return ancient(local(path)) if STORED else local(path)


def replaced_folder(path):
    """A folder output its job replaces as a whole, only once the new one is complete
    (dflash.io.atomic_dir): Snakemake must not delete the old one before the job runs, or a job
    that fails (a bad new source, a crash) would cost the finished prompts, target or drafter it
    had (Snakemake restores the old one when the job fails). Not with a default storage: there
    Snakemake's backup would need a local copy a fresh node does not have."""
    return directory(path) if STORED else update(directory(path))


def check_storage(write):
    """One line before any job, instead of a traceback from the first existence check, or an
    upload that fails after a paid-for job."""
    problem = check_s3_prefix(STORAGE_PREFIX, workflow.storage_registry.default_storage_provider.s3c, write)
    if problem:
        stop(problem)


def settle_backups():
    """Snakemake backs up a replaced_folder output before its job (update()) and drops the backup
    when the job ends; a run killed in between leaves it, and Snakemake 9.27 then fails the next
    job of that output copying onto it. The job replaces the folder only once complete, so the
    backup is stale: dropped while the folder is there, put back in the rare case the kill came
    between the job's two renames and the folder is gone."""
    backup_of = workflow.persistence._get_backup_path  # Snakemake's own mapping: output -> backup
    checkpoints = Path(f"{OUT}/checkpoints")
    runs = [checkpoints / b.name for b in backup_of(checkpoints).iterdir()] if backup_of(checkpoints).is_dir() else []
    for folder in [Path(f"{OUT}/prompts"), Path(f"{OUT}/target"), *runs]:
        backup = backup_of(folder)
        if backup.is_dir():
            if folder.exists():
                shutil.rmtree(backup)
            else:
                logger.warning(f"{folder}: put back from Snakemake's backup (a run was killed while replacing it)")
                shutil.move(backup, folder)


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
