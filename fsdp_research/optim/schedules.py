"""Learning rate schedules (schedule=<name>): the multiplier of each group's lr at each step, from the step and
trainer.max_steps alone, so a resume continues it exactly and a raised max_steps reshapes what is left of it
(wsd: a longer stable phase). Or schedule._target_: a function (step, max_steps, **kwargs) -> multiplier, or an
LRScheduler class; the group's other keys are its keyword arguments, and so are warmup_steps, min_lr_ratio,
decay_ratio and decay_shape where its signature names them."""

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace

import torch
from omegaconf import DictConfig

from fsdp_research.config.schema import DecayShape, ScheduleName
from fsdp_research.config.targets import check_call, kwargs_of, named_in, resolve
from fsdp_research.errors import ConfigError

# The group's keys that are not a target's keyword arguments.
_OWN = ("name", "warmup_steps", "min_lr_ratio", "decay_ratio", "decay_shape")


def _decayed(shape: DecayShape, progress: float, floor: float) -> float:
    """From 1 at progress 0 to floor at progress 1."""
    if shape is DecayShape.cosine:
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - (math.sqrt(progress) if shape is DecayShape.sqrt else progress))


def multiplier(cfg, step: int, max_steps: int) -> float:
    """The named schedule's multiplier for (0-based) step (cfg: the schedule group, as a config or a namespace)."""
    warmup, floor, name = cfg.warmup_steps, cfg.min_lr_ratio, ScheduleName(cfg.name)
    if step < warmup:
        return (step + 1) / warmup
    if name is ScheduleName.constant:
        return 1.0
    if name is ScheduleName.inverse_sqrt:
        return math.sqrt(max(1, warmup) / (step + 1))
    if name is ScheduleName.wsd:
        decay = round(cfg.decay_ratio * max_steps)
        start = max_steps - decay
        if step < start:
            return 1.0
        return _decayed(DecayShape(cfg.decay_shape), min(1.0, (step - start) / max(1, decay)), floor)
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return _decayed(DecayShape.cosine if name is ScheduleName.cosine else DecayShape.linear, progress, floor)


def _target_kwargs(cfg: DictConfig, target) -> dict:
    own = {k: v for k, v in kwargs_of(cfg).items() if k in _OWN and k != "name"}
    return {**named_in(target, own), **kwargs_of(cfg, _OWN)}


def check_schedule(cfg: DictConfig) -> None:
    if cfg.get("_target_"):
        target = resolve(cfg._target_, "schedule._target_")
        kwargs = _target_kwargs(cfg, target)
        if isinstance(target, type):
            if not issubclass(target, torch.optim.lr_scheduler.LRScheduler):
                raise ConfigError(
                    "schedule._target_",
                    f"{cfg._target_} is a class but not a torch LRScheduler",
                    "use an LRScheduler class or a function (step, max_steps) -> multiplier",
                )
            check_call(target, kwargs, "schedule._target_", "optimizer")
        else:
            check_call(target, kwargs, "schedule._target_", "step", "max_steps")
        return
    if cfg.name not in {s.value for s in ScheduleName}:
        raise ConfigError(
            "schedule.name",
            f"unknown schedule {cfg.name!r}",
            f"use one of {', '.join(s.value for s in ScheduleName)}, or schedule._target_",
        )
    unknown = sorted(set(cfg.keys()) - {*_OWN, "_target_"})
    if unknown:
        raise ConfigError(f"schedule.{unknown[0]}", f"the {cfg.name} schedule has no key {unknown[0]!r}", "remove it")
    if cfg.warmup_steps < 0:
        raise ConfigError("schedule.warmup_steps", f"{cfg.warmup_steps} is negative", "use 0 or more")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError("schedule.min_lr_ratio", f"{cfg.min_lr_ratio} is not in [0, 1]", "use e.g. 0.1")
    if not 0 <= cfg.decay_ratio <= 1:
        raise ConfigError("schedule.decay_ratio", f"{cfg.decay_ratio} is not in [0, 1]", "use e.g. 0.2")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: DictConfig, max_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    if cfg.get("_target_"):
        target = resolve(cfg._target_, "schedule._target_")
        kwargs = _target_kwargs(cfg, target)
        if isinstance(target, type):
            return target(optimizer, **kwargs)
        factor: Callable[[int], float] = functools.partial(_call, functools.partial(target, **kwargs), max_steps)
    else:
        # Plain values: the lambda runs every step.
        factor = functools.partial(multiplier, SimpleNamespace(**kwargs_of(cfg)), max_steps=max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _call(fn: Callable, max_steps: int, step: int) -> float:
    return float(fn(step, max_steps))
