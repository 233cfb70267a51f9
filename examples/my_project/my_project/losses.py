"""A loss of one's own: cross-entropy with logits soft-capped (Gemma 2's tanh cap) before it."""

import torch
import torch.nn.functional as F


def capped_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, cap: float = 30.0) -> torch.Tensor:
    return F.cross_entropy(cap * torch.tanh(logits.float() / cap), labels)
