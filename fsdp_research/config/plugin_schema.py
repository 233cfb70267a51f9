"""The plug-in groups' schemas: optim, schedule, loss and objective, each a `_target_` (or a named default) whose
other keys are its keyword arguments. A leaf: imports nothing of ours."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class OptimConfig:
    """The framework's keys; every other key of the group (betas, eps, momentum, ...) is a keyword argument of
    `_target_`, which is called with the parameter groups (Hydra's _partial_ semantics)."""

    _target_: str = "torch.optim.AdamW"
    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    # Parameters left out of weight decay: bias (every *.bias), 1d (every vector: norm scales, biases),
    # embedding (the embedding tables, and an output layer tied to them).
    no_decay: list[str] = field(default_factory=lambda: ["bias", "1d"])
    # [{match: <glob or regex>, lr_scale: x, weight_decay: y, <other group keys>}, ...]: in order, first match wins.
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    # {_target_, kwargs}: the optimizer of every parameter that is not a 2-D weight matrix inside a repeating block
    # (embeddings, output head, norms, biases); `_target_` then gets those matrices only (optim=muon).
    others: dict[str, Any] | None = None
    # Max global gradient norm; 0 turns clipping off (the norm is still measured).
    grad_clip: float = 1.0
    # Deprecated: schedule.warmup_steps and schedule.min_lr_ratio (still read, with a warning).
    warmup_steps: int | None = None
    min_lr_ratio: float | None = None


class ScheduleName(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"
    inverse_sqrt = "inverse_sqrt"


class DecayShape(str, Enum):
    linear = "linear"
    cosine = "cosine"
    sqrt = "sqrt"


@dataclass
class ScheduleConfig:
    """The learning rate multiplier of each step. `_target_`: a function (step, max_steps, **kwargs) -> multiplier,
    or an LRScheduler class (called with the optimizer and the group's other keys)."""

    # cosine, linear, constant, wsd, inverse_sqrt (ScheduleName); any name with _target_.
    name: str = "cosine"
    _target_: str | None = None
    # Linear from 1/warmup_steps to 1 over the first warmup_steps steps (every named schedule).
    warmup_steps: int = 10
    # Where the decay ends, as a share of the peak (cosine, linear, wsd).
    min_lr_ratio: float = 0.1
    # wsd: the share of max_steps at the end spent decaying; before it, the rate stays at its peak.
    decay_ratio: float = 0.2
    decay_shape: DecayShape = DecayShape.linear


@dataclass
class LossConfig:
    """The training loss. `_target_`: a function (logits, labels) -> scalar (the group's other keys are its keyword
    arguments). Eval is always the plain cross-entropy."""

    name: str = "cross_entropy"
    _target_: str | None = None
    # PaLM's auxiliary z-loss: this x mean(logsumexp(logits)^2), logged apart as z_loss.
    z_loss: float = 0.0
    label_smoothing: float = 0.0
    # n > 1: the output projection and the cross-entropy over n chunks of the tokens, each recomputed in backward
    # (a checkpointed loop): the [tokens x vocab] logits never exist whole, for one more output projection.
    chunks: int = 1


@dataclass
class ObjectiveConfig:
    """What training minimizes: `_target_` an fsdp_research.objectives.Objective subclass, called with the group's
    other keys. objective=lm, the default: the next-token loss, whose settings are the `loss` group."""

    _target_: str = "fsdp_research.objectives.lm.NextToken"
    name: str = "lm"
