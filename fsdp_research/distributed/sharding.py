"""The sharding plan as data (which modules become FSDP units, each with its reshard flag), and its
application with FSDP2's fully_shard (ddp too: replicated over every rank, a shard group of one), or torch's
DistributedDataParallel for the classic baseline."""

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fsdp_research.config.schema import ShardingConfig, Strategy
from fsdp_research.distributed.precision import fp32_policy
from fsdp_research.errors import ConfigError


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the module at `path` ("" is the root) and whether it reshards after forward (an int k: to
    groups of k ranks)."""

    path: str
    reshard_after_forward: bool | int
    # Other modules sharded together with it: they hold the same parameters (Zamba's shared transformer block).
    also: tuple[str, ...] = ()
    # Computes in fp32 whatever the training dtype: a module the family keeps in fp32 (a router's gate).
    fp32: bool = False
    # A routed-experts module split over parallel.ep: sharded over the data-parallel ranks that ep leaves.
    experts: bool = False

    @property
    def by_family(self) -> bool:
        """A unit the family's model asks for (fp32 modules, shared parameters), not the sharding strategy."""
        return self.fp32 or self.experts or bool(self.also)


@dataclass(frozen=True)
class ShardingPlan:
    strategy: Strategy
    # Innermost first, the root last; empty for ddp_classic.
    units: list[Unit]
    # The repeating blocks' paths, in forward order: what a reader of the plan (the doctor) holds units against.
    blocks: tuple[str, ...] = ()


def reshard(model: nn.Module) -> None:
    """Units that keep their parameters gathered after a forward (the root, the last block) until a backward that
    never comes (a check's or an eval's forward): sharded again, so that the optimizer, a save or an export gets the
    shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_groups(model: nn.Module) -> list:
    """FSDP's parameter groups of every unit of the model."""
    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]


@contextlib.contextmanager
def kept_gathered(model: nn.Module) -> Iterator[None]:
    """Every unit keeps its parameters gathered after each forward within (a generation's forwards, a token each:
    gathered once, not at every token, as TRL's ds3_gather_for_generation), then all are sharded again, each unit's
    reshard_after_forward as it was. Enter it after the model's first forward (FSDP's lazy init sets the root's)."""
    # FSDP2's public set_reshard_after_forward takes a bool only: a unit's k (reshard to groups of k) is kept so.
    groups = fsdp_groups(model)
    # A unit resharded to groups of k after that forward gathers from its k-group, which it finds by the info set
    # to None here: sharded fully first.
    reshard(model)
    saved = [g.post_forward_mesh_info for g in groups]
    for g in groups:
        g.post_forward_mesh_info = None
    try:
        yield
    finally:
        for g, info in zip(groups, saved):
            g.post_forward_mesh_info = info
        reshard(model)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def owner(name: str, unit_paths: Collection[str]) -> str:
    """The unit that owns a parameter: the deepest unit whose path contains it ("" is the root). Its prefixes
    looked up, deepest first (a set of paths: plan --fit asks for every parameter of thousands of experts)."""
    paths = unit_paths if isinstance(unit_paths, (set, frozenset)) else set(unit_paths)
    prefix = name
    while prefix:
        prefix = prefix.rpartition(".")[0]
        if prefix in paths:
            return prefix
    raise ValueError(f"no unit of {sorted(paths)[:3]} owns {name}")


def _block_reshard_flags(cfg: ShardingConfig, n_blocks: int) -> list[bool | int]:
    strategy = Strategy(cfg.strategy)
    # ddp: a shard group of one rank has nothing to reshard.
    if strategy in (Strategy.no_reshard, Strategy.ddp):
        return [False] * n_blocks
    # The last block's parameters are needed again as soon as backward starts: blockwise keeps them.
    flags = [True] * n_blocks if strategy is Strategy.reshard_all else [True] * (n_blocks - 1) + [False]
    value = cfg.reshard_after_forward
    return [value if flag and value is not None else flag for flag in flags]


