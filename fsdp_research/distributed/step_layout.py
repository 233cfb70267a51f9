"""How a step is laid out over the ranks: the tensor-parallel groups, the shard group (with its context-parallel part),
the replica groups, the micro-batches per step.
Pure functions of the config and the launch, the same for the trainer, the doctor and the planner."""

from dataclasses import dataclass

from omegaconf import DictConfig

from fsdp_research.config.schema import Strategy
from fsdp_research.distributed.mesh import degrees


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
    # Context-parallel ranks (parallel.cp): the inner part of the shard group (dp_shard x cp), splitting each
    # sequence; the data-parallel ranks are world_size / tp / cp.
    cp: int = 1
    # Pipeline stages (parallel.pp; outermost): each holds some of the layers, the data-parallel ranks are
    # world_size / pp / tp / cp.
    pp: int = 1

    def describe_mesh(self) -> str:
        replicas = f"dp_replicate {self.replicas} x " if self.replicas > 1 else ""
        replicas = f"pp {self.pp} x {replicas}" if self.pp > 1 else replicas
        line = f"mesh: {replicas}dp_shard {self.shard_group // self.cp}"
        if self.cp > 1:
            line += f" x cp {self.cp} (FSDP over dp_shard x cp)"
        if self.ep > 1:
            line += f" (experts: dp_mod_ep {self.shard_group // self.ep} x ep {self.ep})"
        if self.tp > 1:
            line += f" x tp {self.tp} (ranks 0-{self.tp - 1} share a tp group)"
        return line


def layout(cfg: DictConfig, world_size: int, nodes: int = 1) -> Layout:
    d, t = degrees(cfg, world_size), cfg.trainer
    return Layout(
        world_size=world_size,
        nodes=nodes,
        replicas=d.replicate,
        shard_group=1 if Strategy(cfg.sharding.strategy) is Strategy.ddp_classic else d.shard,
        micro_steps=t.global_batch_size // (t.micro_batch_size * d.data_parallel_size),
        tp=d.tp,
        ep=d.ep,
        cp=d.cp,
        pp=d.pp,
    )
