"""An objective of one's own: next-token cross-entropy on each window's tokens from position `skip` on (the first
ones have little context to predict from). It returns a loss sum and says how many targets each sample holds; the
trainer weights the sums so that a step's loss is the mean over all of its targets, at any number of ranks."""

import torch
import torch.nn.functional as F

from fsdp_research.config.data_schema import DataKind
from fsdp_research.objectives import Objective


class TailTokens(Objective):
    # Windows of text (its loss slices positions: not packed samples, nor context parallel's chunks).
    reads = (DataKind.local_text, DataKind.hub, DataKind.synthetic)

    def __init__(self, skip: int = 8):
        self.skip = skip

    def targets(self, batch: torch.Tensor) -> torch.Tensor:
        # A window of seq_len + 1 tokens holds seq_len targets, of which the first `skip` are left out.
        return torch.full((len(batch),), batch.shape[1] - 1 - self.skip, device=batch.device)

    def loss(self, model, batch, ctx):
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with ctx.amp:
            logits = model(input_ids=inputs).logits
        tail = logits[:, self.skip :].float().flatten(0, 1)
        summed = F.cross_entropy(tail, labels[:, self.skip :].flatten(), reduction="sum")
        return summed * ctx.weight, {}
