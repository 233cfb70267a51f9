"""Jobs: the Hydra wiring (compose: schemas in the ConfigStore, resolvers, compose() without @hydra.main), the
launch of workers (spawned, torchrun, srun) and its checks, sweeps and their status, SLURM submission, the sweep
report, and Optuna search. The library below never imports it."""
