"""Stage 3, generate: completions of a prompt shard from the target, in process (decode: the CPU
sampler) or through a server (server: starting and waiting for one; backends; replay: requests and
their records), resumable (resume), within the run's budget (budget); or adopted from logged
exchanges (adopt). The shard driver and its job: stage."""
