"""objective=dpo: direct preference optimisation on data=preference, as TRL's DPOTrainer computes it: each pair's
log-probability ratios of policy to reference (summed over the completion's tokens), the loss of their difference
(sigmoid, ipo, hinge, robust, or several weighted, `sft` adding the chosen completion's NLL: RPO), and TRL's
metrics (objectives.pairs).

The reference: `auto` is the policy with its LoRA adapters switched off (no second model) or, without LoRA, a
frozen copy of the initial weights sharded as the policy is; a model directory is loaded as such a copy;
`precompute` computes its log-probabilities once before training and looks them up (objectives.reference)."""

import gc
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from fsdp_research.callbacks.footprint import PlannedRank
from fsdp_research.data.pipeline import Data
from fsdp_research.distributed.precision import forward_autocast
from fsdp_research.errors import ConfigError
from fsdp_research.model.lora import enabled
from fsdp_research.objectives.pairs import PairObjective, pair_documents, pair_logps, pair_result
from fsdp_research.objectives.reference import (
    check_directory,
    compute_table,
    frozen_copy,
    load_table,
    reference_model,
    save_table,
    table_path,
)

log = logging.getLogger("fsdp_research")

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "sft")


class DPO(PairObjective):
    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str | list[str] = "sigmoid",
        loss_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        reference: str = "auto",
    ):
        self.beta, self.label_smoothing, self.reference = beta, label_smoothing, reference
        self.directory = None if reference in ("auto", "precompute") else reference  # a model's: the reference
        # precompute: the reference's log-probabilities are looked up, not computed, while training.
        self.reference_forwards = 0 if reference == "precompute" else 1
        self.loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        self.loss_weights = list(loss_weights) if loss_weights is not None else [1.0] * len(self.loss_types)
        self.tables: dict[str | None, torch.Tensor] = {}  # precompute: by eval set name, None: the training data

    @classmethod
    def planned_bytes(cls, rank: PlannedRank, reference: str = "auto", **_) -> int:
        """What the planner counts (as a callback's state): the reference's copy of the rank's parameters; none
        where it is the policy with its adapters off."""
        return 0 if (reference == "auto" and rank.adapters) or reference == "precompute" else rank.param_bytes

    def check(self, cfg: DictConfig) -> None:
        super().check(cfg)
        unknown = [t for t in self.loss_types if t not in LOSSES]
        if unknown or not self.loss_types:
            raise ConfigError(
                "objective.loss_type", f"{unknown or 'none'}: not a DPO loss", f"use one or more of {', '.join(LOSSES)}"
            )
        if len(self.loss_weights) != len(self.loss_types):
            raise ConfigError(
                "objective.loss_weights",
                f"{len(self.loss_weights)} weights for {len(self.loss_types)} loss types",
                "give one weight a loss type",
            )
        if self.beta <= 0:
            raise ConfigError("objective.beta", f"{self.beta} is not above 0", "use e.g. 0.1")
        if self.label_smoothing and "robust" not in self.loss_types:
            raise ConfigError(
                "objective.label_smoothing", "is robust's, which objective.loss_type does not name", "add robust, or 0"
            )
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                "objective.label_smoothing", f"{self.label_smoothing} is not in [0, 0.5)", "use e.g. 0.1 (robust)"
            )
        check_directory(self.reference, ("auto", "precompute"), cfg)
        if self.reference == "precompute" and not cfg.model.load_weights:
            raise ConfigError(
                "objective.reference",
                "precompute: the reference is the pretrained weights, which this model does not load",
                "use model=pretrained, or reference=auto",
            )

    def prepare(self, model: nn.Module, device: torch.device, data: Data) -> None:
        super().prepare(model, device, data)
        self.amp = forward_autocast(self.cfg, device)
        self.model = None  # the policy, its adapters off: the reference
        if self.reference == "precompute":
            self._precompute(model, device, data)
        elif self.reference != "auto" or not enabled(self.cfg.model.lora):
            self.model = frozen_copy(self.cfg, device, self.directory)

    def _precompute(self, policy: nn.Module, device: torch.device, data: Data) -> None:
        """Each store's table of reference log-probabilities (objectives.reference): read where a start before
        made it, else computed with the reference (the policy with its adapters off, or a copy built for it and let
        go) and kept."""
        by_path: dict[str, torch.Tensor] = {}
        t = self.cfg.trainer
        for name, windows in self.data_sets(data).items():
            path = table_path(windows, self.cfg)
            if path not in by_path:
                by_path[path] = load_table(path, len(windows.first), device)
                if by_path[path] is not None:
                    log.info(f"objective.reference=precompute: read {path}")
            if by_path[path] is None:
                if self.model is None and not enabled(self.cfg.model.lora):
                    self.model = frozen_copy(self.cfg, device, self.directory)
                with reference_model(self.model, policy) as reference:
                    tp = self.cfg.parallel.tp
                    by_path[path] = compute_table(reference, windows, t.micro_batch_size, device, self.amp, tp)
                save_table(path, by_path[path])
                log.info(f"objective.reference=precompute: {len(windows.first):,} documents' log-probs in {path}")
            self.tables[name] = by_path[path]
        self.model = None  # a copy built for it is let go (FSDP's state holds cycles: collected now, not later)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def reference_logps(self, policy: nn.Module, batch: torch.Tensor, amp, real: torch.Tensor) -> tuple:
        """The reference's log-probabilities of the pairs' two documents ([pairs] each): looked up (precompute) or
        its forward, without gradient."""
        if self.reference == "precompute":
            table = self.reading(self.tables)
            return tuple(table[docs[real]].float() for docs in pair_documents(batch))
        with torch.no_grad(), reference_model(self.model, policy) as reference:
            return pair_logps(reference, batch, amp)[:2]

    def pairs(self, model: nn.Module, batch: torch.Tensor, amp) -> dict[str, torch.Tensor]:
        chosen, rejected, n_chosen, n_rejected, real = pair_logps(model, batch, amp)
        ref_chosen, ref_rejected = self.reference_logps(model, batch, amp, real)
        ratios = chosen - ref_chosen, rejected - ref_rejected
        delta, b, eps = ratios[0] - ratios[1], self.beta, self.label_smoothing
        loss = torch.zeros_like(delta)
        for kind, weight in zip(self.loss_types, self.loss_weights):
            if kind == "sigmoid":
                each = -F.logsigmoid(b * delta)
            elif kind == "hinge":
                each = torch.relu(1 - b * delta)
            elif kind == "ipo":  # each log-ratio over its completion's tokens, as TRL
                each = (ratios[0] / n_chosen - ratios[1] / n_rejected - 1 / (2 * b)) ** 2
            elif kind == "robust":
                each = (-(1 - eps) * F.logsigmoid(b * delta) + eps * F.logsigmoid(-b * delta)) / (1 - 2 * eps)
            else:  # sft: the chosen completion's mean NLL a token (TRL's over a batch's tokens; a pair's here)
                each = -chosen / n_chosen
            loss = loss + weight * each
        return pair_result(loss, (b * ratios[0], b * ratios[1]), (chosen, rejected), real)
