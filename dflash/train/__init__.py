"""Stage 7, train: the DFlash drafter (drafter), its objective (objective), batches, optimizers
(optim), the loop and its job (stage), resume points (resume), the train log (log), data
parallelism (parallel) and the launcher of its processes (launch: torchrun on a node, or one per
node of a SLURM allocation)."""
