"""Whether a model keeps packed documents apart: transformers' packed-sequence path (position ids restarting at
each document) is its mask functions', which a family with attention of its own may not call. Checked once at the
start on the built model, as training will run it (at its micro-batch size), before a step trains on documents that
see each other.

Flash attention passes at micro-batch 1 only: transformers 5.24 (modeling_flash_attention_utils,
_flash_attention_forward) reads restarting position ids as varlen sequences (cu_seqlens where the position is the
least) only at batch size 1 (_is_packed_sequence) and without an attention mask (none for packed samples); a larger
batch runs plain causal attention over each whole row."""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from fsdp_research.distributed.sharding import reshard
from fsdp_research.errors import ConfigError


@torch.no_grad()
def check_document_masking(model: nn.Module, device: torch.device, micro_batch: int = 2) -> None:
    """The logits of one document [a, b] packed after two different documents (lengths 3 and 1, the rest padding,
    positions restarting at each) must be the same: not if the second document sees the first, or its positions
    run on from it. The two samples go in forwards of micro_batch samples, as training feeds them. A collective
    under FSDP: every rank calls it. Raises ConfigError."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    tokens = torch.tensor([[3, 4, 5, 1, 2, 6], [7, 1, 2, 6, 6, 6]], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 0, 1, 0, 1, 2]], device=device)
    was_training = inner.training
    inner.eval()
    # Eager: a compiled block would be compiled for this shape first, and recompiled for the batch's.
    with torch.compiler.set_stance("force_eager"):
        try:
            logits = torch.cat(
                [
                    inner(input_ids=t, position_ids=p).logits.float()
                    for t, p in zip(tokens.split(micro_batch), positions.split(micro_batch))
                ]
            )
        except TypeError as err:  # a model of one's own
            raise ConfigError(
                "data.document_masking", f"the model's forward takes no position_ids ({err})", "set it to false"
            ) from None
    inner.train(was_training)
    reshard(inner)
    first, second = logits[0, 3:5], logits[1, 1:3]
    if (first - second).abs().max() > 1e-3 * (1 + first.abs().max()):
        _refuse(inner, _flash_over_one(inner, micro_batch))


def _flash_over_one(model: nn.Module, micro_batch: int) -> bool:
    """Flash attention keeps packed documents apart one sample a forward only (the module's docstring)."""
    return micro_batch > 1 and "flash" in str(getattr(getattr(model, "config", None), "_attn_implementation", ""))


def _refuse(model: nn.Module, flash: bool) -> None:
    raise ConfigError(
        "data.document_masking",
        f"{type(model).__name__} lets packed documents see each other (its attention ignores the position ids' "
        f"restarts{' at a micro-batch over 1' if flash else ''})",
        f"{'set trainer.micro_batch_size=1, or ' if flash else ''}set data.document_masking=false, or "
        "data.packing=false",
    )


def check_staged_document_masking(stage: nn.Module, micro_batch: int) -> None:
    """A pipeline stage's: it cannot run the whole forward check_document_masking compares. Its families
    (distributed.pipeline.FAMILIES, split-tested with packed documents) keep them apart through transformers' mask
    functions on every stage, except under flash attention at a micro-batch over 1. Raises ConfigError."""
    if _flash_over_one(stage, micro_batch):
        _refuse(stage, True)
