"""Materialize a meta-device model shard by shard, and initialise it as its family does (its `_init_weights`:
Gemma's zero-centred norm scales, GPT-2's scaled residual projections, padding rows, routers, ...), identically at
any world size, each rank computing its shard's rows only.

A group is one repeating block, or what lies outside the blocks (embeddings, final norm, head). The family's init
runs over the group's modules as transformers runs it (children first, each sub-model with its own
`_init_weights`), after torch's reset_parameters where a module has a parameter of unknown constructor values, on
meta stand-ins: what it writes is recorded (fsdp_research.model.recorded_init), after what the constructors wrote (small
parameters' values, large ones' recipes), and replayed on this rank's rows, chunk by chunk from generators seeded
by (seed, group, parameter, chunk). A parameter nothing initialises refuses the run. A group whose init cannot be
replayed row by row (an orthogonal init, a value read back) runs at full size on the CPU instead, over stand-ins
holding the constructors' values, each rank keeping its slice."""

import logging
import math
import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.processes import control_group
from fsdp_research.errors import ConfigError
from fsdp_research.model.architecture import as_built
from fsdp_research.model.recipes import Recipe, Unsupported, replay
from fsdp_research.model.recorded_init import recording

log = logging.getLogger("fsdp_research")


def materialize(model: nn.Module, params: torch.device, device: torch.device) -> None:
    """Allocate this rank's shards on `params` (the CPU under cpu_offload), uninitialised; buffers (rotary tables)
    keep their values, on the compute device."""
    buffers = {
        (module, name): buf.to(device)
        for module in model.modules()
        for name, buf in module.named_buffers(recurse=False)
    }
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    model.to_empty(device=params)
    # to_empty gives each module its own new tensor, which unties shared weights: tie them again as they were (not by
    # transformers' tie_weights, which cannot reach a head that LoRA wrapped: the weight is its base layer's).
    for (first, first_name), *others in places.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    for (module, name), buf in buffers.items():
        module._buffers[name] = buf


