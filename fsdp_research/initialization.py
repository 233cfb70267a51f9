"""Materialize a meta-device model shard by shard, and initialise it as its family does (its `_init_weights`:
Gemma's zero-centred norm scales, GPT-2's scaled residual projections, padding rows, routers, ...), identically at
any world size and never holding more than one block's full parameters at a time.

A group is one repeating block, or what lies outside the blocks (embeddings, final norm, head). Each group's
parameters get full-size stand-ins on the CPU holding what their modules' constructors gave them (small tensors'
values, large ones' mean and spread, then torch's reset_parameters where a module has one: what the family's
init leaves untouched keeps them; a parameter nothing initialises refuses the run), the family's init runs over
the group's modules as transformers runs it (children first, each sub-model with its own `_init_weights`), from a
generator seeded by (seed, group), and each rank keeps its slice of the result."""

import math
import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .errors import ConfigError
from .models import as_built, clean_name


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
    # to_empty gives each module its own new tensor, which unties shared weights: tie them again (transformers'
    # models by their own rule, any other as they were).
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    else:
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


def _stand_in(module: nn.Module, name: str, shape: torch.Size, generator: torch.Generator) -> nn.Parameter:
    """A full-size parameter holding what the module's constructor gave it: its values (small ones), or values of
    their mean and spread (large ones; NaN where those are not finite: torch.empty's), for torch's reset and the
    family's _init_weights to overwrite where they initialise it."""
    built = as_built(module, name)
    if isinstance(built, torch.Tensor):
        return nn.Parameter(built.clone().reshape(shape))
    values = torch.full(shape, float("nan"))
    if built is not None and all(math.isfinite(v) for v in built):
        values.normal_(*built, generator=generator) if built[1] > 0 else values.fill_(built[0])
    return nn.Parameter(values)


def _reset(modules: list[nn.Module], generator_seed: int) -> None:
    """torch's constructor initialisation of modules with a large parameter (what their constructors do after
    registering it), from a stream of its own: what _init_weights draws from the group's seed stays the same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(generator_seed)
        for module in modules:
            if any(
                not isinstance(as_built(module, n), torch.Tensor)
                for n, p in module._parameters.items()
                if p is not None
            ):
                getattr(module, "reset_parameters", lambda: None)()


@torch.no_grad()
def _init_group(model: nn.Module, path: str, skip: set[int], seed: int) -> None:
    """Every place a parameter is registered gets a stand-in of its own, as in transformers, where weights are tied
    only after they are initialised: a parameter shared by several places (tied embeddings) keeps the value of
    the place that is not a tie's target."""
    tie_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    places, kept = [], {}
    group_seed = (seed * 1_000_003 + zlib.crc32(path.encode())) % 2**63
    modules = list(_modules(model.get_submodule(path), path, skip))
    # Its own stream: what _init_weights draws from the group's seed does not depend on the stand-ins.
    generator = torch.Generator().manual_seed(group_seed ^ 0x57A9D)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(group_seed)
            for module_path, module in modules:
                for name, param in module._parameters.items():
                    if param is not None:
                        where = clean_name(f"{module_path}.{name}".lstrip("."))
                        stand_in = _stand_in(module, name, param.shape, generator)
                        stand_in.requires_grad_(param.requires_grad)
                        places.append((module, name, param, stand_in))
                        module._parameters[name] = stand_in
                        if where not in tie_targets or id(param) not in kept:
                            kept[id(param)] = (param, stand_in, where, module)
            _reset([m for _, m in modules], group_seed ^ 0x5EED)
            _init(model.get_submodule(path), _init_fn(model, path), skip)
        # An init that assigns a new parameter instead of writing into the stand-in: the new one is what counts.
        for module, name, original, stand_in in places:
            current = module._parameters[name]
            if current is not stand_in and kept[id(original)][1] is stand_in:
                kept[id(original)] = (original, current, *kept[id(original)][2:])
        for original, full, where, module in kept.values():
            if full.isnan().any():
                raise ConfigError(
                    "model.model_type",
                    f"{where} is not initialised by the family's _init_weights nor by torch's reset of its "
                    f"{type(module).__name__} (its constructor's values are not replayed at this size)",
                    "load pretrained weights (model=pretrained), or report the family",
                )
            _keep_shard(original, full.detach().to(original.device, original.dtype))
    finally:
        for module, name, original, _ in places:
            module._parameters[name] = original


def init_weights(model: nn.Module, blocks: Sequence[str], seed: int) -> None:
    """Initialise the materialized (possibly sharded) model: each block in turn, then everything outside them."""
    for path in blocks:
        _init_group(model, path, set(), seed)
    _init_group(model, "", {id(model.get_submodule(path)) for path in blocks}, seed)
