"""How a step is laid out over the ranks: the tensor-parallel groups, the shard group, the replica groups, the
micro-batches per step.
Pure functions of the config and the launch, the same for the trainer, the doctor and the planner."""

from dataclasses import dataclass

from omegaconf import DictConfig

from fsdp_research.config.schema import Strategy


@dataclass(frozen=True)
class Layout:
    world_size: int
    nodes: int
    # Groups of ranks holding the same shards (hsdp's replicate, every data-parallel rank for ddp); 1 otherwise.
    replicas: int
    # Data-parallel ranks one parameter is sharded over: dp / replicas (1 for ddp and ddp_classic).
    shard_group: int
    # Micro-batches of trainer.micro_batch_size each data-parallel rank runs per step (accumulation above 1).
    micro_steps: int
    # Tensor-parallel ranks (parallel.tp; innermost: ranks r and r + 1 share a group) and data-parallel ranks
    # (world_size / tp): the tp ranks of a group read the same batch.
    tp: int = 1
    # Expert-parallel ranks (parallel.ep): a divisor of the shard group, whose ranks (neighbours) split the experts.
    ep: int = 1

    def describe_mesh(self) -> str:
        replicas = f"dp_replicate {self.replicas} x " if self.replicas > 1 else ""
        line = f"mesh: {replicas}dp_shard {self.shard_group}"
        if self.ep > 1:
            line += f" (experts: dp_mod_ep {self.shard_group // self.ep} x ep {self.ep})"
        if self.tp > 1:
            line += f" x tp {self.tp} (ranks 0-{self.tp - 1} share a tp group)"
        return line


def layout(cfg: DictConfig, world_size: int, nodes: int = 1) -> Layout:
    strategy, tp = Strategy(cfg.sharding.strategy), cfg.parallel.tp
    dp = world_size // tp
    replicas = {Strategy.hsdp: cfg.sharding.replicate, Strategy.ddp: dp}.get(strategy, 1)
    t = cfg.trainer
    return Layout(
        world_size=world_size,
        nodes=nodes,
        replicas=replicas,
        shard_group=1 if strategy is Strategy.ddp_classic else dp // replicas,
        micro_steps=t.global_batch_size // (t.micro_batch_size * dp),
        tp=tp,
        ep=cfg.parallel.ep,
    )
