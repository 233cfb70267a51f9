"""Activation checkpointing of every `stride`-th block, applied before sharding so that FSDP shards the
wrapped block. Full checkpointing recomputes each block's forward in backward: about +33% compute."""

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from .config import ActivationCheckpointingConfig


def apply_activation_checkpointing(
    model: nn.Module, blocks: list[nn.Module], cfg: ActivationCheckpointingConfig
) -> list[nn.Module]:
    """Wrap blocks 0, stride, 2*stride, ... in place; returns the blocks as they now sit in the model."""
    if cfg.stride == 0:
        return blocks
    paths = {module: path for path, module in model.named_modules()}
    wrapped = []
    for index, block in enumerate(blocks):
        if index % cfg.stride == 0:
            parent_path, _, child = paths[block].rpartition(".")
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            model.get_submodule(parent_path).register_module(child, block)
        wrapped.append(block)
    return wrapped