def build_plan(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: ShardingConfig,
    fp32_modules: list[str] = (),
    experts: list[str] = (),
) -> ShardingPlan:
    """The units: fp32_modules (paths of modules kept in fp32, each its own unit inside its block), experts (paths
    of the routed-experts modules split over parallel.ep, each its own unit), the blocks or their Linears, the
    root."""
    strategy = Strategy(cfg.strategy)
    paths = {module: path for path, module in model.named_modules()}
    block_paths = tuple(paths[block] for block in blocks)
    if strategy is Strategy.ddp_classic:
        return ShardingPlan(strategy, [], block_paths)
    if max(cfg.prefetch_forward, cfg.prefetch_backward) >= len(blocks):
        key = "prefetch_forward" if cfg.prefetch_forward >= len(blocks) else "prefetch_backward"
        raise ConfigError(
            f"sharding.{key}",
            f"{cfg[key]} blocks ahead, but the model has {len(blocks)} blocks",
            f"use 0..{len(blocks) - 1}",
        )
    flags = _block_reshard_flags(cfg, len(blocks))
    for index, flag in cfg.reshard_override.items():
        if not 0 <= index < len(blocks):
            raise ConfigError(
                "sharding.reshard_override",
                f"block {index} does not exist (the model has {len(blocks)} blocks)",
                f"use indices 0..{len(blocks) - 1}",
            )
        flags[index] = flag
    units: list[Unit] = []
    if strategy is Strategy.per_linear:
        flag = True if cfg.reshard_after_forward is None else cfg.reshard_after_forward
        units = [Unit(paths[m], flag) for block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    elif strategy is not Strategy.root_only:
        units = [Unit(paths[block], flag) for block, flag in zip(blocks, flags)]
    block_flags = dict(zip(block_paths, flags))

    def flag_of(path: str) -> bool:
        return next((f for b, f in block_flags.items() if path.startswith(b + ".")), False)

    taken = {u.path for u in units} | set(block_paths)
    split = [Unit(p, flag_of(p), experts=True) for p in experts]
    kept = [Unit(p, flag_of(p), fp32=True) for p in fp32_modules if p and p not in taken]
    shared = [u for u in _shared(model, blocks) if u.path not in taken]
    # The root's own flag is moot: FSDP keeps the root gathered for backward.
    return ShardingPlan(strategy, split + kept + shared + units + [Unit("", False)], block_paths)


def _shared(model: nn.Module, blocks: list[nn.Module]) -> list[Unit]:
    """Parameters that several blocks hold (Zamba's one transformer block, called from several hybrid layers
    through modules of their own): the outermost modules of each block that hold only such parameters, sharded
    together as one unit (a parameter can be in one unit only; calling any of them gathers it), kept gathered
    for the step (every block that holds it needs it again)."""
    holders: dict[int, int] = {}
    for block in blocks:
        for param in {id(p) for p in block.parameters()}:
            holders[param] = holders.get(param, 0) + 1
    shared = {p for p, n in holders.items() if n > 1}
    if not shared:
        return []
    paths = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    groups: dict[frozenset, list[str]] = {}
    for block in blocks:
        outer = []
        for module in block.modules():
            params = {id(p) for p in module.parameters()}
            inside = any(paths[id(module)].startswith(o + ".") for o in outer)
            if params and params <= shared and not inside:
                outer.append(paths[id(module)])
                groups.setdefault(frozenset(params), []).append(paths[id(module)])
    return [Unit(group[0], False, also=tuple(group[1:])) for group in groups.values()]


def apply_prefetch(model: nn.Module, plan: ShardingPlan, cfg: ShardingConfig) -> None:
    """Each block unit all-gathers the next prefetch_forward blocks as its forward starts, and the next
    prefetch_backward blocks (in backward's order) as its backward starts; 0 leaves FSDP2's implicit prefetch."""
    blocks = [model.get_submodule(path) for path in plan.blocks]
    for index, block in enumerate(blocks):
        if cfg.prefetch_forward:
            block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 1 + cfg.prefetch_forward])
        if cfg.prefetch_backward:
            block.set_modules_to_backward_prefetch(blocks[max(0, index - cfg.prefetch_backward) : index][::-1])


def apply_fsdp(
    model: nn.Module,
    plan: ShardingPlan,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    cfg: ShardingConfig,
    experts: DeviceMesh | None = None,
) -> nn.Module:
    """fully_shard each unit of the plan, innermost first (the model may still be on the meta device), then the
    explicit prefetch between blocks. Experts units shard over `experts` (the data-parallel ranks ep leaves); their
    gradients, summed over the ep ranks' tokens by the all-to-all, are divided by every data-parallel rank as the
    others' are averaged (a plain sum and a division: gloo has no pre-multiplied sum)."""
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if cfg.cpu_offload:
        # Pinned host memory needs an accelerator: on CPU the policy only keeps the state where it is.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    for unit in plan.units:
        policy = {"mp_policy": fp32_policy()} if unit.fp32 else {}
        modules = [model.get_submodule(path) for path in (unit.path, *unit.also)]
        if unit.experts:
            policy["mesh"] = experts
        fully_shard(
            modules if unit.also else modules[0],
            reshard_after_forward=unit.reshard_after_forward,
            **{**kwargs, **policy},
        )
        if unit.experts:
            modules[0].set_gradient_divide_factor(float(mesh.size()))
            # A shard group of one divides by the factor itself (and again after a forced sum).
            split = experts.size(experts.mesh_dim_names.index("dp_mod_ep")) > 1
            modules[0].set_force_sum_reduction_for_comms(split)
    apply_prefetch(model, plan, cfg)
    return model


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Plain data parallel, on a materialized model."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def grad_sync(model: nn.Module, last: bool, defer: bool):
    """Context for one micro-batch's backward. Across replicas (hsdp, ddp) the gradients are all-reduced after the
    last micro-batch only: before it they accumulate reduce-scattered into the shards, which costs no memory.
    Within a shard group each micro-batch reduce-scatters, unless `defer` (trainer.defer_grad_sync): then every
    unit holds its unsharded gradient until the last. torch's DDP holds whole gradients anyway, and defers."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last or not defer)
    model.set_requires_all_reduce(last)
    return contextlib.nullcontext()
