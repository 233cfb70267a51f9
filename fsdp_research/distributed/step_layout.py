"""How a step is laid out over the ranks: the shard group, the replica groups, the micro-batches per step.
Pure functions of the config and the launch, the same for the trainer, the doctor and the planner."""

from dataclasses import dataclass

from omegaconf import DictConfig

from fsdp_research.config.schema import Strategy


@dataclass(frozen=True)
class Layout:
    world_size: int
    nodes: int
    # Groups of ranks holding the same shards (hsdp's replicate, every rank for ddp); 1 otherwise.
    replicas: int
    # Ranks one parameter is sharded over: world_size / replicas (1 for ddp and ddp_classic).
    shard_group: int
    # Micro-batches of trainer.micro_batch_size each rank runs per step (gradient accumulation above 1).
    micro_steps: int


def layout(cfg: DictConfig, world_size: int, nodes: int = 1) -> Layout:
    strategy = Strategy(cfg.sharding.strategy)
    replicas = {Strategy.hsdp: cfg.sharding.replicate, Strategy.ddp: world_size}.get(strategy, 1)
    t = cfg.trainer
    return Layout(
        world_size=world_size,
        nodes=nodes,
        replicas=replicas,
        shard_group=1 if strategy is Strategy.ddp_classic else world_size // replicas,
        micro_steps=t.global_batch_size // (t.micro_batch_size * world_size),
    )
