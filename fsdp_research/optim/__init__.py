"""Optimizers (any `_target_`, parameter groups by name pattern, Muon exact under sharding), schedules, clipping."""

from .build import build_optimizer, check_optim, configured_keys
from .clipping import clip_, clip_grad_norm, grad_norm
from .groups import param_groups

__all__ = ["build_optimizer", "check_optim", "configured_keys", "clip_", "clip_grad_norm", "grad_norm", "param_groups"]
