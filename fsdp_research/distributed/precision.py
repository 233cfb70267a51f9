"""Mixed precision: FSDP2's MixedPrecisionPolicy (autocast for the DDP baseline), and a dynamic loss
scaler that works on sharded gradients."""

import contextlib
import re
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_research.config.schema import PrecisionConfig, Strategy
from fsdp_research.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, key: str) -> torch.dtype:
    """The dtype a config names; `key` is the config key the error names."""
    if name not in _DTYPES:
        raise ConfigError(key, f"unknown dtype {name!r}", f"use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def dtypes(cfg: PrecisionConfig) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, gradient reduction dtype)."""
    return parse_dtype(cfg.param_dtype, "precision.param_dtype"), parse_dtype(
        cfg.reduce_dtype, "precision.reduce_dtype"
    )


def build_mp_policy(cfg: PrecisionConfig) -> MixedPrecisionPolicy | None:
    param, reduce = dtypes(cfg)
    if param is torch.float32 and reduce is torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def fp32_policy() -> MixedPrecisionPolicy:
    """For the modules a family keeps in fp32 whatever the training dtype (router gates)."""
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def fp32_names(model: nn.Module, param: torch.dtype) -> re.Pattern | None:
    """What the family keeps in fp32 at this compute dtype, as from_pretrained does: `_keep_in_fp32_modules_strict`
    under bf16 and fp16, `_keep_in_fp32_modules` under fp16; patterns searched in parameter and buffer names
    (`*` a wildcard). None under fp32, or for a family that keeps nothing."""
    patterns = set(getattr(model, "_keep_in_fp32_modules_strict", None) or []) if param is not torch.float32 else set()
    if param is torch.float16:
        patterns |= set(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not patterns:
        return None
    return re.compile("|".join(re.escape(p).replace(r"\*", ".*") for p in sorted(patterns)))


def kept_in_fp32(model: nn.Module, param: torch.dtype) -> list[str]:
    """The paths of the modules the family keeps in fp32 at this compute dtype: each module that holds a kept
    parameter and nothing else (a router's gate). A kept parameter beside others in its module (a state-space
    mixer's dt_bias) or shared outside it (a tied head) stays in the training dtype: making its whole module
    fp32 would compute more in fp32 than from_pretrained does."""
    names = fp32_names(model, param)
    if names is None:
        return []
    owners = {name.rpartition(".")[0] for name, _ in model.named_parameters() if names.search(name)}
    kept = []
    for path in sorted(owners):
        module = model.get_submodule(path)
        inside = dict(module.named_parameters(prefix=path, remove_duplicate=False))
        outside = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n not in inside}
        if all(names.search(n) for n in inside) and not any(id(p) in outside for p in inside.values()):
            kept.append(path)
    return kept


def autocast(cfg: PrecisionConfig, device: torch.device, enabled: bool):
    """Autocast for models FSDP does not cast (the DDP baseline); a no-op otherwise."""
    param, _ = dtypes(cfg)
    if not enabled or param is torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=param)


class LossScaler:
    """Dynamic loss scaling. Each rank checks its own gradient shards for inf/nan; one all-reduce makes
    every rank skip the same steps. Disabled, it is the identity."""

    def __init__(self, cfg: PrecisionConfig):
        self.enabled = cfg.loss_scaling
        self.scale = cfg.init_scale if self.enabled else 1.0
        self.growth_interval = cfg.growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Unscale gradients in place; True when every rank's gradients are finite."""
        if not self.enabled:
            return True
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        found_inf = torch.zeros((), device=local[0].device)
        for g in local:
            g.mul_(1.0 / self.scale)
            found_inf = torch.maximum(found_inf, (~torch.isfinite(g)).any().float())
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return not bool(found_inf.item())

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.skipped_steps += 1
            self.good_steps = 0
            self.scale /= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped_steps = state["scale"], state["good_steps"], state["skipped_steps"]


def forward_autocast(cfg, device: torch.device):
    """The context the trainer's forward runs in, for an objective's own forwards of the run's model (config `cfg`):
    autocast under the classic DDP baseline, a null context under FSDP (its mixed precision policy casts)."""
    return autocast(cfg.precision, device, enabled=Strategy(cfg.sharding.strategy) is Strategy.ddp_classic)
