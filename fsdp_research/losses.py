"""The losses: next-token cross-entropy of a training batch, and the token-weighted mean over the held-out set."""

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .data.pipeline import Data


def loss_of(model: nn.Module, batch: torch.Tensor, amp) -> torch.Tensor:
    """Next-token cross-entropy of a batch of seq_len + 1 tokens."""
    with amp:
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def token_losses(model: nn.Module, batch: torch.Tensor, amp) -> torch.Tensor:
    """Each target token's cross-entropy, [batch, seq_len]."""
    with amp:
        logits = model(input_ids=batch[:, :-1]).logits
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
    return losses.view(len(batch), -1)


@torch.no_grad()
def held_out_loss(
    model: nn.Module, data: Data, samples: int, micro_batch: int, device: torch.device, amp
) -> dict[str, float]:
    """The token-weighted mean loss over held-out samples 0 .. samples - 1: the same eval set at any world size,
    rank r taking r, r + world, ... Every rank runs as many forwards (one with fewer samples pads with a sample
    weighted 0): FSDP's collectives need them all. A collective: every rank calls it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    index = rank + world * np.arange(-(-samples // world))
    weight = torch.from_numpy(index < samples).float().to(device)
    index = np.minimum(index, samples - 1)
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # loss summed over tokens, tokens
    model.eval()
    for a in range(0, len(index), micro_batch):
        batch = data.batch(index[a : a + micro_batch], held_out=True).to(device)
        w = weight[a : a + micro_batch]
        per_sample = token_losses(model, batch, amp).sum(1)
        sums += torch.stack([(per_sample * w).sum(), w.sum() * (batch.shape[1] - 1)]).double()
    model.train()
    dist.all_reduce(sums)
    return {"eval_loss": (sums[0] / sums[1]).item(), "eval_tokens": int(sums[1].item())}
