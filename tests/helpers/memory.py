"""Per-rank memory of one real training step, by category, as torch's FSDP memory tracker
(torch.distributed._tools.fsdp2_mem_tracker) measures it: what the planner's prediction is held against."""

import contextlib
import gc
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

from fsdp_research.build import build_sharded_model
from fsdp_research.config import typed
from fsdp_research.distributed import init_distributed
from fsdp_research.losses import build_loss, train_loss
from fsdp_research.models import build_hf_config
from fsdp_research.optim import build_optimizer, clip_grad_norm
from tests.helpers.dist import run_distributed

# The planner's categories as sums of the tracker's.
GROUPS = {
    "sharded_params": (_FSDPRefType.SHARDED_PARAM,),
    "sharded_grads": (_FSDPRefType.SHARDED_GRAD,),
    "gathered": (_FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.ALL_GATHER),
    "unsharded_grads": (_FSDPRefType.UNSHARDED_GRAD, _FSDPRefType.REDUCE_SCATTER),
    "activations": (_FSDPRefType.ACT,),
    "temporaries": (_FSDPRefType.TEMP,),
    "activations_and_temporaries": (_FSDPRefType.ACT, _FSDPRefType.TEMP),
    "peak": ("Total",),
}


class _GroupPeaks(FSDPMemTracker):
    """The tracker, plus each group's own peak over the step (its peak snapshot only holds the categories at the
    moment of the total's peak) and the optimizer state held between steps."""

    def __enter__(self) -> "_GroupPeaks":
        tracker = super().__enter__()
        self.peaks = dict.fromkeys(GROUPS, 0)
        self.peaks["optimizer"] = sum(snap[_FSDPRefType.OPT] for snap in self.get_tracker_snapshot().values())
        return tracker

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        for snap in self._curr_mem_snap.values():
            for group, keys in GROUPS.items():
                self.peaks[group] = max(self.peaks[group], sum(snap.get(k, 0) for k in keys))


def _step(model, optimizer, batch: torch.Tensor, cfg) -> None:
    """One step as the trainer takes it (one micro-batch)."""
    train_loss(model, batch, contextlib.nullcontext(), build_loss(cfg.loss))[0].backward()
    clip_grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _measure_each(configs: dict[str, Any]) -> dict[str, dict[str, int]]:
    device = torch.device("cpu")
    peaks = {}
    for name, container in configs.items():
        cfg = typed(container)
        init_distributed(cfg.distributed, device)
        hf_config = build_hf_config(cfg.model)
        model, plan = build_sharded_model(cfg, hf_config, device, dist.get_world_size())
        optimizer, _ = build_optimizer(model, cfg, plan.blocks)
        gen = torch.Generator().manual_seed(dist.get_rank())
        batch = torch.randint(
            0, hf_config.vocab_size, (cfg.trainer.micro_batch_size, cfg.data.seq_len + 1), generator=gen
        )
        # The first step creates the optimizer state: the steady state is the second.
        _step(model, optimizer, batch, cfg)
        tracker = _GroupPeaks(model, optimizer)
        tracker.track_inputs((batch,))
        with tracker:
            _step(model, optimizer, batch, cfg)
        peaks[name] = tracker.peaks
        del model, optimizer, tracker
        gc.collect()
    return peaks


def measure_step_memory(configs: dict[str, Any], world_size: int) -> dict[str, dict[str, int]]:
    """Rank 0's peak bytes per group (and the optimizer state) in one tracked step of each config, all on the same
    `world_size` processes (gloo, CPU); the ranks hold equal shares."""
    containers = {name: OmegaConf.to_container(cfg, resolve=True) for name, cfg in configs.items()}
    return run_distributed(_measure_each, world_size, containers)
