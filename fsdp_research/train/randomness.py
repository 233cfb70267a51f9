"""Random state (dropout's masks, router jitter) under any layout: one rule. The global generator is seeded at the
start of every step from (trainer.seed, the step, the data-parallel rank), so the ranks of a tp group (which hold
the same activations) draw alike, the data-parallel ranks apart, and a resume at any layout draws what that layout
draws uninterrupted: there is no generator state that a resume has to map from one layout onto another."""

import torch

from fsdp_research.distributed.mesh import data_parallel, pipeline_rank


def step_seed(seed: int, step: int, dp_rank: int) -> int:
    return ((seed * 1_000_003 + dp_rank) * 1_000_033 + step) % 2**63


def seed_step(seed: int, step: int, tp: int, pp: int = 1) -> None:
    """The generators (CPU and every CUDA device) for `step` on this rank: a pipeline's stages each their own (their
    layers' dropout masks not alike), its data-parallel rank's at pp = 1."""
    rank, ranks = data_parallel(tp, pp=pp)
    torch.manual_seed(step_seed(seed, step, rank + pipeline_rank(pp) * ranks))
