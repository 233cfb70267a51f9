"""AdamW with linear warmup then cosine decay, and gradient clipping by the true global norm."""
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .config import ConfigError, OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, max_steps: int):
    if cfg.name != "adamw":
        raise ConfigError("optim.name", f"unknown optimizer {cfg.name!r}", "use optim=adamw")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0: measure only). The norm is over every shard of every rank: FSDP's gradients are
    DTensors, whose norm reduces across the mesh."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
