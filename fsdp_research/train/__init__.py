"""Training: the trainer (the recipe: build, shard, step, log, checkpoint, evaluate, export), its start-up, the
step's schedule over micro-batches, the state a resume restores, the losses, evaluation, samples, preemption and
signals, anomaly checks, the config's checks (refusals: everything refused before any compute), the run directory
and its status, and the overfit verdict."""