def _modules(root: nn.Module, path: str, skip: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """root's modules with their paths in the model, without the subtrees rooted at `skip` (modules by id)."""
    yield path, root
    for name, child in root.named_children():
        if id(child) not in skip:
            yield from _modules(child, f"{path}.{name}" if path else name, skip)


def _init(module: nn.Module, init_fn, skip: set[int]) -> None:
    """transformers' order: children first, each sub-model (a PreTrainedModel) with its own _init_weights."""
    from transformers import PreTrainedModel

    for child in module.children():
        if id(child) not in skip:
            _init(child, child._init_weights if isinstance(child, PreTrainedModel) else init_fn, skip)
    init_fn(module)


def _keep_shard(target: nn.Parameter, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank has the same full tensor; each slices its own, no communication.
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def _init_fn(model: nn.Module, path: str):
    """The _init_weights of the innermost sub-model (PreTrainedModel) that holds the module at path; none for a
    model of one's own, whose values are kept as its factory built them."""
    from transformers import PreTrainedModel

    parts = path.split(".") if path else []
    owners = [model.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    found = [m for m in owners if isinstance(m, PreTrainedModel)]
    return found[-1]._init_weights if found else (lambda module: None)


def _stand_in(module: nn.Module, name: str, shape: torch.Size, seed: int) -> nn.Parameter:
    """A full-size parameter holding what the module's constructor gave it (NaN where that is not known), for
    torch's reset and the family's _init_weights to overwrite where they initialise it."""
    built = as_built(module, name)
    if isinstance(built, torch.Tensor):
        return nn.Parameter(built.clone().reshape(shape))
    if isinstance(built, Recipe):
        return nn.Parameter(replay(built, 0, shape[0] if shape else 1, seed).reshape(shape))
    return nn.Parameter(_from_spread(built, shape, torch.Generator().manual_seed(seed)))


def _from_spread(built, shape, generator: torch.Generator) -> torch.Tensor:
    """Values of the (mean, std) a constructor's large parameter had (NaN where not finite: torch.empty's)."""
    values = torch.full(shape, float("nan"))
    if built is not None and all(math.isfinite(v) for v in built):
        values.normal_(*built, generator=generator) if built[1] > 0 else values.fill_(built[0])
    return values


def _start(built, shape):
    """A chunk's values before the group's init writes: what the constructor gave the parameter."""
    if isinstance(built, torch.Tensor):
        rows = built.reshape(shape if shape else (1,))
        return lambda first, last, generator: rows[first:last].clone()
    return lambda first, last, generator: _from_spread(built, (last - first, *shape[1:]), generator)


def _needs_reset(module: nn.Module) -> bool:
    """A module with a parameter whose constructor values are known by their spread only, or not at all."""
    return any(
        not isinstance(as_built(module, n), (torch.Tensor, Recipe))
        for n, p in module._parameters.items()
        if p is not None
    )


def _reset(modules: list[nn.Module], generator_seed: int) -> None:
    """torch's constructor initialisation of the modules with such a parameter (what their constructors do after
    registering it), from a stream of its own: what _init_weights draws from the group's seed stays the same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(generator_seed)
        for module in modules:
            if _needs_reset(module):
                getattr(module, "reset_parameters", lambda: None)()


def _group_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63


def _initialised(model: nn.Module, path: str, skip: set[int], seed: int, make) -> dict:
    """The group's family init run over stand-ins (make(module, name, param, where)), one for every place a
    parameter is registered, as in transformers, where weights are tied only after they are initialised. Per
    parameter: (parameter, final stand-in, where, module, name); a parameter shared by several places (tied
    embeddings) keeps the stand-in of the place that is not a tie's target, and an init that assigns a new
    parameter instead of writing into the stand-in gives the new one."""
    tie_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    places, kept = [], {}
    group_seed = _group_seed(seed, path)
    modules = list(_modules(model.get_submodule(path), path, skip))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(group_seed)
            for module_path, module in modules:
                for name, param in module._parameters.items():
                    if param is not None:
                        where = clean_name(f"{module_path}.{name}".lstrip("."))
                        stand_in = make(module, name, param, where)
                        stand_in.requires_grad_(param.requires_grad)
                        places.append((module, name, param, stand_in))
                        module._parameters[name] = stand_in
                        if where not in tie_targets or id(param) not in kept:
                            kept[id(param)] = (param, stand_in, where, module, name)
            _reset([m for _, m in modules], group_seed ^ 0x5EED)
            _init(model.get_submodule(path), _init_fn(model, path), skip)
        for module, name, original, stand_in in places:
            current = module._parameters[name]
            if current is not stand_in and kept[id(original)][1] is stand_in:
                kept[id(original)] = (original, current, *kept[id(original)][2:])
    finally:
        for module, name, original, _ in places:
            module._parameters[name] = original
    return kept


def _uninitialised(where: str, module: nn.Module) -> ConfigError:
    return ConfigError(
        "model.model_type",
        f"{where} is not initialised by the family's _init_weights nor by torch's reset of its "
        f"{type(module).__name__} (its constructor's values are not replayed at this size)",
        "load pretrained weights (model=pretrained), or report the family",
    )


@torch.no_grad()
def _init_group_whole(model: nn.Module, path: str, skip: set[int], seed: int) -> None:
    """The group initialised at full size on the CPU, each rank keeping its slice: for an init that cannot be
    replayed row by row."""
    group_seed = _group_seed(seed, path)

    def make(module, name, param, where):
        return _stand_in(module, name, param.shape, _group_seed(group_seed, where))

    for original, full, where, module, _ in _initialised(model, path, skip, seed, make).values():
        if full.isnan().any():
            raise _uninitialised(where, module)
        _keep_shard(original, full.detach().to(original.device, original.dtype))


def _local_box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and offset in the full parameter of this rank's shard."""
    if isinstance(param, DTensor):
        return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(param.shape), (0,) * param.dim()


def _recipes(model: nn.Module, path: str, skip: set[int], seed: int) -> list:
    """The group's construction and init recorded on meta stand-ins: per parameter, (parameter, name, the
    constructor's note, its recipe or the real parameter an init assigned). Raises Unsupported, before anything is
    written, for whatever cannot be replayed row by row (any error while recording included: the full-size path
    then runs the same init for real, and says what is wrong)."""
    made: dict[int, str] = {}
    try:
        with recording() as recorder:

            def make(module, name, param, where):
                stand_in = nn.Parameter(torch.empty(param.shape, device="meta"))
                recorder.add(stand_in)
                made[id(stand_in)] = where
                return stand_in

            kept = _initialised(model, path, skip, seed, make)
        if recorder.read_back:
            raise Unsupported("the init reads a value back")
        return [_plan(recorder, made, *entry) for entry in kept.values()]
    except Unsupported:
        raise
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else ""
        raise Unsupported(f"{type(err).__name__} while recording: {first}") from None


def _plan(recorder, made: dict[int, str], original, final, where: str, module: nn.Module, name: str) -> tuple:
    built, recipe = as_built(module, name), recorder.recipe(final)
    if final.is_meta and (recipe is None or made.get(id(final)) != where):
        raise Unsupported(f"{where} is replaced by another parameter or a value computed from one")
    if recipe is None:  # a real parameter the init assigned
        return original, where, built, final
    recipe = recipe.settled()
    recipe = Recipe(recipe.shape, [*(built.writes if isinstance(built, Recipe) else ()), *recipe.writes])
    known = isinstance(built, torch.Tensor) or (isinstance(built, tuple) and all(math.isfinite(v) for v in built))
    if not (known or recipe.covers()):  # the full-size path tells a value never set from one set piecewise
        raise Unsupported(f"{where} is not set whole by one write")
    return original, where, built, recipe


@torch.no_grad()
def _init_group_by_shard(model: nn.Module, path: str, skip: set[int], seed: int) -> str | None:
    """Replays the group's recipes on this rank's rows only (model.recorded_init); raises Unsupported before
    anything is written where they cannot be. Returns the name of a parameter left with unset values (NaN), if
    any: a recorder bug, which every rank must hear of (see init_weights)."""
    group_seed, unset = _group_seed(seed, path), None
    for original, where, built, recipe in _recipes(model, path, skip, seed):
        shape, offset = _local_box(original)
        if 0 in shape:
            continue
        rows = (offset[0], offset[0] + shape[0]) if shape else (0, 1)
        if isinstance(recipe, Recipe):
            start = None if isinstance(built, Recipe) else _start(built, tuple(original.shape))
            values = replay(recipe, *rows, _group_seed(group_seed, where), start)
        else:  # a real parameter an init assigned
            values = recipe.detach().reshape(recipe.shape or (1,))[rows[0] : rows[1]].float()
        for dim in range(1, len(shape)):
            values = values.narrow(dim, offset[dim], shape[dim])
        if unset is None and values.isnan().any():
            unset = where
        target = original.to_local() if isinstance(original, DTensor) else original
        target.copy_(values.reshape(shape))
    return unset


def _agree_unset(unset: str | None) -> None:
    """Every rank raises if any rank has a parameter left unset (one small all-reduce)."""
    flag = torch.tensor([1.0 if unset else 0.0])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
    if flag.item():
        raise ConfigError(
            "model.model_type",
            f"{unset or 'a parameter on another rank'} has values its recorded init never set",
            "report the family (a bug of fsdp_research.model.recorded_init); load pretrained weights meanwhile",
        )


def init_weights(model: nn.Module, blocks: Sequence[str], seed: int) -> None:
    """Initialise the materialized (possibly sharded) model: each block in turn, then everything outside them;
    each group by shard where its init replays row by row, else at full size (logged once, with the reason)."""
    whole, unset = [], None
    outside = {id(model.get_submodule(path)) for path in blocks}
    for path, skip in [*((path, set()) for path in blocks), ("", outside)]:
        try:
            unset = _init_group_by_shard(model, path, skip, seed) or unset
        except Unsupported as why:
            whole.append(f"{path or 'outside the blocks'} ({why})")
            _init_group_whole(model, path, skip, seed)
    _agree_unset(unset)
    if whole:
        log.info("init: %d of %d groups at full size: %s", len(whole), len(blocks) + 1, whole[0])
