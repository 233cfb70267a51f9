"""Eval: the loss over the held-out windows (the same ones at any world size), or over each eval set read whole
(data.eval_paths; data.eval_sources, one set per name): the mean over every target, with the training loss's masks,
packing and document masking."""

import contextlib
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from fsdp_research.data.packing import IGNORE
from fsdp_research.data.pipeline import Data
from fsdp_research.distributed.context_parallel import ContextSplit, split_of
from fsdp_research.distributed.mesh import data_parallel
from fsdp_research.distributed.pipeline import Pipeline, pipeline_of
from fsdp_research.train.losses import model_inputs, target_count, token_losses


def rank_share(
    samples: int, device: torch.device, tp: int = 1, cp: int = 1, pp: int = 1, multiple: int = 1
) -> tuple[np.ndarray, torch.Tensor]:
    """(the samples this data-parallel rank reads of 0 .. samples - 1: r, r + world, ...; each one's weight, float64):
    every rank reads as many (a multiple of `multiple`), a rank with fewer reading the last again weighted 0 (FSDP's
    collectives need as many forwards on every rank)."""
    rank, world = data_parallel(tp, cp, pp)
    reads = -(-samples // world)
    index = rank + world * np.arange(-(-reads // multiple) * multiple)
    weight = torch.from_numpy(index < samples).double().to(device)
    return np.minimum(index, samples - 1), weight


@torch.no_grad()
def held_out_sums(
    model: nn.Module,
    read: Callable[[np.ndarray], torch.Tensor],
    samples: int,
    micro_batch: int,
    device: torch.device,
    sums_of: Callable[[torch.Tensor], torch.Tensor],
    tp: int = 1,
    split: ContextSplit | None = None,
    pp: int = 1,
) -> torch.Tensor:
    """The sums over samples 0 .. samples - 1 (`read` gives samples by index) of what sums_of says of each sample
    ([samples in the batch, k]), data-parallel rank r taking r, r + world, ... (under context parallel each rank its
    chunks of them, as in training): [k], float64. Every rank runs as many forwards (one with fewer samples pads
    with a sample weighted 0): FSDP's collectives need them all; a pipeline's (pp stages, every one with the sums)
    runs whole batches of micro_batch. A collective: every rank calls it."""
    index, weight = rank_share(samples, device, tp, split.cp if split else 1, pp, micro_batch if pp > 1 else 1)
    sums = None
    model.eval()
    with split.splitting() if split else contextlib.nullcontext():
        for a in range(0, len(index), micro_batch):
            batch = read(index[a : a + micro_batch]).to(device)
            part = weight[a : a + micro_batch] @ sums_of(batch).double()
            sums = part if sums is None else sums + part
    model.train()
    dist.all_reduce(sums)
    return sums / (tp * pp)


def _staged_sums(pipeline: Pipeline) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each sample's (loss summed over its targets, targets) through the pipeline's stages."""

    def of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
        return torch.stack([losses.view(len(labels), -1).sum(1), (labels != IGNORE).sum(1)], 1)

    def sums_of(batch: torch.Tensor) -> torch.Tensor:
        inputs, labels, kwargs = model_inputs(batch)
        return pipeline.sums(inputs, labels.view(len(batch), -1), kwargs, of, 2)

    return sums_of


def held_out_loss(
    model: nn.Module,
    read: Callable[[np.ndarray], torch.Tensor],
    samples: int,
    micro_batch: int,
    device: torch.device,
    amp,
    chunks: int = 1,
    tp: int = 1,
    split: ContextSplit | None = None,
) -> tuple[float, int]:
    """(loss summed over the targets, targets) of samples 0 .. samples - 1 (see held_out_sums); through the stages
    of the model's pipeline, micro_steps micro-batches at a time, where it has one."""
    cp, pipeline = split.cp if split else 1, pipeline_of(model)

    def sums_of(batch: torch.Tensor) -> torch.Tensor:
        # A cp rank's share of the targets: windows of tokens, split evenly.
        per_sample = token_losses(model, batch, amp, chunks, split).sum(1)
        return torch.stack([per_sample, target_count(batch) / cp], 1)

    if pipeline is not None:
        micro_batch, sums_of = micro_batch * pipeline.micro_steps, _staged_sums(pipeline)
    pp = pipeline.ranks if pipeline else 1
    sums = held_out_sums(model, read, samples, micro_batch, device, sums_of, tp, split, pp)
    return sums[0].item(), int(sums[1].item())


def evaluate(model: nn.Module, data: Data, cfg: DictConfig, device: torch.device, amp) -> dict[str, float]:
    """{eval_loss, eval_tokens}; with data.eval_sources also each set's, as eval_loss/<name> and
    eval_tokens/<name> (eval_loss: over all of them). A collective."""
    t = cfg.trainer

    def loss(read, samples: int) -> tuple[float, int]:
        return held_out_loss(
            model, read, samples, t.micro_batch_size, device, amp, cfg.loss.chunks, cfg.parallel.tp, split_of(model)
        )

    if not data.eval_sets:
        parts = {"": loss(lambda index: data.batch(index, held_out=True), t.eval_batches * t.micro_batch_size)}
    else:
        parts = {
            name: loss(lambda index, name=name: data.eval_batch(name, index), windows.count)
            for name, windows in data.eval_sets.items()
        }
    out = {}
    for name, (total, tokens) in parts.items():
        if name:
            out.update({f"eval_loss/{name}": total / tokens, f"eval_tokens/{name}": tokens})
    total, tokens = sum(p[0] for p in parts.values()), sum(p[1] for p in parts.values())
    return {"eval_loss": total / tokens, "eval_tokens": tokens, **out}
