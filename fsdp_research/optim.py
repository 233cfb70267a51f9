"""AdamW with linear warmup then cosine decay, and gradient clipping by the true global norm."""

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .config import OptimConfig
from .errors import ConfigError

NO_DECAY = ("bias", "1d", "embedding")


def check_no_decay(kinds: list[str]) -> None:
    unknown = [kind for kind in kinds if kind not in NO_DECAY]
    if unknown:
        raise ConfigError(
            "optim.no_decay", f"unknown kind(s) {', '.join(map(repr, unknown))}", f"use some of {', '.join(NO_DECAY)}"
        )


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two groups, decayed and not (the kinds in cfg.no_decay); an empty one is left out."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    kinds = set(cfg.no_decay)

    def exempt(name: str, param: nn.Parameter) -> bool:
        return (
            ("bias" in kinds and name.endswith(".bias"))
            or ("1d" in kinds and param.ndim <= 1)
            or ("embedding" in kinds and id(param) in tables)
        )

    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not exempt(n, p)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if exempt(n, p)], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig, max_steps: int):
    optimizer = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0: measure only) by the true global norm, over every shard of every rank.
    FSDP's gradients are DTensors: the norm is taken over the local shards with one foreach kernel and one
    all-reduce over the shard group (replicas hold the same shards), not op by op through DTensor dispatch,
    which costs a few percent of a small model's step."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads and isinstance(grads[0], DTensor):
        mesh = grads[0].device_mesh
        local = [g.to_local() for g in grads]
        squares = torch.stack(torch._foreach_norm(local)).float().pow(2).sum()
        dist.all_reduce(squares, group=mesh.get_group("shard"))
        norm = squares.sqrt()
    else:
        local = grads
        norm = torch.nn.utils.get_total_norm(grads)
    if max_norm > 0:
        # Scale by min(1, max_norm / norm) without a host sync, as torch's clip_grad_norm_ does.
        torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
