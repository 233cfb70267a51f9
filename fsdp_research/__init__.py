"""fsdp_research: Hugging Face transformers trained with PyTorch FSDP2, composed by Hydra.

The subpackages, in the order they stack (each imports only from those above it in this list; errors imports
nothing of ours):

    errors        the one error shape: ConfigError(key, problem, fix) and its kin
    config/       what a run is: the schemas (Hydra's ConfigStore), `_target_` plug-ins, sizes as people write them
    distributed/  process groups and launch, the step's layout over ranks, the sharding plan and its application
                  (fully_shard, DDP), tensor parallel, precision, activation checkpointing, compile, parameter names
                  under wrappers
    data/         formats, token stores, sampling, the pipeline from config to batches
    optim/        optimizers (any `_target_`, Muon), parameter groups, schedules, clipping
    callbacks/    the hook protocol and the shipped callbacks (spike, grad_norms, ema)
    model/        the model on the meta device, its dimensions, initialisation (and its recorded writes),
                  pretrained loading, MoE balancing, and assembly: the model as training runs it
    checkpoint/   DCP resume checkpoints, Hugging Face export, consolidation
    metrics/      MFU/throughput/memory meters, sinks (console, JSONL, W&B), profiling, the hardware table
    planner/      memory, traffic and time per rank without allocating; `plan --fit`; the doctor
    train/        the trainer (the recipe), its start-up, state, losses, preemption, anomaly checks, the config's
                  checks (refusals), the run directory
    objectives/   in train/'s layer: what training minimizes, a plug-in (objective._target_); objective=lm, the
                  next-token loss
    jobs/         Hydra wiring (compose), launching workers, sweeps, SLURM, reports, Optuna search
    tools/        simulate (one rank of a large job), scaling (samples/s against devices)
    cli/          `fsdp-research <command>`: one module per subcommand

Reading path: train.py -> jobs/launch.py -> train/trainer.py (the recipe) -> model/assembly.py (build, AC,
compile, fully_shard) -> distributed/mesh.py, distributed/sharding.py -> checkpoint/dcp.py, checkpoint/resume.py.
"""
