"""Materialize a meta-device model shard by shard, with initial weights that do not depend on the world size."""

import zlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .models import clean_name


def _initial_value(name: str, shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    """The full initial tensor of one parameter: a function of (its name, the seed) only, so every world
    size starts from identical weights. Matrices ~ N(0, std) as HF initialises them; biases 0; norm scales 1."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's shards on `device`, uninitialised; buffers keep their values."""
    buffers = {name: buf.clone() for name, buf in model.named_buffers()}
    model.to_empty(device=device)
    # to_empty gives each module its own new tensor, which unties shared weights: tie them again.
    model.tie_weights()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill this rank's shards. One full parameter exists at a time, never the full model."""
    std = getattr(model.config, "initializer_range", 0.02)
    for name, param in model.named_parameters():
        full = _initial_value(clean_name(name), param.shape, std, seed).to(param.device, param.dtype)
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements).to_local())
        else:
            param.copy_(full)
