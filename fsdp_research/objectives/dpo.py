"""objective=dpo: direct preference optimisation on data=preference, as TRL's DPOTrainer computes it: each pair's
log-probability ratios of policy to reference (summed over the completion's tokens), the loss of their difference
(sigmoid, ipo, hinge, robust, or several weighted, `sft` adding the chosen completion's NLL: RPO), and TRL's
metrics (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected). The
loss is the mean over the step's pairs on every rank and micro-batch, so 1 rank = N ranks.

The reference: `auto` is the policy with its LoRA adapters switched off (no second model) or, without LoRA, a
frozen copy of the initial weights sharded as the policy is; a model directory is loaded as such a copy."""

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, open_dict

from fsdp_research.config.data_schema import DataKind
from fsdp_research.data.packing import IGNORE, LABELS, POSITIONS
from fsdp_research.data.pipeline import Data, eval_set_paths
from fsdp_research.errors import ConfigError
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import build_sharded_model
from fsdp_research.model.lora import enabled, lora_layers
from fsdp_research.objectives.base import Objective, StepContext
from fsdp_research.train.evaluation import held_out_sums
from fsdp_research.train.losses import token_losses

LOSSES = ("sigmoid", "ipo", "hinge", "robust", "sft")
# The metrics, TRL's names; summed over pairs in a step's stats, logged as means over them.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_sums(values: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(chosen, rejected, their target counts, whether each is a pair) of packed preference samples (documents 2k
    and 2k + 1 of a sample: a pair's chosen and rejected sequence, each with its positions from 0;
    data.packing.PairWindows): values [n, seq_len] summed over each document's targets, [n, seq_len // 2] each."""
    document = (batch[:, POSITIONS] == 0).cumsum(1) - 1
    targets = (batch[:, LABELS] != IGNORE).to(values.dtype)
    sums = torch.zeros_like(values).scatter_add_(1, document, values * targets)
    counts = torch.zeros_like(values).scatter_add_(1, document, targets)
    pairs = values.shape[1] // 2
    chosen, rejected = sums[:, 0 : 2 * pairs : 2], sums[:, 1 : 2 * pairs : 2]
    n_chosen, n_rejected = counts[:, 0 : 2 * pairs : 2], counts[:, 1 : 2 * pairs : 2]
    # The padding after the last pair is a document of its own, with no target.
    return chosen, rejected, n_chosen, n_rejected, (n_chosen > 0) & (n_rejected > 0)


