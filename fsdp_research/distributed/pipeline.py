"""Pipeline parallel (parallel.pp): a Hugging Face model's layers split over stages, a step's micro-batches flowing
through them by one of torch.distributed.pipelining's schedules. Each rank's stage is the family's own model class
with the other stages' parts taken out (names as in the whole model: checkpoints and exports keep their keys); the
family's forward runs it, the hidden states going in as inputs_embeds after the first stage and out as the logits
before the last. Masks and positions are recomputed on every stage from the same keyword arguments (position ids,
as tensors), as the whole model does."""

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from fsdp_research.distributed.mesh import Mesh
from fsdp_research.distributed.sharding import fsdp_groups, kept_gathered
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
# Their weight-gradient pass (torch's stage_backward_weight) runs after the input-gradient pass, apart from autograd's
# hooks: FSDP's reduction is deferred to the step's end (deferred_reduction).
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def zero_bubble(parallel) -> bool:
    """Whether the parallel section's pipeline runs a zero-bubble schedule."""
    return parallel.pp > 1 and parallel.pp_schedule in ZERO_BUBBLE


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
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", type(model).__name__)
        if not split_tested(config):
            raise ConfigError(
                "parallel.pp", f"{family} is not split-tested for pipeline stages", f"use {' or '.join(FAMILIES)}"
            )
        return Parts(getattr(model, model.base_model_prefix), *config.base_model_pp_plan)


