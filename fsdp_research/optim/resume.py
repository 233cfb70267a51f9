"""On resume the config wins over the checkpoint for every optimizer and schedule key the user sets. The group keys
(weight decay, betas, ...) are kept by the checkpointer's load; the learning rates (optim.lr, optim.others.lr,
param_groups[].lr_scale) and the schedule's keys live in the scheduler, whose state (base rates, a class's own
arguments) the checkpoint brings back: so, where the config changed, the scheduler is built anew from it and moved
on to the checkpoint's step."""

import logging
import os
import warnings
from collections.abc import Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from fsdp_research.config.schema import flat
from fsdp_research.optim.schedules import build_scheduler

log = logging.getLogger("fsdp_research")
SECTIONS = ("optim", "schedule")
_ABSENT = "(absent)"


def changed_settings(saved: DictConfig, cfg: DictConfig) -> list[str]:
    """`key: old -> new` for each optim.* and schedule.* value of cfg that differs from the saved config's."""
    before, now = ({}, {})
    for section in SECTIONS:
        before.update(flat(OmegaConf.to_container(saved.get(section, {}), resolve=True), section))
        now.update(flat(OmegaConf.to_container(cfg[section], resolve=True), section))
    return [
        f"{key}: {before.get(key, _ABSENT)} -> {now.get(key, _ABSENT)}"
        for key in sorted(before.keys() | now.keys())
        if before.get(key, _ABSENT) != now.get(key, _ABSENT)
    ]


def continue_schedule(
    scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: DictConfig, base_lrs: Sequence[float], checkpoint_dir: str
) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler to go on with after a resume: the loaded one where the config's optimizer and schedule keys
    (and so base_lrs, the rates the config gives each group) are the checkpoint's; else one built from the config at
    the checkpoint's step. Each changed value is logged in one line."""
    saved_path = os.path.join(checkpoint_dir, "train_config.yaml")
    changes = changed_settings(OmegaConf.load(saved_path), cfg) if os.path.exists(saved_path) else []
    if changes:
        log.info(f"resumed with the config's values: {'; '.join(changes)}")
    if not changes and list(scheduler.base_lrs) == list(base_lrs):
        return scheduler
    optimizer, steps = scheduler.optimizer, scheduler.last_epoch
    for group, base in zip(optimizer.param_groups, base_lrs):
        group["lr"] = group["initial_lr"] = base
    fresh = build_scheduler(optimizer, cfg.schedule, cfg.trainer.max_steps)
    if isinstance(fresh, torch.optim.lr_scheduler.LambdaLR):  # closed form: the multiplier at the step
        fresh.last_epoch = steps
        fresh._last_lr = [base * fn(steps) for fn, base in zip(fresh.lr_lambdas, base_lrs)]
        for group, lr in zip(optimizer.param_groups, fresh._last_lr):
            group["lr"] = lr
        return fresh
    with warnings.catch_warnings():  # "step() before optimizer.step()": the steps were taken before the resume
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            fresh.step()
    return fresh
