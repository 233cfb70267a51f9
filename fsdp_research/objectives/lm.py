"""objective=lm: the next-token loss, as the loss group sets it (cross_entropy with z-loss and label smoothing, in
chunks, or loss._target_), over text windows and chat samples alike; a mixture of experts' load-balancing loss
beside it where the family's config asks for it."""

import torch
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.data.pipeline import packed
from fsdp_research.objectives.base import Objective, StepContext
from fsdp_research.train.losses import build_loss, target_count, train_loss


class NextToken(Objective):
    splits_sequences = uses_loss_group = takes_packed = pipelines = True

    def setup(self, cfg: DictConfig) -> None:
        self.loss_fn = build_loss(cfg.loss, packed=packed(cfg.data))

    def targets(self, batch: torch.Tensor) -> torch.Tensor | None:
        # Windows of tokens hold seq_len targets each: a micro-batch's mean is already its share of the step's.
        return target_count(batch) if batch.dim() == 3 else None

    def loss(self, model: nn.Module, batch: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, dict]:
        return train_loss(model, batch, ctx.amp, self.loss_fn, ctx.router, ctx.weight, ctx.split)

    def logits_loss(self, logits: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, dict]:
        loss, stats = self.loss_fn(logits.flatten(0, 1), labels.flatten())
        return (loss if ctx.weight is None else loss * ctx.weight), stats
