"""Build a Hugging Face causal LM without allocating it, find its repeating blocks, and materialize it
shard by shard with initial weights that do not depend on the world size."""
import contextlib
import json
import os
import zlib
from typing import Any, Dict, Iterator, List

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from .config import ConfigError, ModelConfig


def build_hf_config(cfg: ModelConfig):
    from transformers import AutoConfig

    if cfg.name_or_path:
        return AutoConfig.from_pretrained(cfg.name_or_path, **cfg.config)
    if not cfg.model_type:
        raise ConfigError("model.model_type", "neither model.name_or_path nor model.model_type is set",
                          "pick a model option (model=llama_tiny) or set model.name_or_path")
    return AutoConfig.for_model(cfg.model_type, **cfg.config)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters go to the meta device as they are registered; buffers (rotary tables) stay real, so
    they need no recomputation after materialization."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        # A parameter already on meta is being shared (tied embeddings): keep it the same object.
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_model(hf_config) -> nn.Module:
    """The model with every parameter on the meta device: nothing is allocated or initialised yet."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # A fixed, deterministic attention kernel (no padding here, so no mask is needed).
    model.config.use_cache = False
    return model


def block_class_name(model: nn.Module, override: str | None) -> str:
    if override:
        return override
    names = list(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ConfigError("model.block_class", f"{type(model).__name__} declares no repeating block "
                          "(_no_split_modules is empty)", "set model.block_class=<its block class name>")
    return names[0]


def find_blocks(model: nn.Module, class_name: str) -> List[nn.Module]:
    """The repeating transformer blocks, in forward order."""
    blocks = [m for m in model.modules() if type(m).__name__ == class_name]
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError("model.block_class", f"{type(model).__name__} has no module of class {class_name}",
                          f"use one of its classes: {', '.join(present)}")
    return blocks


def clean_name(name: str) -> str:
    """Parameter name without the wrappers' prefixes (activation checkpointing, DDP, torch.compile)."""
    for prefix in ("_checkpoint_wrapped_module.", "module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


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


def pretrained_dir(name_or_path: str) -> str:
    """A local directory as is; a hub id through the local HF cache (downloaded only when asked for)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    return snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])

def apply_compile(blocks: List[nn.Module], enabled: bool) -> None:
    """torch.compile each block before sharding (as torchtitan does), so FSDP's hooks stay outside."""
    if enabled:
        for block in blocks:
            block.compile()


def _safetensors_files(path: str) -> Dict[str, str]:
    """Tensor name -> file, for a single model.safetensors or a sharded one with an index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ConfigError("model.name_or_path", f"{path} holds no model.safetensors(.index.json)",
                          "point it at a directory written by save_pretrained (safetensors)")
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, device: torch.device) -> None:
    """Fill the (materialized, possibly sharded) model from a safetensors checkpoint: each rank reads only
    the slices it owns, so its peak memory stays near its shard."""
    files = _safetensors_files(path)
    handles: Dict[str, Any] = {}
    for name, param in model.named_parameters():
        key = clean_name(name)
        if key not in files:
            raise ConfigError("model.name_or_path", f"{path} has no weight {key}",
                              "use a checkpoint of the same architecture as the model config")
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
