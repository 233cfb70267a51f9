"""How a step's forward and backward run over this rank's micro-batches: the step's schedule. The trainer hands it
the step's batch, the objective's loss and what a backward is; the optimizer step stays the trainer's. Each
micro-batch in turn on this rank (MicroBatches), or flowing through the stages of a pipeline (Pipelined)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_research.distributed.pipeline import Pipeline
from fsdp_research.distributed.sharding import grad_sync
from fsdp_research.metrics.profiling import region
from fsdp_research.objectives.base import Objective, StepContext
from fsdp_research.train.losses import model_inputs

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepLoss:
    """The objective's loss of a micro-batch with the step's context, each value checked (trainer.detect_anomaly)."""

    objective: Objective
    ctx: StepContext
    check: Callable[[torch.Tensor], None]

    def of_model(self, model: nn.Module, micro: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        loss, stats = self.objective.loss(model, micro, self.ctx)
        self.check(loss)
        return loss, stats

    def of_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        loss, stats = self.objective.logits_loss(logits, labels, self.ctx)
        self.check(loss)
        return loss, stats


class MicroBatches:
    """Each micro-batch in turn: forward, its loss divided by the micro-batches of the step, backward. Gradients
    reduce within a shard group after each micro-batch (after the last only with defer_grad_sync), across replicas
    after the last."""

    def __init__(self, micro_batch_size: int, micro_steps: int, defer_grad_sync: bool):
        self.micro_batch_size, self.micro_steps, self.defer_grad_sync = micro_batch_size, micro_steps, defer_grad_sync

    def run(
        self, model: nn.Module, batch: torch.Tensor, losses: StepLoss, backward: Callable[[torch.Tensor], None]
    ) -> tuple[torch.Tensor, list[Stats]]:
        """(this rank's loss over the step, each micro-batch's stats); each forward and backward a profiler region."""
        loss_sum, stats = torch.zeros((), device=batch.device), []
        for i, micro in enumerate(batch.split(self.micro_batch_size)):
            with grad_sync(model, i == self.micro_steps - 1, self.defer_grad_sync):
                with region("forward"):
                    loss, micro_stats = losses.of_model(model, micro)
                    loss = loss / self.micro_steps
                with region("backward"):
                    backward(loss)
            loss_sum += loss.detach()
            stats.append(micro_stats)
        return loss_sum, stats


class Pipelined:
    """The step's micro-batches through every stage of the pipeline by its schedule (forwards and backwards
    interleaved as it orders them; FSDP's gradient reduction after the last, as the schedule sets it), the loss
    from the last stage's logits, divided by the micro-batches of the step as MicroBatches divides it."""

    def __init__(self, pipeline: Pipeline, micro_steps: int):
        self.pipeline, self.micro_steps = pipeline, micro_steps

    def run(
        self, model: nn.Module, batch: torch.Tensor, losses: StepLoss, backward: Callable[[torch.Tensor], None]
    ) -> tuple[torch.Tensor, list[Stats]]:
        """As MicroBatches.run; the backward is the schedule's own (no loss scaling: refused with pp)."""
        inputs, labels, kwargs = model_inputs(batch)

        def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Stats]:
            loss, stats = losses.of_logits(logits, labels)
            return loss / self.micro_steps, stats

        return self.pipeline.run(inputs, labels.view(len(batch), -1), kwargs, loss_of)
