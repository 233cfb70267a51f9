"""Weights in: fill a materialized (possibly sharded) model from a safetensors checkpoint, each rank reading
only the slices it owns."""

import json
import os
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from .errors import ConfigError
from .models import clean_name


def _safetensors_files(path: str) -> dict[str, str]:
    """Tensor name -> file, for a single model.safetensors or a sharded one with an index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ConfigError(
            "model.name_or_path",
            f"{path} holds no model.safetensors(.index.json)",
            "point it at a directory written by save_pretrained (safetensors)",
        )
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, device: torch.device) -> None:
    """Fill the model from the checkpoint in `path`: its peak memory per rank stays near its shard."""
    files = _safetensors_files(path)
    handles: dict[str, Any] = {}
    for name, param in model.named_parameters():
        key = clean_name(name)
        if key not in files:
            raise ConfigError(
                "model.name_or_path",
                f"{path} has no weight {key}",
                "use a checkpoint of the same architecture as the model config",
            )
        if files[key] not in handles:
            handles[files[key]] = safe_open(files[key], "pt")
        tensor = handles[files[key]].get_slice(key)
        if isinstance(param, DTensor):
            # Private helper, but the exact region this rank's shard covers for any mesh and placements.
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            region = tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            param.to_local().copy_(region.to(device, param.dtype))
        else:
            param.copy_(tensor[:].to(device, param.dtype))
