"""objective=kto: KTO on unpaired examples (data=preference of {prompt, completion, label}), as TRL's KTOTrainer
computes it: each example's log-probability ratio of policy to reference (summed over its completion) against a KL
estimate, the mean over the step's examples (every rank's and micro-batch's: the same at any world size; at eval,
over the eval set) of their KL documents' ratios (the prompt with another example's completion, data.kl_chunk),
clamped at 0, without gradient. A desirable example's loss is desirable_weight x (1 - sigmoid(beta (ratio - KL))),
an undesirable one's undesirable_weight x (1 - sigmoid(beta (KL - ratio))); the step's loss their mean. Metrics with
TRL's names: kl, rewards/chosen and logps/chosen over the desirable examples, rewards/rejected and logps/rejected
over the undesirable ones, rewards/margins the difference of the two rewards. The reference as objective=dpo's."""

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.data.pipeline import Data
from fsdp_research.errors import ConfigError
from fsdp_research.objectives.dpo import DPO
from fsdp_research.objectives.pairs import pair_documents, pair_logps
from fsdp_research.train.evaluation import held_out_sums


class KTO(DPO):
    unpaired = True
    metric_names = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        reference: str = "auto",
    ):
        super().__init__(beta=beta, reference=reference)
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def check(self, cfg: DictConfig) -> None:
        super().check(cfg)
        weights = {"desirable_weight": self.desirable_weight, "undesirable_weight": self.undesirable_weight}
        for key, weight in weights.items():
            if weight < 0:
                raise ConfigError(f"objective.{key}", f"{weight} is negative", "use e.g. 1.0")
        if cfg.data.kl_chunk < 2:
            what = f"{cfg.data.kl_chunk}: an example would be its own KL pair"
            raise ConfigError("data.kl_chunk", what, "use 2 or more")

    def prepare(self, model: nn.Module, device: torch.device, data: Data) -> None:
        super().prepare(model, device, data)
        sets = self.data_sets(data).items()
        self.labels = {name: torch.from_numpy(w.store.labels()).to(device) for name, w in sets}

    def _kl_sums(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """[samples, 2]: each sample's KL documents' log-probability ratios, summed, and their number."""
        with torch.no_grad():
            _, kl, _, _, real = pair_logps(model, batch, self.amp)
            ratios = kl - self.reference_logps(model, batch, self.amp, real)[1]
        sample = real.nonzero()[:, 0]
        sums = torch.zeros(len(batch), 2, dtype=torch.float64, device=batch.device)
        return sums.index_add_(0, sample, torch.stack([ratios.double(), torch.ones_like(ratios).double()], 1))

    def _set_kl(self, sums: torch.Tensor) -> None:
        """The KL estimate of summed ratios and counts over every rank (the tp ranks of a group count in both)."""
        self.kl = (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()

    def step_batch(self, model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        """The step's KL estimate first, over all of its examples (a collective); the batch as it is."""
        sums = sum(self._kl_sums(model, micro).sum(0) for micro in batch.split(self.cfg.trainer.micro_batch_size))
        dist.all_reduce(sums)
        self._set_kl(sums)
        return batch

    def before_eval_set(self, model: nn.Module, read, samples: int, micro_batch: int, device: torch.device, amp):
        sums_of = lambda batch: self._kl_sums(model, batch)  # noqa: E731
        self._set_kl(held_out_sums(model, read, samples, micro_batch, device, sums_of, self.cfg.parallel.tp))

    def pairs(self, model: nn.Module, batch: torch.Tensor, amp) -> dict[str, torch.Tensor]:
        logps, _, _, _, real = pair_logps(model, batch, amp)
        ratios = logps - self.reference_logps(model, batch, amp, real)[0]
        desirable = self.reading(self.labels)[pair_documents(batch)[0][real]] == 1
        b, kl = self.beta, self.kl
        loss = torch.where(
            desirable,
            self.desirable_weight * (1 - torch.sigmoid(b * (ratios - kl))),
            self.undesirable_weight * (1 - torch.sigmoid(b * (kl - ratios))),
        )
        rewards, chosen, rejected = b * ratios, desirable.float(), (~desirable).float()
        return {
            "loss": loss,
            "sample": real.nonzero()[:, 0],
            "kl": kl.expand_as(loss),
            "rewards/chosen": rewards,
            "rewards/chosen:weight": chosen,
            "rewards/rejected": rewards,
            "rewards/rejected:weight": rejected,
            "logps/chosen": logps,
            "logps/chosen:weight": chosen,
            "logps/rejected": logps,
            "logps/rejected:weight": rejected,
        }

    def derived(self, means: dict[str, float]) -> dict[str, float]:
        if "rewards/chosen" in means and "rewards/rejected" in means:
            means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        return means
