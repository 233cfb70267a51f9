"""Pipeline parallel (parallel.pp): a Hugging Face model's layers split over stages, a step's micro-batches flowing
through them by one of torch.distributed.pipelining's schedules. Each rank's stage is the family's own model class
with the other stages' parts taken out (names as in the whole model: checkpoints and exports keep their keys); the
family's forward runs it, the hidden states going in as inputs_embeds after the first stage and out as the logits
before the last. Masks and positions are recomputed on every stage from the same keyword arguments (position ids,
as tensors), as the whole model does."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from fsdp_research.distributed.mesh import Mesh
from fsdp_research.distributed.step_layout import Layout
from fsdp_research.errors import ConfigError

# Schedule name -> stages a rank holds: 1, or "looped" (parallel.pp_stages_per_rank), or exactly 2 (a V shape).
SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": "looped",
    "LoopedBFS": "looped",
    "InterleavedZeroBubble": "looped",
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}
# Families whose forward is split-tested (tests/distributed/test_pipeline.py): the base model does nothing to
# inputs_embeds before its layers and the causal LM nothing to the head's output (Gemma scales the embeddings, its
# second version caps the logits: a stage in between would be changed by them).
FAMILIES = ("llama", "qwen2")


@dataclass(frozen=True)
class Parts:
    """Where a family's pipeline parts are: the base model, its embedding, layers and final norm (from the config's
    base_model_pp_plan), the head."""

    base: nn.Module
    embed: str
    layers: str
    norm: str

    @staticmethod
    def of(model: nn.Module) -> "Parts":
        config = model.config
        plan = getattr(config, "base_model_pp_plan", None) or {}
        family = config.model_type
        if family not in FAMILIES or list(plan) != ["embed_tokens", "layers", "norm"]:
            raise ConfigError(
                "parallel.pp", f"{family} is not split-tested for pipeline stages", f"use {' or '.join(FAMILIES)}"
            )
        return Parts(getattr(model, model.base_model_prefix), *plan)


def check_split(model: nn.Module, stages: int) -> None:
    """The whole model (planned, on the meta device) splits into `stages`: a family split-tested, a unit (the
    embedding, a layer, the head: torchtitan counts them so) for each stage at least, no weight shared by two."""
    parts = Parts.of(model)
    units = len(getattr(parts.base, parts.layers)) + 2
    if units < stages:
        raise ConfigError(
            "parallel.pp", f"{stages} stages for {units} layers (the embedding and head counted)", "use fewer stages"
        )


def tied(model: nn.Module) -> bool:
    """Whether the input and output embeddings are one weight (tie_word_embeddings)."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


class HeadPassthrough(nn.Module):
    """The first stage's head where it is tied to the embedding: the shared weight kept under the head's name (as in
    the whole model: checkpoints and the loader see both names), the hidden states passed on untouched."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def unit_range(stage: int, stages: int, units: int) -> range:
    """The units (0: the embedding, 1 .. n: the layers, n + 1: the head) of `stage`, as even as they divide."""
    return range(stage * units // stages, (stage + 1) * units // stages)


class KeptLayers(nn.ModuleDict):
    """A stage's decoder layers under their indices in the whole model, iterated and sliced as the family's forward
    does its nn.ModuleList (`self.layers[: n]`)."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if isinstance(key, slice):
            return list(self.values())[key]
        return super().__getitem__(str(key))


def split_stage(model: nn.Module, stage: int, stages: int) -> None:
    """Take out of `model` (on the meta device, before anything else is applied) what other stages hold: their
    layers, the embedding after the first stage, the final norm and the head before the last. The forward then
    takes the previous stage's hidden states positionally and returns a tensor."""
    check_split(model, stages)
    parts, shared = Parts.of(model), tied(model)
    layers = getattr(parts.base, parts.layers)
    units = unit_range(stage, stages, len(layers) + 2)
    first, last = 0 in units, len(layers) + 1 in units
    setattr(parts.base, parts.layers, KeptLayers({str(u - 1): layers[u - 1] for u in units if 0 < u <= len(layers)}))
    # A tied weight is on the first and the last stage, under both names on each (its gradients summed between
    # them: Pipeline.sync_tied); the last stage's embedding is never called (its input is inputs_embeds).
    if not first and not (shared and last):
        setattr(parts.base, parts.embed, None)
    if not last:
        setattr(parts.base, parts.norm, nn.Identity())
        head = model.get_output_embeddings()
        model.set_output_embeddings(HeadPassthrough(head.weight) if shared and first else nn.Identity())
    key = "input_ids" if first else "inputs_embeds"

    def inputs(module, args, kwargs):
        return (), {**kwargs, key: args[0]} if args else kwargs

    model.register_forward_pre_hook(inputs, with_kwargs=True)
    model.register_forward_hook(lambda module, args, out: out.logits)


