"""objective=simpo: SimPO on data=preference, as TRL's CPOTrainer computes it with loss_type="simpo" and
cpo_alpha=0: no reference model; each completion's log-probability averaged over its tokens, the loss
-log sigmoid(beta (chosen's - rejected's) - gamma) (label_smoothing: the flipped term, as TRL's); the rewards are
beta x those averages, logps/* the averages (objectives.pairs: the metrics, eval)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from fsdp_research.errors import ConfigError
from fsdp_research.objectives.pairs import PairObjective, pair_logps, pair_result


class SimPO(PairObjective):
    def __init__(self, beta: float = 0.1, gamma: float = 0.5, label_smoothing: float = 0.0):
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

    def check(self, cfg: DictConfig) -> None:
        super().check(cfg)
        if self.beta <= 0:
            raise ConfigError("objective.beta", f"{self.beta} is not above 0", "use e.g. 2.0 (SimPO's paper) or 0.1")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("objective.label_smoothing", f"{self.label_smoothing} is not in [0, 0.5)", "use 0")

    def pairs(self, model: nn.Module, batch: torch.Tensor, amp) -> dict[str, torch.Tensor]:
        chosen, rejected, n_chosen, n_rejected, real = pair_logps(model, batch, amp)
        chosen, rejected = chosen / n_chosen, rejected / n_rejected
        margin = self.beta * (chosen - rejected) - self.gamma
        eps = self.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        return pair_result(loss, (self.beta * chosen, self.beta * rejected), (chosen, rejected), real)
