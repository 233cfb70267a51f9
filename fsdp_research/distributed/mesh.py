"""The one owner of the device mesh (as torchtitan's ParallelDims): the parallel degrees a config asks for on a
world size, the DeviceMesh they make, built once, and every sub-mesh, rank and size the rest of the code asks for.
The axes, outermost first: pp (pipeline stages, across nodes), replicate, shard (itself dp_shard x cp for context
parallel, dp_mod_ep x ep for the experts), tp innermost, so the ranks of a tp group are neighbours (one node's
devices), the cp ranks next. No other module builds, slices or unflattens a mesh, or computes a rank from degrees
(tests/test_layout.py holds it)."""

from dataclasses import dataclass

import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_research.config.schema import Strategy


@dataclass(frozen=True)
class Degrees:
    """Ranks along each axis. pp x replicate x shard x tp = world size; cp and ep split the shard axis. hybrid: the
    mesh has its replicate axis even at one replica (hsdp and ddp: FSDP2 replicates over it)."""

    replicate: int
    shard: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    hybrid: bool = False
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read batches of their own: a tp x cp group splits one batch, the stages of a pipeline pass it
        on."""
        return self.world_size // (self.pp * self.tp * self.cp)


def degrees(cfg: DictConfig, world_size: int) -> Degrees:
    """The degrees of `cfg` (its sharding and parallel sections) on world_size ranks: ddp replicates over every
    data-parallel rank, hsdp over sharding.replicate groups."""
    strategy, tp, pp = Strategy(cfg.sharding.strategy), cfg.parallel.tp, cfg.parallel.pp
    dp = world_size // (tp * pp)
    replicate = {Strategy.hsdp: cfg.sharding.replicate, Strategy.ddp: dp}.get(strategy, 1)
    hybrid = strategy in (Strategy.hsdp, Strategy.ddp)
    return Degrees(replicate, dp // replicate, tp, cfg.parallel.cp, cfg.parallel.ep, hybrid, pp)


class Mesh:
    """The DeviceMesh of `degrees` on device_type (a collective: every rank builds it), and its sub-meshes."""

    def __init__(self, degrees: Degrees, device_type: str):
        self.degrees = degrees
        shape, names = (degrees.shard,), ("shard",)
        if degrees.hybrid:
            shape, names = (degrees.replicate, degrees.shard), ("replicate", "shard")
        if degrees.tp > 1:
            shape, names = (*shape, degrees.tp), (*names, "tp")
        if degrees.pp > 1:
            shape, names = (degrees.pp, *shape), ("pp", *names)
        self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)

    @property
    def fsdp(self) -> DeviceMesh:
        """The mesh FSDP shards over: the data-parallel axes (replicate, shard) of this rank's stage."""
        names = tuple(n for n in self.device_mesh.mesh_dim_names if n not in ("tp", "pp"))
        return self.device_mesh if len(names) == self.device_mesh.ndim else self.device_mesh[_one_or_all(names)]

    @property
    def tp(self) -> DeviceMesh:
        return self.device_mesh["tp"]

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold this rank's pipeline stage (the mesh without its pp axis); None: every rank."""
        if self.degrees.pp == 1:
            return None
        names = self.device_mesh.mesh_dim_names[1:]
        stage = self.device_mesh[_one_or_all(names)]
        return (stage._flatten() if stage.ndim > 1 else stage).get_group()

    def ends(self) -> dist.ProcessGroup | None:
        """This rank's group with its peer at the other end of its pipeline (the first and the last stage's ranks
        at the same place within their stages), None on the stages between (a collective: every rank builds every
        group)."""
        stage, rank, pp = dist.get_world_size() // self.degrees.pp, dist.get_rank(), self.degrees.pp
        mine = None
        for i in range(stage):
            pair = [i, i + (pp - 1) * stage]
            group = dist.new_group(pair)
            mine = group if rank in pair else mine
        return mine

    @property
    def pp(self) -> DeviceMesh:
        """The pipeline's mesh: this rank and the ranks of the other stages that pass its micro-batches on."""
        return self.device_mesh["pp"]

    @property
    def context(self) -> DeviceMesh:
        """The cp mesh a sequence is split over: the shard axis seen as dp_shard x cp, the cp ranks neighbours."""
        shard, cp = self.degrees.shard, self.degrees.cp
        return self.device_mesh._unflatten("shard", (shard // cp, cp), ("dp_shard", "cp"))["cp"]

    @property
    def experts(self) -> tuple[DeviceMesh, DeviceMesh]:
        """(the ep mesh the experts are split over, the data-parallel mesh their FSDP shards over): the shard axis
        seen as dp_mod_ep x ep, the ep ranks neighbours."""
        shard, ep = self.degrees.shard, self.degrees.ep
        split = self.device_mesh._unflatten("shard", (shard // ep, ep), ("dp_mod_ep", "ep"))
        data = tuple(n for n in split.mesh_dim_names if n in ("replicate", "dp_mod_ep"))
        return split["ep"], split[_one_or_all(data)]


def _one_or_all(names: tuple[str, ...]) -> str | tuple[str, ...]:
    return names if len(names) > 1 else names[0]


def data_parallel(tp: int, cp: int = 1, pp: int = 1) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel ranks): the tp x cp neighbouring ranks of a group read
    the same batch (tp innermost, cp next), and so do a pipeline's stages (pp outermost)."""
    group, stage_ranks = tp * cp, dist.get_world_size() // pp
    return dist.get_rank() % stage_ranks // group, stage_ranks // group


def one_per_data_rank(parts: list, tp: int) -> list:
    """Of every rank's part (in rank order, as all_gather gives them; no pp, no cp), one of each tp group, whose ranks
    read the same batch: the data-parallel ranks', in their order."""
    return parts[::tp]


def pipeline_rank(pp: int) -> int:
    """This rank's place in its pipeline (pp outermost: ranks 0 .. world / pp - 1 hold the first stage)."""
    return dist.get_rank() // (dist.get_world_size() // pp)