LossOf = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
SumsOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Pipeline:
    """This rank's stage of the pipeline and the schedule that runs a step's micro-batches through every stage.
    The loss is the last stage's (its sum over targets weighted as the trainer weights it: the schedule's own
    scaling off); its value and stats go to every stage of the pipeline, so that each rank logs the step's."""

    def __init__(
        self,
        model: nn.Module,
        schedule: str,
        micro_steps: int,
        mesh: DeviceMesh,
        stage_group: dist.ProcessGroup,
        ends: dist.ProcessGroup | None,
        device: torch.device,
    ):
        """`mesh`: the pipeline's (pp); `stage_group`: the ranks of this rank's stage; `ends`: where the embeddings
        are tied, this rank's group with its peer on the other end stage (None elsewhere)."""
        self.group, self.ranks, stage = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.stage, self.stage_group = stage, stage_group
        self.first, self.last = stage == 0, stage == self.ranks - 1
        self.ends, self.shared = ends, model.get_input_embeddings().weight if ends is not None else None
        if self.shared is not None and self.last:  # its gradient counts once in the norm: the first stage's
            self.shared.counted_elsewhere = True
        self.micro_steps = micro_steps
        self._stage = PipelineStage(model, stage, self.ranks, device, group=self.group)
        self._schedule = get_schedule_class(schedule)(
            self._stage, n_microbatches=micro_steps, loss_fn=self._loss, scale_grads=False
        )
        model.pipeline = self  # what eval finds of it (pipeline_of)
        self._loss_of: LossOf | None = None
        self._stats: list[dict[str, torch.Tensor]] = []

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss, stats = self._loss_of(logits, labels)
        self._stats.append(stats)
        return loss

    def run(
        self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, loss_of: LossOf
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """(the step's loss on this rank's micro-batches, each micro-batch's stats), on every stage alike."""
        self._loss_of, self._stats, losses = loss_of, [], []
        args = (inputs,) if self.first else ()
        target = {"target": labels, "losses": losses} if self.last else {}
        # The last stage's logits are not kept: return_outputs off.
        self._schedule.step(*args, **target, **kwargs, return_outputs=False)
        if self.shared is not None:  # the embedding's gradient on the first stage, the head's on the last: the sum
            dist.all_reduce(self.shared.grad.to_local(), group=self.ends)
        # From the CPU: an object broadcast pickles tensors with their device.
        loss_sum = torch.stack(losses).sum().detach().cpu() if self.last else None
        shared = [(loss_sum, [{k: v.cpu() for k, v in s.items()} for s in self._stats])]
        dist.broadcast_object_list(shared, group=self.group, group_src=self.ranks - 1)
        loss_sum, stats = shared[0]
        return loss_sum.to(inputs.device), [{k: v.to(inputs.device) for k, v in s.items()} for s in stats]

    @torch.no_grad()
    def sums(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, of: SumsOf, k: int) -> torch.Tensor:
        """Forwards alone (eval) of a batch of micro_steps micro-batches through every stage: of(logits, labels),
        [samples, k], each micro-batch's on the last stage, float64 on every stage of the pipeline."""
        self._loss_of, losses = (lambda logits, labels: (of(logits, labels), {})), []
        args = (inputs,) if self.first else ()
        target = {"target": labels, "losses": losses} if self.last else {}
        self._schedule.eval(*args, **target, **kwargs, return_outputs=False)
        out = torch.empty(len(inputs), k, dtype=torch.float64, device=inputs.device)
        if self.last:
            out.copy_(torch.cat(losses))
        dist.broadcast(out, group=self.group, group_src=self.ranks - 1)
        return out


def build_pipeline(
    model: nn.Module, whole: nn.Module, schedule: str, lay: Layout, mesh: Mesh, device: torch.device
) -> Pipeline | None:
    """This rank's Pipeline of its stage `model` (parallel.pp > 1; None without); `whole`: the whole model as
    planned, whose tied embeddings every rank sees (a collective: every rank calls it)."""
    if lay.pp == 1:
        return None
    ends = mesh.ends() if tied(whole) else None
    return Pipeline(model, schedule, lay.micro_steps, mesh.pp, mesh.stage_group, ends, device)


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The stage's Pipeline, None without pipeline parallel."""
    return getattr(model, "pipeline", None)
