"""Hugging Face causal LMs without allocating them: the config, the model on the meta device, its repeating
blocks, and its dimensions read once from the config (each family names them its own way)."""

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from .config import ModelConfig
from .errors import ConfigError


def build_hf_config(cfg: ModelConfig):
    from transformers import AutoConfig

    if not (cfg.name_or_path or cfg.model_type):
        raise ConfigError(
            "model.model_type",
            "neither model.name_or_path nor model.model_type is set",
            "pick a model option (model=llama_tiny) or set model.name_or_path",
        )
    try:
        if cfg.name_or_path:
            return AutoConfig.from_pretrained(cfg.name_or_path, **cfg.config)
        return AutoConfig.for_model(cfg.model_type, **cfg.config)
    except (OSError, ValueError, KeyError) as err:
        key = "model.name_or_path" if cfg.name_or_path else "model.model_type"
        raise ConfigError(
            key,
            f"transformers has no config for it ({_first_line(err)})",
            "use a local directory written by save_pretrained, or a model_type transformers knows",
        ) from None


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # None where the family has no fixed limit.
    max_positions: int | None
    # Mixture of experts: experts per MoE layer and how many each token is routed to (0 and 0 for a dense model).
    experts: int = 0
    experts_per_token: int = 0


def dims(hf_config) -> ModelDims:
    """The dimensions every consumer needs (validation, MFU, the planner), with each family's defaults."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    return ModelDims(
        experts=experts,
        experts_per_token=getattr(hf_config, "num_experts_per_tok", 0) if experts else 0,
        hidden=hidden,
        layers=hf_config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hidden // heads,
        intermediate=getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None) or 4 * hidden,
        vocab=hf_config.vocab_size,
        max_positions=getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None),
    )


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

    try:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except (ValueError, TypeError, AttributeError, RuntimeError) as err:
        raise ConfigError(
            "model.config",
            f"transformers cannot build a causal LM of type {hf_config.model_type!r} from it ({_first_line(err)})",
            "fix the model.config values (the family's own config class lists them)",
        ) from None
    # A fixed, deterministic attention kernel (no padding here, so no mask is needed).
    model.config.use_cache = False
    return model


def block_class_name(model: nn.Module, override: str | None) -> str:
    """model.block_class, else the class of _no_split_modules the model repeats most: the decoder's layer where
    a family lists several (a vision tower's, an encoder's)."""
    if override:
        return override
    names = set(getattr(model, "_no_split_modules", None) or [])
    counts = Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in names)
    if not counts:
        raise ConfigError(
            "model.block_class",
            f"{type(model).__name__} declares no repeating block (_no_split_modules is empty)",
            "set model.block_class=<its block class name>",
        )
    return max(sorted(counts), key=counts.__getitem__)


def find_blocks(model: nn.Module, class_name: str) -> list[nn.Module]:
    """The repeating transformer blocks, in forward order."""
    blocks = [m for m in model.modules() if type(m).__name__ == class_name]
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            "model.block_class",
            f"{type(model).__name__} has no module of class {class_name}",
            f"use one of its classes: {', '.join(present)}",
        )
    return blocks


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def clean_name(name: str) -> str:
    """Parameter name without the wrappers' prefixes (activation checkpointing, DDP, torch.compile)."""
    for prefix in ("_checkpoint_wrapped_module.", "module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def pretrained_dir(name_or_path: str) -> str:
    """A local directory as is; a hub id through the local HF cache (downloaded only when asked for)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    return snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
