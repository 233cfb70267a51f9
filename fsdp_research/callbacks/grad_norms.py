"""Each repeating block's gradient norm every `every` steps (grad_norm/block_<i>), before clipping: which layers
blow up first. One all-reduce of the blocks' values over the shard group (and the tp group, with tensor
parallel)."""

import torch
from torch.distributed.tensor import DTensor

from fsdp_research.optim.clipping import local_squares, reduce_squares, widest_mesh


class BlockGradNorms:
    def __init__(self, every: int = 10):
        if every < 1:
            raise ValueError("every must be 1 or more")
        self.every = every

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        if step % self.every:
            return
        squares, mesh = [], None
        model = getattr(run.model, "module", run.model)  # under torch's DDP, the model it wraps
        for path in run.blocks:
            grads = [p.grad for p in model.get_submodule(path).parameters() if p.grad is not None]
            if grads and isinstance(grads[0], DTensor):
                mesh = widest_mesh(grads)
                squares.append(local_squares(grads)[0].to(run.device))
            else:
                total = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=run.device))
                squares.append(torch.stack([total.to(run.device), torch.zeros((), device=run.device)]))
        values = torch.stack(squares)
        values = reduce_squares(values, mesh) if mesh is not None else values.sum(-1)
        run.log({f"grad_norm/block_{i}": v for i, v in enumerate(values.sqrt().tolist())}, step=step)
