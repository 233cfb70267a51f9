"""What the preference objectives (objective=dpo, simpo) share: a pair's sums over its two documents of packed
preference samples (data.packing.PairWindows), the pairs as the step's targets (its loss the mean over the step's
pairs on every rank and micro-batch, so 1 rank = N ranks), TRL's metrics (rewards/chosen, rewards/rejected,
rewards/accuracies, rewards/margins, logps/chosen, logps/rejected: summed over pairs in a step's stats, logged as
means over them), and eval over the eval pairs, eval_-prefixed as TRL's evaluate names them."""

import functools
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.config.data_schema import DataKind
from fsdp_research.data.chat import unpaired_examples
from fsdp_research.data.packing import DOCUMENTS, IGNORE, LABELS, POSITIONS
from fsdp_research.data.pipeline import Data
from fsdp_research.errors import ConfigError
from fsdp_research.model.dimensions import expert_modules
from fsdp_research.objectives.base import Objective, StepContext
from fsdp_research.train.evaluation import held_out_sums
from fsdp_research.train.losses import token_losses

log = logging.getLogger("fsdp_research")

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


def pair_documents(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's chosen and rejected document, as its store's index ([n, seq_len // 2] each, as pair_sums's; -1
    where a sample holds no pair)."""
    document = (batch[:, POSITIONS] == 0).cumsum(1) - 1
    docs = torch.full_like(batch[:, DOCUMENTS], -1).scatter_reduce_(1, document, batch[:, DOCUMENTS], "amax")
    pairs = batch.shape[-1] // 2
    return docs[:, 0 : 2 * pairs : 2], docs[:, 1 : 2 * pairs : 2]


def pair_logps(model: nn.Module, batch: torch.Tensor, amp) -> tuple[torch.Tensor, ...]:
    """(chosen's and rejected's log-probabilities summed over their completions, their completions' tokens: [pairs]
    each, in order; where the pairs are in the samples: [n, seq_len // 2])."""
    chosen, rejected, n_chosen, n_rejected, real = pair_sums(-token_losses(model, batch, amp), batch)
    return chosen[real], rejected[real], n_chosen[real], n_rejected[real], real


def pair_result(loss: torch.Tensor, rewards: tuple, logps: tuple, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """What PairObjective.pairs returns, of each pair's loss, (chosen's, rejected's) rewards and logps."""
    chosen, rejected = (r.detach() for r in rewards)
    metrics = (chosen, rejected, (chosen > rejected).float(), chosen - rejected, *(x.detach() for x in logps))
    return {"loss": loss, **dict(zip(METRICS, metrics)), "sample": real.nonzero()[:, 0]}


def _no_dropout(model: nn.Module, objective: str) -> None:
    """Dropout off, as TRL's disable_dropout (its default): the policy's log-probabilities, and with LoRA the
    reference's (the same model, in train mode), are then those of the model itself, not of a random sub-network."""
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    for module in dropouts:
        module.p = 0.0
    if dropouts:
        log.info(
            f"objective={objective}: dropout off in {len(dropouts)} module(s), as TRL's trainers (disable_dropout)"
        )


class PairObjective(Objective):
    """What the preference objectives share: pairs as the targets, TRL's metrics (summed over pairs, logged as
    means over the step's), and eval over the eval pairs. A subclass says each pair's loss and metrics (`pairs`)."""

    reads = (DataKind.preference,)
    takes_packed = True
    # While evaluate runs: the eval set's name (data.eval_sources'; "": data.eval_paths' or the held-out windows).
    evaluating: str | None = None

    # Whether it reads unpaired examples (KTO's {prompt, completion, label}) rather than pairs.
    unpaired = False

    def check(self, cfg: DictConfig) -> None:
        if unpaired_examples(cfg.data) != self.unpaired:
            name, wants = cfg.objective.name, "unpaired examples" if self.unpaired else "pairs"
            has = "unpaired examples ({prompt, completion, label})" if not self.unpaired else "pairs"
            other = "objective=dpo or simpo" if not self.unpaired else "objective=kto"
            raise ConfigError("data.paths", f"objective={name} reads {wants}; the data holds {has}", f"use {other}")

    def setup(self, cfg: DictConfig) -> None:
        self.cfg = cfg

    def prepare(self, model: nn.Module, device: torch.device, data: Data) -> None:
        if expert_modules(model):
            name = self.cfg.objective.name
            raise ConfigError(
                "objective", f"{name} leaves a mixture of experts' load-balancing loss out", "use a dense model"
            )
        _no_dropout(model, self.cfg.objective.name)

    def pairs(self, model: nn.Module, batch: torch.Tensor, amp) -> dict[str, torch.Tensor]:
        """Of this micro-batch's pairs, [pairs] each: their "loss", the sample each is in ("sample"), and each of
        `metric_names`' values; a metric is the mean over the pairs weighted by "<name>:weight" where that is given
        (KTO's rewards/chosen: over the desirable examples), else over all."""
        raise NotImplementedError

    metric_names: tuple[str, ...] = METRICS

    @staticmethod
    def data_sets(data: Data) -> dict:
        """The windows a run reads, by set: the training data's (None) and each eval set's (by name)."""
        return {None: data.stream.windows[0], **data.eval_sets}

    def reading(self, by_set: dict):
        """by_set's entry (keyed as data_sets) of the data read now: the eval set being evaluated, else the training
        data's (the held-out windows are the training store's too)."""
        return by_set.get(self.evaluating, by_set[None])

    def derived(self, means: dict[str, float]) -> dict[str, float]:
        """The logged metrics of the means (KTO's margins: a difference of two)."""
        return means

    def before_eval_set(self, model: nn.Module, read, samples: int, micro_batch: int, device: torch.device, amp):
        """Before an eval set's pass (KTO: its KL estimate over the set); a collective."""

    def targets(self, batch: torch.Tensor) -> torch.Tensor:
        return pair_sums(batch[:, LABELS].float(), batch)[-1].sum(1)

    def _weighted(self, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[pairs, 2 x metrics]: each metric's weighted value and its weight."""
        weights = [pairs.get(f"{k}:weight", torch.ones_like(pairs["loss"])).detach() for k in self.metric_names]
        values = [pairs[k].detach() * w for k, w in zip(self.metric_names, weights)]
        return torch.stack([*values, *weights], 1).double()

    def _means(self, sums: torch.Tensor) -> dict[str, float]:
        """The metrics of [2 x metrics] summed weighted values and weights: those with no weight left out."""
        n = len(self.metric_names)
        means = {k: (v / w).item() for k, v, w in zip(self.metric_names, sums[:n], sums[n:]) if w > 0}
        return self.derived(means)

    def loss(self, model: nn.Module, batch: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, dict]:
        pairs = self.pairs(model, batch, ctx.amp)
        return pairs["loss"].sum() * ctx.weight, {"metric sums": self._weighted(pairs).sum(0)}

    def metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        # Sums and weights alike: the tp ranks of a group, which hold the same pairs, count in both.
        sums = stats["metric sums"].clone()
        dist.all_reduce(sums)
        return {"targets": round(stats["targets"].item()), **self._means(sums)}

    def evaluate(self, model: nn.Module, data: Data, cfg: DictConfig, device: torch.device, amp) -> dict[str, float]:
        """eval_loss and TRL's metrics, eval_-prefixed: means over the eval pairs (data.eval_paths or eval_sources,
        read whole; else the held-out windows of pairs)."""

        def sums_of(batch: torch.Tensor) -> torch.Tensor:
            """Each sample's pairs' loss, weighted metrics and weights, and its pairs."""
            pairs = self.pairs(model, batch, amp)
            values = torch.cat([pairs["loss"].detach().double()[:, None], self._weighted(pairs)], 1)
            values = torch.cat([values, torch.ones_like(values[:, :1])], 1)
            return values.new_zeros(len(batch), values.shape[1]).index_add_(0, pairs["sample"], values)

        t = cfg.trainer
        if data.eval_sets:
            reads = {name: (functools.partial(data.eval_batch, name), w.count) for name, w in data.eval_sets.items()}
        else:  # the held-out windows of pairs, as objective=lm evaluates
            reads = {"": (functools.partial(data.batch, held_out=True), t.eval_batches * t.micro_batch_size)}
        sets = {}
        try:
            for name, (read, n) in reads.items():
                self.evaluating = name
                self.before_eval_set(model, read, n, t.micro_batch_size, device, amp)
                sets[name] = held_out_sums(model, read, n, t.micro_batch_size, device, sums_of, cfg.parallel.tp)
        finally:
            self.evaluating = None
        out = {}
        # data.eval_sources: each set's as eval_<metric>/<name> too; eval_<metric> over all of them.
        for name, sums in [(n, s) for n, s in sets.items() if n] + [("", sum(sets.values()))]:
            suffix = f"/{name}" if name else ""
            means = {"loss": (sums[0] / sums[-1]).item(), **self._means(sums[1:-1])}
            out.update({f"eval_{k}{suffix}": v for k, v in means.items()})
            out[f"eval_pairs{suffix}"] = int(sums[-1].item())
        return out
