"""Each repeating block's gradient norm every `every` steps (grad_norm/block_<i>), before clipping: which layers
blow up first. One all-reduce of one value per block over the shard group."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class BlockGradNorms:
    def __init__(self, every: int = 10):
        if every < 1:
            raise ValueError("every must be 1 or more")
        self.every = every

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        if step % self.every:
            return
        squares, group = [], None
        model = getattr(run.model, "module", run.model)  # under torch's DDP, the model it wraps
        for path in run.blocks:
            grads = [p.grad for p in model.get_submodule(path).parameters() if p.grad is not None]
            if grads and isinstance(grads[0], DTensor):
                group = grads[0].device_mesh.get_group("shard")
                grads = [g.to_local() for g in grads]
            total = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=run.device))
            squares.append(total.to(run.device))
        values = torch.stack(squares)
        if group is not None:
            dist.all_reduce(values, group=group)
        run.log({f"grad_norm/block_{i}": v for i, v in enumerate(values.sqrt().tolist())}, step=step)