def check_split(model: nn.Module, parallel) -> list[range]:
    """Each stage's units (0: the embedding, 1 .. n: the layers, n + 1: the head) of the whole model (planned,
    on the meta device) split into the parallel section's stages: a family split-tested, a unit (torchtitan counts
    them so) for each stage at least and a layer for each rank; as evenly as they divide, or where the split points'
    layers begin (parallel.pp_split_points)."""
    stages, points = stages_of(0, parallel)[1], parallel.pp_split_points
    parts = Parts.of(model)
    n = len(getattr(parts.base, parts.layers))
    if n + 2 < stages:
        raise ConfigError(
            "parallel.pp", f"{stages} stages for {n + 2} layers (the embedding and head counted)", "use fewer stages"
        )
    # The family's forward picks each layer's mask by its place in the loop (config.layer_types[i]), which restarts
    # on every stage.
    if len(set(getattr(model.config, "layer_types", None) or [])) > 1:
        raise ConfigError(
            "parallel.pp",
            f"layers of several attention types ({', '.join(sorted(set(model.config.layer_types)))}) are not split "
            "across stages yet",
            "use parallel.pp=1, or one attention type (e.g. use_sliding_window=false)",
        )
    if not points:
        starts = [s * (n + 2) // stages for s in range(stages)]
    else:
        layer = re.compile(rf"(?:.+\.)?{re.escape(parts.layers)}\.(\d+)")
        found = [layer.fullmatch(p) for p in points]
        starts = [0] + [int(f.group(1)) + 1 for f in found if f and int(f.group(1)) < n]
        if len(points) != stages - 1 or len(starts) != stages or starts != sorted(set(starts)):
            raise ConfigError(
                "parallel.pp_split_points",
                f"{list(points)} are not {stages - 1} of the model's layers in order ({parts.layers}.0 .. {n - 1})",
                f"give where each stage after the first begins, e.g. [{parts.layers}.{n // stages}]",
            )
    units = [range(a, b) for a, b in zip(starts, [*starts[1:], n + 2])]
    # A rank of the embedding or the head alone has no block to shard or checkpoint.
    for rank in range(parallel.pp):
        if not any(0 < u <= n for s in stages_of(rank, parallel)[0] for u in units[s]):
            key = "parallel.pp_split_points" if points else "parallel.pp"
            raise ConfigError(key, f"pipeline rank {rank} would hold none of the {n} layers", "give each rank a layer")
    return units


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


def split_tested(config) -> bool:
    """Whether a family's model (by its config) splits into stages as tested: FAMILIES, by base_model_pp_plan."""
    plan = getattr(config, "base_model_pp_plan", None) or {}
    return getattr(config, "model_type", None) in FAMILIES and list(plan) == ["embed_tokens", "layers", "norm"]


class KeptLayers(nn.ModuleDict):
    """A rank's decoder layers under their indices in the whole model, iterated and sliced as the family's forward
    does its nn.ModuleList (`self.layers[: n]`): those of the stage running (`active`), by default all."""

    active: list[str] | None = None

    def _running(self) -> list[nn.Module]:
        return [self[k] for k in self.active] if self.active is not None else list(self.values())

    def __iter__(self):
        return iter(self._running())

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._running()[key]
        return super().__getitem__(str(key))


@dataclass(frozen=True)
class Role:
    """What one stage runs of the rank's model: its layers (by whole-model index), whether it embeds the input ids
    (the first stage) and applies the final norm and head (the last)."""

    layers: list[str]
    first: bool
    last: bool


def stages_of(pp_rank: int, parallel) -> tuple[list[int], int]:
    """(the stages the pipeline's rank pp_rank holds, the stages) of the parallel section: one; a loop (r, r + pp,
    ...: parallel.pp_stages_per_rank); a V (r and 2 pp - 1 - r)."""
    pp, per_rank = parallel.pp, parallel.pp_stages_per_rank
    if SCHEDULES[parallel.pp_schedule] == 2:
        return [pp_rank, 2 * pp - 1 - pp_rank], 2 * pp
    return [pp_rank + i * pp for i in range(per_rank)], pp * per_rank


def _passing(module: nn.Module, on: bool) -> None:
    """The module's forward as the identity (`on`), or its own again."""
    if on:
        module.forward = lambda hidden, *args, **kwargs: hidden
    else:
        module.__dict__.pop("forward", None)


def split_stages(model: nn.Module, parallel, pp_rank: int) -> None:
    """Take out of `model` (on the meta device, before anything else is applied) what other ranks' stages hold:
    their layers, the embedding where no held stage is the first, the final norm and the head where none is the
    last. The forward then takes the previous stage's hidden states positionally and returns a tensor; with several
    stages on the rank, the keyword argument pp_stage says which one runs (StageView)."""
    units_of, held = check_split(model, parallel), stages_of(pp_rank, parallel)[0]
    parts, shared = Parts.of(model), tied(model)
    layers = getattr(parts.base, parts.layers)
    n = len(layers)
    roles = {}
    for stage in held:
        units = units_of[stage]
        roles[stage] = Role([str(u - 1) for u in units if 0 < u <= n], 0 in units, n + 1 in units)
    first, last = any(r.first for r in roles.values()), any(r.last for r in roles.values())
    kept = KeptLayers({k: layers[int(k)] for k in sorted({k for r in roles.values() for k in r.layers}, key=int)})
    setattr(parts.base, parts.layers, kept)
    # A tied weight is on the first and the last stage, under both names on each (its gradients summed between
    # them: Pipeline.run); the last stage's embedding is never called (its input is inputs_embeds).
    if not first and not (shared and last):
        setattr(parts.base, parts.embed, None)
    if not last:
        setattr(parts.base, parts.norm, nn.Identity())
        head = model.get_output_embeddings()
        model.set_output_embeddings(HeadPassthrough(head.weight) if shared and first else nn.Identity())
    norm, head = getattr(parts.base, parts.norm), model.get_output_embeddings()

    def inputs(module, args, kwargs):
        kwargs = dict(kwargs)
        role = roles[kwargs.pop("pp_stage", held[0])]
        kept.active = role.layers
        if last:  # a stage before the last on the rank that holds the last: its norm and head pass through
            _passing(norm, not role.last)
            _passing(head, not role.last)
        return (), {**kwargs, "input_ids" if role.first else "inputs_embeds": args[0]} if args else kwargs

    model.register_forward_pre_hook(inputs, with_kwargs=True)
    # A stage before the last returns the hidden states as sliced by the family's head (a view): the zero-bubble
    # schedules detach a stage's output in place (copied for them alone).
    copied = zero_bubble(parallel)
    model.register_forward_hook(
        lambda module, args, out: out.logits.clone() if copied and out.logits._is_view() else out.logits
    )


class StageView(nn.Module):
    """One of a rank's stages, for torch's PipelineStage: the rank's model (not a submodule of the view: the
    parameters stay the model's alone) run as that stage."""

    def __init__(self, model: nn.Module, stage: int):
        super().__init__()
        object.__setattr__(self, "model", model)
        self.stage = stage

    def forward(self, *args, **kwargs):
        return self.model(*args, pp_stage=self.stage, **kwargs)

    def parameters(self, recurse: bool = True):
        """The rank's model's (the zero-bubble schedules' weight pass finds the stage's own among them by its
        graph; without it they would get none)."""
        return self.model.parameters(recurse)


@contextlib.contextmanager
def deferred_reduction(model: FSDPModule) -> Iterator[None]:
    """What torch's PipelineStage does for a stage that is an FSDP module, for the rank's model as a whole: over
    the step every unit keeps its parameters gathered (the weight pass's parameters are the ones the input pass found)
    and its gradients unsharded; then reduced and sharded again (torch's perform_reduce_grad)."""
    state = model._get_fsdp_state()
    state._lazy_init()  # kept_gathered keeps the root's settings as they are after it
    with kept_gathered(model):
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_reshard_after_backward(True)
            model.set_requires_gradient_sync(True)
        for group in fsdp_groups(model):
            group.post_backward()
        state._root_post_backward_final_callback()


class WeightPassStage(PipelineStage):
    """torch's stage, whose weight pass (the zero-bubble schedules', after FSDP's post-backward has run) moves the
    gradients it wrote into FSDP's accumulator of the reduce dtype, as that post-backward does: micro-batches summed
    in fp32 under bf16 parameters, not in bf16."""

    def __init__(self, *args, params: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.params = params

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False):
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        for param in self.params:
            param.accumulate_unsharded_grad_if_needed()
            param.to_accumulated_grad_if_needed()


LossOf = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
SumsOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Pipeline:
    """This rank's stage of the pipeline and the schedule that runs a step's micro-batches through every stage.
    The loss is the last stage's (its sum over targets weighted as the trainer weights it: the schedule's own
    scaling off); its value and stats go to every stage of the pipeline, so that each rank logs the step's."""

    def __init__(
        self,
        model: nn.Module,
        parallel,
        micro_steps: int,
        mesh: DeviceMesh,
        stage_group: dist.ProcessGroup,
        ends: dist.ProcessGroup | None,
        device: torch.device,
    ):
        """`parallel`: the config's section; `mesh`: the pipeline's (pp); `stage_group`: the ranks holding this
        rank's stages; `ends`: where the embeddings are tied and the first and last stage are on two ranks, this
        rank's group with its peer on the other (None elsewhere)."""
        self.group, self.ranks, self.stage = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.stage_group, self.micro_steps = stage_group, micro_steps
        held, stages = stages_of(self.stage, parallel)
        self.first, self.last = 0 in held, stages - 1 in held
        # The rank that holds the last stage (a V puts it on the first rank): it sends the loss and stats.
        self.src = next(r for r in range(self.ranks) if stages - 1 in stages_of(r, parallel)[0])
        self.ends, self.shared = ends, model.get_input_embeddings().weight if ends is not None else None
        if self.shared is not None and self.last:  # its gradient counts once in the norm: the first stage's
            self.shared.counted_elsewhere = True
        # One stage: the model itself (an FSDP module: the schedule reduces its gradients after the last
        # micro-batch); several: a view of it for each.
        parts = [model] if len(held) == 1 else [StageView(model, i) for i in held]
        params = [p for g in fsdp_groups(model) for p in g.fsdp_params]
        built = [WeightPassStage(p, i, stages, device, group=self.group, params=params) for p, i in zip(parts, held)]
        schedule = get_schedule_class(parallel.pp_schedule)
        self._schedule = schedule(
            built if SCHEDULES[parallel.pp_schedule] != 1 else built[0],
            n_microbatches=micro_steps,
            loss_fn=self._loss,
            scale_grads=False,
        )
        model.pipeline = self  # what eval finds of it (pipeline_of)
        self._model, self.zero_bubble = model, zero_bubble(parallel)
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
        with deferred_reduction(self._model) if self.zero_bubble else contextlib.nullcontext():
            self._schedule.step(*args, **target, **kwargs, return_outputs=False)
        if self.shared is not None:  # the embedding's gradient on the first stage, the head's on the last: the sum
            dist.all_reduce(self.shared.grad.to_local(), group=self.ends)
        # torch calls the loss once more before a step's micro-batches, to learn its shapes (the first step's, and
        # the first after an eval): only the micro-batches' stats.
        self._stats = self._stats[-self.micro_steps :]
        # From the CPU: an object broadcast pickles tensors with their device.
        loss_sum = torch.stack(losses).sum().detach().cpu() if self.last else None
        shared = [(loss_sum, [{k: v.cpu() for k, v in s.items()} for s in self._stats])]
        dist.broadcast_object_list(shared, group=self.group, group_src=self.src)
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
        dist.broadcast(out, group=self.group, group_src=self.src)
        return out


def build_pipeline(
    model: nn.Module, whole: nn.Module, parallel, lay: Layout, mesh: Mesh, device: torch.device
) -> Pipeline | None:
    """This rank's Pipeline of its stages' `model` (parallel.pp > 1; None without); `whole`: the whole model as
    planned, whose tied embeddings every rank sees (a collective: every rank calls it)."""
    if lay.pp == 1:
        return None
    # A V holds the first and the last stage on one rank: its tied weight is one parameter there.
    ends = mesh.ends() if tied(whole) and SCHEDULES[parallel.pp_schedule] != 2 else None
    return Pipeline(model, parallel, lay.micro_steps, mesh.pp, mesh.stage_group, ends, device)


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The stage's Pipeline, None without pipeline parallel."""
    return getattr(model, "pipeline", None)
