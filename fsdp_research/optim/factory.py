"""The optimizer a config names (optim._target_, called with the parameter groups and the group's other keys;
with optim.others, a second optimizer for everything but the repeating blocks' weight matrices, as
muon_params.muon_split classifies them), and its schedule."""

import logging
from collections.abc import Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from fsdp_research.config.targets import check_call, kwargs_of, named_in, resolve
from fsdp_research.distributed.names import clean_name
from fsdp_research.errors import ConfigError
from fsdp_research.optim.combined import Combined
from fsdp_research.optim.groups import check_no_decay, check_patterns, param_groups
from fsdp_research.optim.muon import Muon
from fsdp_research.optim.muon_params import describe, muon_split
from fsdp_research.optim.schedules import build_scheduler, check_schedule

# optim's own keys: the rest are the target's keyword arguments.
OWN_KEYS = ("name", "no_decay", "param_groups", "others", "grad_clip", "warmup_steps", "min_lr_ratio")


log = logging.getLogger("fsdp_research")

# Set for every optimizer by the framework (per group): passed on to a target whose signature takes them only.
_PER_GROUP = ("lr", "weight_decay")


# How torch's optimizers name their arguments in the errors they raise ("Invalid learning rate: -1").
_SAID_AS = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "weight_decay": "weight_decay"}


def _target_and_kwargs(node: DictConfig, key: str, exclude: Sequence[str] = ()) -> tuple[type, dict]:
    target = resolve(node._target_, f"{key}._target_")
    kwargs = kwargs_of(node, tuple(exclude))
    checked = {k: v for k, v in kwargs.items() if k not in _PER_GROUP or k in named_in(target, kwargs)}
    check_call(target, checked, f"{key}._target_", "params")
    return target, kwargs


def _name(target) -> str:
    return getattr(target, "__qualname__", str(target))


def _check_values(target, kwargs: dict, key: str) -> None:
    """The optimizer's own checks of its values (a negative lr, betas out of [0, 1)), run on one small parameter
    before any compute; a refusal said as the key its value came from."""
    probe = torch.zeros(2, 2, requires_grad=True)
    try:
        target([{"params": [probe]}], **named_in(target, kwargs, or_any=True))
    except ValueError as err:
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        lowered = said.lower()
        name = next((k for k in kwargs if k in lowered), None)
        name = name or next((k for words, k in _SAID_AS.items() if words in lowered and k in kwargs), None)
        where = f"{key}.{name}" if name else f"{key}._target_"
        value = f"{kwargs[name]!r}: " if name else ""
        raise ConfigError(where, f"{value}{_name(target)} refuses it ({said})", "give a value it takes") from None
    except Exception:  # a factory that needs what only a run has (a process group, a device): checked when built
        pass


def check_optim(cfg: DictConfig, schedule: DictConfig) -> None:
    """Everything about the optimizer and its schedule that needs no model: targets import, kwargs bind."""
    check_no_decay(cfg.no_decay)
    target, kwargs = _target_and_kwargs(cfg, "optim", OWN_KEYS)
    if cfg.others is None and isinstance(target, type) and issubclass(target, Muon):
        raise ConfigError("optim.others", "is not set: Muon takes matrices only", "set it, e.g. torch.optim.AdamW")
    _check_values(target, kwargs, "optim")
    if cfg.others is not None:
        for key in ("_target_", "lr"):
            if key not in cfg.others:
                raise ConfigError(f"optim.others.{key}", "is not set", "set it, e.g. torch.optim.AdamW and 3e-3")
        _check_values(*_target_and_kwargs(cfg.others, "optim.others"), "optim.others")
    check_schedule(schedule)


def configured_keys(cfg: DictConfig) -> set[str]:
    """The parameter-group keys the config sets (on resume they win over the checkpoint's): the optimizers' keyword
    arguments and the pattern entries' keys, and weight decay; not the lr (the schedule's), nor what an optimizer
    keeps in its groups by itself (a schedule-free optimizer's step count)."""
    keys = set(kwargs_of(cfg, OWN_KEYS)) | {"weight_decay"}
    if cfg.others is not None:
        keys |= set(kwargs_of(cfg.others))
    for entry in cfg.param_groups:
        keys |= set(entry) - {"match", "lr_scale"}
    return keys - {"lr"}


def block_matrices(model: nn.Module, block_paths: Sequence[str]) -> set[int]:
    """The ids of the parameters optim._target_ takes beside optim.others (muon_split's matrices)."""
    names = muon_split(model, block_paths).matrices
    return {id(p) for n, p in model.named_parameters() if clean_name(n) in names}


def _build_one(
    model, node: DictConfig, key: str, named, entries, no_decay, exclude=(), layouts=None
) -> torch.optim.Optimizer:
    target, kwargs = _target_and_kwargs(node, key, exclude)
    # lr and weight_decay set per group (lr_scale, no_decay); passed on only to a target that takes them.
    lr, weight_decay = kwargs.get("lr"), kwargs.get("weight_decay", 0.0)
    kwargs = named_in(target, kwargs, or_any=True)
    groups = param_groups(model, weight_decay, no_decay, entries, named, lr)
    if "weight_decay" not in named_in(target, {"weight_decay": 0}, or_any=True):
        for group in groups:
            group.pop("weight_decay")
    # Muon's logical matrices, to a target that takes them.
    return target(groups, **kwargs, **named_in(target, {"layouts": layouts}))


def build_optimizer(model: nn.Module, train_cfg: DictConfig, block_paths: Sequence[str] = ()):
    """(optimizer, LR scheduler) of a run's config (optim, schedule, trainer.max_steps) over the model's
    parameters; block_paths: the repeating blocks (with optim.others, their matrices get optim._target_)."""
    cfg = train_cfg.optim
    model = getattr(model, "module", model)  # under torch's DDP, the model it wraps (the same parameters)
    # Frozen ones (LoRA's base) have no optimizer state.
    named = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    entries = OmegaConf.to_container(cfg.param_groups, resolve=True) if cfg.param_groups else []
    check_patterns(entries, [n for n, _ in named])
    if cfg.others is None:
        optimizer = _build_one(model, cfg, "optim", named, entries, cfg.no_decay, OWN_KEYS)
    else:
        split = muon_split(model, block_paths)
        main = [(n, p) for n, p in named if n in split.matrices]
        rest = [(n, p) for n, p in named if n not in split.matrices]
        layouts = {p: split.matrices[n].layout for n, p in main}
        parts = [_build_one(model, cfg, "optim", main, entries, cfg.no_decay, OWN_KEYS, layouts)] if main else []
        if rest:
            parts.append(_build_one(model, cfg.others, "optim.others", rest, entries, cfg.no_decay))
        optimizer = Combined(parts)
        log.info(describe(split, cfg._target_, cfg.others._target_))
    return optimizer, build_scheduler(optimizer, train_cfg.schedule, train_cfg.trainer.max_steps)
