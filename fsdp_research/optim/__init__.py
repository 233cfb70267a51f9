"""Optimizers (any `_target_`, parameter groups by name pattern, Muon exact under sharding), schedules, clipping."""

from fsdp_research.optim.clipping import clip_, clip_grad_norm, grad_norm
from fsdp_research.optim.factory import build_optimizer, check_optim, configured_keys
from fsdp_research.optim.groups import param_groups

__all__ = ["build_optimizer", "check_optim", "configured_keys", "clip_", "clip_grad_norm", "grad_norm", "param_groups"]
