"""Looking into a run's files from a shell: ``dflash check tools`` (check: what the tool records
would teach) and ``dflash inspect`` (files: the records of a shard or a stage's folder, filtered).
``dflash check run`` reads the report's headline: the report family's."""
