"""How a step's forward and backward run over this rank's micro-batches: the step's schedule. The trainer hands it
the step's batch and what one micro-batch's forward and backward are; the optimizer step stays the trainer's. One
schedule today, each micro-batch in turn on this rank; a pipeline schedule (micro-batches flowing through stages)
is another with the same face."""

from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp_research.distributed.sharding import grad_sync
from fsdp_research.metrics.profiling import region

Forward = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class MicroBatches:
    """Each micro-batch in turn: forward, its loss divided by the micro-batches of the step, backward. Gradients
    reduce within a shard group after each micro-batch (after the last only with defer_grad_sync), across replicas
    after the last."""

    def __init__(self, micro_batch_size: int, micro_steps: int, defer_grad_sync: bool):
        self.micro_batch_size, self.micro_steps, self.defer_grad_sync = micro_batch_size, micro_steps, defer_grad_sync

    def run(
        self, model: nn.Module, batch: torch.Tensor, forward: Forward, backward: Callable[[torch.Tensor], None]
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """(this rank's loss over the step, each micro-batch's stats); each forward and backward a profiler region."""
        loss_sum, stats = torch.zeros((), device=batch.device), []
        for i, micro in enumerate(batch.split(self.micro_batch_size)):
            with grad_sync(model, i == self.micro_steps - 1, self.defer_grad_sync):
                with region("forward"):
                    loss, micro_stats = forward(micro)
                    loss = loss / self.micro_steps
                with region("backward"):
                    backward(loss)
            loss_sum += loss.detach()
            stats.append(micro_stats)
        return loss_sum, stats