class DPO(Objective):
    reads = (DataKind.preference,)
    takes_packed = True

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str | list[str] = "sigmoid",
        loss_weights: list[float] | None = None,
        label_smoothing: float = 0.0,
        reference: str = "auto",
    ):
        self.beta, self.label_smoothing, self.reference = beta, label_smoothing, reference
        self.loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        self.loss_weights = list(loss_weights) if loss_weights is not None else [1.0] * len(self.loss_types)

    def check(self, cfg: DictConfig) -> None:
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
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                "objective.label_smoothing", f"{self.label_smoothing} is not in [0, 0.5)", "use e.g. 0.1 (robust)"
            )
        if self.reference != "auto" and not os.path.isfile(os.path.join(self.reference, "config.json")):
            raise ConfigError(
                "objective.reference",
                f"{self.reference!r} is neither auto nor a model directory (no config.json)",
                "use auto, or a directory save_pretrained wrote",
            )
        if cfg.trainer.eval_interval and not eval_set_paths(cfg.data):
            raise ConfigError(
                "data.eval_paths", "objective=dpo evaluates held-out pairs read whole", "give eval files of pairs"
            )

    def setup(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def prepare(self, model: nn.Module, device: torch.device) -> None:
        self.model = None  # the policy, its adapters off: the reference
        if self.reference == "auto" and enabled(self.cfg.model.lora):
            return
        cfg = self.cfg.copy()
        with open_dict(cfg):
            cfg.model.lora.r = None
            if self.reference != "auto":
                cfg.model.name_or_path, cfg.model.load_weights = self.reference, True
        self.model, _ = build_sharded_model(cfg, build_hf_config(cfg.model), device, dist.get_world_size())
        self.model.requires_grad_(False).eval()

    @contextlib.contextmanager
    def _reference(self, policy: nn.Module) -> Iterator[nn.Module]:
        if self.model is not None:
            yield self.model
            return
        layers = [layer for _, layer in lora_layers(policy)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield policy
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    def targets(self, batch: torch.Tensor) -> torch.Tensor:
        return pair_sums(batch[:, LABELS].float(), batch)[-1].sum(1)

    def _pairs(self, model: nn.Module, batch: torch.Tensor, amp) -> dict[str, torch.Tensor]:
        """Each pair's loss and metrics, [pairs], of this micro-batch, and the sample it is in ("sample")."""
        policy = -token_losses(model, batch, amp)
        with torch.no_grad(), self._reference(model) as reference:
            ref = -token_losses(reference, batch, amp)
        chosen, rejected, n_chosen, n_rejected, real = pair_sums(policy, batch)
        ref_chosen, ref_rejected = (x[real] for x in pair_sums(ref, batch)[:2])
        chosen, rejected, n_chosen, n_rejected = chosen[real], rejected[real], n_chosen[real], n_rejected[real]
        delta = (chosen - ref_chosen) - (rejected - ref_rejected)
        b, eps = self.beta, self.label_smoothing
        loss = torch.zeros_like(delta)
        for kind, weight in zip(self.loss_types, self.loss_weights):
            if kind == "sigmoid":
                each = -F.logsigmoid(b * delta)
            elif kind == "hinge":
                each = torch.relu(1 - b * delta)
            elif kind == "ipo":  # each log-ratio over its completion's tokens, as TRL
                each = ((chosen - ref_chosen) / n_chosen - (rejected - ref_rejected) / n_rejected - 1 / (2 * b)) ** 2
            elif kind == "robust":
                each = (-(1 - eps) * F.logsigmoid(b * delta) + eps * F.logsigmoid(-b * delta)) / (1 - 2 * eps)
            else:  # sft: the chosen completion's mean NLL a token (TRL's over a batch's tokens; a pair's here)
                each = -chosen / n_chosen
            loss = loss + weight * each
        rewards = b * (chosen - ref_chosen).detach(), b * (rejected - ref_rejected).detach()
        metrics = (*rewards, (rewards[0] > rewards[1]).float(), rewards[0] - rewards[1], chosen.detach(), rejected)
        return {"loss": loss, **dict(zip(METRICS, metrics)), "sample": real.nonzero()[:, 0]}

    def loss(self, model: nn.Module, batch: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, dict]:
        pairs = self._pairs(model, batch, ctx.amp)
        stats = {k: pairs[k].detach().sum() for k in METRICS}
        return pairs["loss"].sum() * ctx.weight, stats

    def metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        # The step's pairs (stats["targets"]) are already summed over ranks; the tp ranks of a group sum the same.
        sums = torch.stack([stats[k].double() for k in METRICS])
        dist.all_reduce(sums)
        means = sums / (stats["targets"].double() * self.cfg.parallel.tp)
        return {"targets": round(stats["targets"].item()), **dict(zip(METRICS, means.tolist()))}

    def evaluate(self, model: nn.Module, data: Data, cfg: DictConfig, device: torch.device, amp) -> dict[str, float]:
        """eval_loss and TRL's metrics, eval_-prefixed: means over the eval pairs (data.eval_paths, read whole)."""
        keys = ("loss", *METRICS)

        def sums_of(batch: torch.Tensor) -> torch.Tensor:
            """Each sample's pairs' sums of the metrics, and its pairs."""
            pairs = self._pairs(model, batch, amp)
            values = torch.stack([*(pairs[k] for k in keys), torch.ones_like(pairs["loss"])], 1).double()
            return values.new_zeros(len(batch), len(keys) + 1).index_add_(0, pairs["sample"], values)

        sets = {
            name: held_out_sums(
                model,
                lambda index, name=name: data.eval_batch(name, index),
                windows.count,
                cfg.trainer.micro_batch_size,
                device,
                sums_of,
                cfg.parallel.tp,
            )
            for name, windows in data.eval_sets.items()
        }
        out = {}
        # data.eval_sources: each set's as eval_<metric>/<name> too; eval_<metric> over all of them.
        for name, sums in [(n, s) for n, s in sets.items() if n] + [("", sum(sets.values()))]:
            means = (sums[:-1] / sums[-1]).tolist()
            suffix = f"/{name}" if name else ""
            out.update({f"eval_{k}{suffix}": v for k, v in zip(keys, means)})
            out[f"eval_pairs{suffix}"] = int(sums[-1].item())
        return out
