"""Activation checkpointing of every `stride`-th block, applied before sharding so that FSDP shards the
wrapped block. Full checkpointing recomputes each block's forward in backward: about +33% compute. Selective
checkpointing keeps the outputs of chosen operators (matmuls, attention) and recomputes only the rest."""

import functools
from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_research.config.schema import ActivationCheckpointingConfig, CheckpointMode
from fsdp_research.errors import ConfigError


def resolve_op(name: str):
    """torch.ops.<namespace>.<name>[.<overload>] as its overload packet (the policy matches any overload), or
    ConfigError."""
    namespace, _, rest = name.partition(".")
    op, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
        if overload:
            getattr(packet, overload)
        return packet
    except (AttributeError, RuntimeError):
        raise ConfigError(
            "activation_checkpointing.save_ops",
            f"torch has no operator {name!r}",
            "name operators as namespace.name, e.g. aten.mm or aten._scaled_dot_product_flash_attention",
        ) from None


def _policy(keep: frozenset, mm_every: int, counts: Counter, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    packet = getattr(func, "overloadpacket", func)
    if packet not in keep:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if packet is torch.ops.aten.mm:
        # Counted apart in forward and in the recompute, so that both decide alike for the same matmul.
        phase = "recompute" if ctx.is_recompute else "forward"
        counts[phase] += 1
        if (counts[phase] - 1) % mm_every:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _selective_contexts(keep: frozenset, mm_every: int):
    """A fresh pair of contexts per checkpointed forward (and its recompute): the matmul count starts at zero."""
    return create_selective_checkpoint_contexts(functools.partial(_policy, keep, mm_every, Counter()))


def apply_activation_checkpointing(
    model: nn.Module, blocks: list[nn.Module], cfg: ActivationCheckpointingConfig
) -> list[nn.Module]:
    """Wrap blocks 0, stride, 2*stride, ... in place; returns the blocks as they now sit in the model."""
    if cfg.stride == 0:
        return blocks
    kwargs = {}
    if cfg.mode is CheckpointMode.selective:
        keep = frozenset(resolve_op(name) for name in cfg.save_ops)
        kwargs["context_fn"] = functools.partial(_selective_contexts, keep, cfg.mm_save_every)
    paths = {module: path for path, module in model.named_modules()}
    wrapped = []
    for index, block in enumerate(blocks):
        if index % cfg.stride == 0:
            parent_path, _, child = paths[block].rpartition(".")
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
            model.get_submodule(parent_path).register_module(child, block)
        wrapped.append(block)
    return wrapped
