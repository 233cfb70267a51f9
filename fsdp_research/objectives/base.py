"""What the trainer asks of an objective, and how one is built from the config (objective._target_ and its keyword
arguments) and checked before any compute."""

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.callbacks.footprint import PlannedGeneration
from fsdp_research.config.data_schema import DataKind
from fsdp_research.config.plugin_schema import LossConfig
from fsdp_research.config.targets import check_call, kwargs_of, resolve
from fsdp_research.data.pipeline import Data, packed
from fsdp_research.distributed.context_parallel import ContextSplit
from fsdp_research.errors import ConfigError
from fsdp_research.metrics.meters import loss_metrics
from fsdp_research.train.evaluation import evaluate
from fsdp_research.train.losses import Router, target_count

# The group's own keys: the others are the target's keyword arguments.
_OWN = ("name",)


@dataclass(frozen=True)
class StepContext:
    """What the trainer hands an objective with each micro-batch."""

    # The forward runs inside it: autocast under the classic DDP baseline, a null context under FSDP.
    amp: AbstractContextManager
    # Context parallel: this rank's chunks of each sequence (train.losses.model_inputs cuts them); None without.
    split: ContextSplit | None
    # A mixture of experts' routing (its load-balancing loss goes into the loss); None for a dense model.
    router: Router | None
    # What the micro-batch's loss sum is multiplied by: the ranks gradients are averaged over (data-parallel, cp's
    # included) x micro-batches / the step's targets (Objective.targets, summed over every rank); None where
    # targets() said None.
    weight: torch.Tensor | None


