"""Aux-loss-free load balancing, as DeepSeek-V3 trains its routers (torchtitan, OLMo-core and NeMo Automodel do
the same): each router adds a bias per expert (`e_score_correction_bias`, a buffer transformers' modeling code only
reads) to its scores when choosing experts; after every optimizer step the bias moves by
`rate * sign(mean load - load)` over the tokens the whole data-parallel batch routed, recentred to a zero-mean
change. Every rank applies the same all-reduced update to its replicated buffer, so the biases stay identical
on every rank and at any world size; they are in the resume checkpoint and the export like any buffer."""

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

log = logging.getLogger("fsdp_research")

BIAS = "e_score_correction_bias"


def _chosen(output) -> torch.Tensor | None:
    """The expert indices in a router's (or MoE block's) output: its first integer tensor."""
    for item in output if isinstance(output, tuple | list) else (output,):
        if isinstance(item, torch.Tensor) and not item.is_floating_point() and item.dtype is not torch.bool:
            return item
    return None


@dataclass
class _Router:
    # The module that owns the bias (looked up at each update: loading a checkpoint may replace the buffer).
    owner: nn.Module
    loads: torch.Tensor
    # Set before the owner's forward, cleared by the first expert choice seen (a child's, else its own).
    pending: bool = False


class BiasBalancer:
    """Counts the tokens each biased router sends to each expert in training forwards (a recomputation under
    activation checkpointing counts every token twice, which leaves the sign of the update as it is), and
    updates the biases after the optimizer step (at on_step_end: a built-in callback of the trainer's)."""

    def __init__(self, model: nn.Module, rate: float):
        self.rate, self.routers, self._hooks, self._warned = rate, [], [], False
        if rate == 0:
            return
        for path, module in model.named_modules():
            bias = module._buffers.get(BIAS)
            if bias is None:
                continue
            router = _Router(module, torch.zeros(bias.numel(), dtype=torch.float64, device=bias.device))
            self._hooks.append(module.register_forward_pre_hook(self._expect(router)))
            self._hooks += [m.register_forward_hook(self._count(router)) for m in (*module.children(), module)]
            self.routers.append((path, router))
        if self.routers:
            log.info(
                f"aux-loss-free balancing: {len(self.routers)} routers' expert bias updated at "
                f"model.moe.bias_update_rate={rate} after each step"
            )

    def _expect(self, router: _Router):
        def hook(module, args):
            router.pending = module.training

        return hook

    def _count(self, router: _Router):
        """The first expert choice the owner's forward sees (a child's output, else its own): tokens per expert
        (index_add_: no shape that depends on the data, nothing read back to the host)."""

        def hook(module, args, output):
            chosen = _chosen(output) if router.pending else None
            if chosen is not None:
                router.pending = False
                chosen = chosen.flatten()
                router.loads.index_add_(0, chosen, torch.ones_like(chosen, dtype=router.loads.dtype))

        return hook

    @torch.no_grad()
    def step(self, apply: bool = True) -> None:
        """After the optimizer step (a collective, every rank calls it): each router's bias moves towards balance,
        unless not `apply` (a step the loss scaler skipped); the counts start again either way."""
        if not self.routers:
            return
        if not apply:
            for _, router in self.routers:
                router.loads.zero_()
            return
        # One all-reduce for every router (their expert counts may differ).
        loads = torch.cat([router.loads for _, router in self.routers])
        dist.all_reduce(loads)
        loads = loads.split([router.loads.numel() for _, router in self.routers])
        blind = [path for (path, _), load in zip(self.routers, loads) if not load.any()]
        if blind and not self._warned:
            self._warned = True
            log.warning(f"aux-loss-free balancing: no expert choice seen in {blind[0]}'s output: its bias stays")
        for (_, router), load in zip(self.routers, loads):
            change = self.rate * torch.sign(load.mean() - load)
            change -= change.mean()
            bias = router.owner._buffers[BIAS]
            bias += change.to(bias.dtype)
            router.loads.zero_()

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        self.step(apply=not metrics["skipped"])

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