class Objective:
    """Subclass it and name it in objective._target_ (its other keys are the constructor's keyword arguments). Every
    rank calls each method; a step's batch is this rank's, [samples, ...] as the data gives it (text windows of
    seq_len + 1 tokens; packed chat samples [n, 3, seq_len])."""

    # The data kinds (data=...) it reads: anything else is refused before any compute. Preference pairs only where
    # an objective says so: two documents a pair, which a per-token loss would take as any two; prompts alone only
    # where it generates their completions.
    reads: tuple[DataKind, ...] = tuple(k for k in DataKind if k not in (DataKind.preference, DataKind.prompts))
    # Whether its loss takes context parallel's chunks of each sequence (ctx.split); without, parallel.cp > 1 is
    # refused.
    splits_sequences: bool = False
    # Whether it reads the loss group (objective=lm's settings); without, a loss group other than the default is
    # refused: it would change nothing.
    uses_loss_group: bool = False
    # Whether it takes packed samples ([n, 3, seq_len]: chat data, text with data.document_masking); without, they
    # are refused.
    takes_packed: bool = False

    # Whether its loss is the head's logits against the labels alone (logits_loss): pipeline parallel (parallel.pp)
    # computes it on the last stage; without, pp > 1 is refused.
    pipelines: bool = False

    # Steps each batch of the data is trained on (GRPO's num_iterations: its rollouts trained on again): step s
    # reads new samples where s is a multiple of it, the steps between get the batch it read.
    iterations: int = 1

    # Forwards with no gradient of the model (or a copy of it) a step runs over its tokens besides its own forward
    # and backward, on average (DPO's reference; GRPO's reference and old policy, once a rollout batch): throughput's
    # MFU counts them.
    reference_forwards: float = 0

    def check(self, cfg: DictConfig) -> None:
        """What it refuses of the run's typed config, before any compute (its constructor does no more than keep its
        arguments: it is called then too)."""

    @classmethod
    def planned_sequence(cls, seq_len: int, **_) -> tuple[int, int, int | None]:
        """What the planner counts of a trained sequence for data.seq_len (called on the class, with the objective's
        config keys): (its tokens, the positions the loss takes logits of, the fp32 tensors of the logits' shape its
        loss holds at the end of forward besides the logits; None: cross entropy's)."""
        return seq_len, seq_len, None

    @classmethod
    def planned_generation(cls, **_) -> PlannedGeneration | None:
        """What it holds while it generates, for the planner (as planned_sequence); None: it generates nothing."""
        return None

    def setup(self, cfg: DictConfig) -> None:
        """Once on every rank before the first step, with the run's typed config."""

    def prepare(self, model: nn.Module, device: torch.device, data: Data) -> None:
        """Once on every rank after setup, with the sharded model and the run's data (a collective where it builds
        a model of its own or computes over the data)."""

    def samples_per_step(self, global_batch_size: int) -> int:
        """How many of the data's samples a step reads (the run's position in the data goes on by as many): the
        global batch's; fewer where each makes several sequences (GRPO: a prompt's num_generations completions)."""
        return global_batch_size

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of it besides the model (GRPO's rollouts, trained on again after a resume): the
        same tensors on every rank (written once); {} for none."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None, step: int) -> None:
        """A resume at step `step`: what state_dict() gave when it was saved (tensors shaped as its state_dict()
        now), None where the checkpoint has none (saved by another objective or setting)."""

    def step_batch(self, model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        """The batch step `step` trains on, from this rank's batch of the data: the data's own by default. One that
        makes its own (online RL: rollouts generated from the data's prompts, several updates per rollout batch)
        returns it here."""
        return batch

    def trained_tokens(self, batch: torch.Tensor) -> torch.Tensor | None:
        """This rank's tokens of the step's batch, for throughput, where its samples' positions are not them (GRPO:
        the prompts' and completions' own); None: the trainer counts them (packed samples' tokens, else every
        position)."""
        return None

    def targets(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Each sample's targets in the step's batch: the trainer weights every micro-batch's loss sum so that the
        step's loss is the mean over all of them, at any number of ranks (StepContext.weight). None: each
        micro-batch's loss is already a mean over as many targets as every other's."""
        return target_count(batch)

    def loss(self, model: nn.Module, batch: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, dict]:
        """(the micro-batch's loss: its sum over targets times ctx.weight, or its mean where targets() is None; the
        stats to log, {name: tensor}, their mean over micro-batches logged where the name is in MEAN_LOSSES)."""
        raise NotImplementedError

    def logits_loss(
        self, logits: torch.Tensor, labels: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """With `pipelines`: a micro-batch's loss and stats as loss() returns them, from the last stage's logits
        [n, seq, vocab] and the labels [n, seq] (train.losses.model_inputs')."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, data: Data, cfg: DictConfig, device: torch.device, amp) -> dict[str, float]:
        """The eval metrics (a collective): by default the next-token loss over the held-out data."""
        return evaluate(model, data, cfg, device, amp)

    def shown(self) -> list[dict[str, str]]:
        """Rows {prompt, completion} a logged step shows beside its metrics, as trainer.sample_prompts' are (GRPO:
        some of its completions); none by default."""
        return []

    def metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """What a logged step shows of its stats (each micro-batch's loss() stats summed, MEAN_LOSSES averaged, and
        "targets": the step's, summed over ranks): a collective, every rank the same keys."""
        return loss_metrics(stats)


def _target(cfg: DictConfig) -> tuple[type, dict]:
    target = resolve(cfg._target_, "objective._target_")
    if not (isinstance(target, type) and issubclass(target, Objective)):
        raise ConfigError(
            "objective._target_",
            f"{cfg._target_} is not a subclass of fsdp_research.objectives.Objective",
            "subclass it (docs/extending.md)",
        )
    kwargs = kwargs_of(cfg, _OWN)
    check_call(target, kwargs, "objective._target_")
    return target, kwargs


def check_objective(cfg: DictConfig) -> None:
    """The objective imports, takes its keyword arguments, and reads the run's data: refused before any compute."""
    target, kwargs = _target(cfg.objective)
    target(**kwargs).check(cfg)
    name = f"objective {target.__qualname__}"
    if cfg.data.kind not in target.reads:
        raise ConfigError(
            "data",
            f"{cfg.data.kind.value} is not what {name} reads",
            f"use one of data={', '.join(k.value for k in target.reads)}",
        )
    if packed(cfg.data) and not target.takes_packed:
        key = "data" if cfg.data.kind is DataKind.chat else "data.document_masking"
        raise ConfigError(key, f"makes packed samples, which {name} does not take", "use windows of tokens")
    if not target.uses_loss_group and cfg.loss != LossConfig():
        raise ConfigError("loss", f"{name} does not read it (objective=lm does)", "drop the loss overrides")
    if cfg.parallel.pp > 1 and not target.pipelines:
        raise ConfigError(
            "parallel.pp", f"{cfg.parallel.pp}: {name} has no loss from the last stage's logits", "use parallel.pp=1"
        )
    if cfg.parallel.cp > 1 and not target.splits_sequences:
        raise ConfigError(
            "parallel.cp",
            f"{cfg.parallel.cp}: {name} does not take context parallel's chunks of sequences",
            "use parallel.cp=1",
        )


def build_objective(cfg: DictConfig, model: nn.Module, device: torch.device, data: Data) -> Objective:
    target, kwargs = _target(cfg.objective)
    objective = target(**kwargs)
    objective.setup(cfg)
    objective.prepare(model, device, data)
    return objective
