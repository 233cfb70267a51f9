"""The run's settings as one rank sees its step (world size, dtypes, batch, the parallel axes, the pipeline's
schedule): with fsdp_research.planner.summary's ModelSummary, what the planner's every figure is a function of."""

from dataclasses import dataclass

from omegaconf import DictConfig

from fsdp_research.callbacks.footprint import Declared, PlannedGeneration, declared_state
from fsdp_research.config.targets import kwargs_of, resolve
from fsdp_research.distributed.pipeline import stages_of, zero_bubble
from fsdp_research.distributed.precision import dtypes
from fsdp_research.distributed.step_layout import layout
from fsdp_research.planner.pipeline import pipeline_shape


@dataclass(frozen=True)
class Run:
    world_size: int
    # precision.param_dtype and reduce_dtype, as named in the config.
    compute_dtype: str
    reduce_dtype: str
    shard_group: int
    replicas: int
    compute_bytes: int
    reduce_bytes: int
    micro_batch: int
    seq_len: int
    micro_steps: int
    defer_grad_sync: bool
    cpu_offload: bool
    # AdamW's foreach implementation (CUDA) instead of the per-tensor loop (CPU).
    foreach: bool
    # Blocks all-gathered ahead (sharding.prefetch_forward / prefetch_backward; 0: FSDP2's implicit).
    prefetch_forward: int = 0
    prefetch_backward: int = 0
    # loss.chunks: the logits exist a 1/chunks slice at a time.
    loss_chunks: int = 1
    # The callbacks' declared state (fsdp_research.callbacks.footprint), by name.
    callbacks: Declared = ()
    # On CUDA each process group is an NCCL communicator with buffers of its own on the device.
    nccl: bool = False
    # Tensor-parallel ranks (the data-parallel ranks are world_size / pp / tp / cp).
    tp: int = 1
    # Context-parallel ranks: each holds 1/cp of a sequence's tokens (attention: 1/cp of the heads, all tokens).
    cp: int = 1
    # Pipeline ranks (this Run is of one's): the most activations its stages hold at once, in micro-batches' worth
    # of all its layers; the most micro-batches whose loss the last stage holds at once; the share of the step it
    # waits (fsdp_research.planner.pipeline).
    pp: int = 1
    in_flight: float = 1.0
    losses: int = 1
    bubble: float = 0.0
    # Hidden-state tensors a pipeline rank receives from the others per micro-batch: its stages' forward inputs from
    # the stage before, their gradients from the stage after.
    pp_receives: int = 0
    # Positions of a sequence whose logits the loss takes (GRPO: its completion's); 0: every one.
    loss_positions: int = 0
    # fp32 tensors of those logits' shape the objective's loss holds at the end of forward besides the logits; None:
    # cross entropy's.
    loss_held: int | None = None
    # What a micro-batch's generation holds (GRPO's rollouts); None: the objective generates nothing.
    generation: PlannedGeneration | None = None

    @property
    def reshard_after_backward(self) -> bool:
        """False where a pipeline's schedule defers the reduction (torch's turns FSDP's resharding after backward off
        with it): units stay gathered from one micro-batch's backward to the next's forward."""
        return not (self.pp > 1 and self.defer_grad_sync)

    @property
    def tokens(self) -> int:
        """A micro-batch's tokens on one rank."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def logit_tokens(self) -> int:
        """A micro-batch's positions on one rank whose logits the loss takes."""
        return self.micro_batch * (self.loss_positions or self.seq_len) // self.cp


def run_settings(cfg: DictConfig, world_size: int, device_type: str, stage: int = 0) -> Run:
    """stage: the pipeline rank planned (parallel.pp > 1)."""
    steps = layout(cfg, world_size)
    compute, reduce = dtypes(cfg.precision)
    p = cfg.parallel
    shape = pipeline_shape(p.pp_schedule, p.pp, steps.micro_steps, p.pp_stages_per_rank) if steps.pp > 1 else None
    # torch's schedules reduce an FSDP module's gradients after its last micro-batch only, unsharded until then (the
    # zero-bubble ones: the rank's model, pipeline.deferred_reduction); several stages a rank are views of one
    # module, which FSDP reduces after each micro-batch's backward.
    scheduled = p.pp_stages_per_rank == 1 or zero_bubble(p)
    objective, declared = resolve(cfg.objective._target_, "objective._target_"), kwargs_of(cfg.objective)
    sequence = objective.planned_sequence(cfg.data.seq_len, **declared)
    return Run(
        world_size=world_size,
        compute_dtype=cfg.precision.param_dtype,
        reduce_dtype=cfg.precision.reduce_dtype,
        shard_group=steps.shard_group,
        replicas=steps.replicas,
        compute_bytes=compute.itemsize,
        reduce_bytes=reduce.itemsize,
        micro_batch=cfg.trainer.micro_batch_size,
        seq_len=sequence[0],
        micro_steps=steps.micro_steps,
        defer_grad_sync=scheduled if steps.pp > 1 else cfg.trainer.defer_grad_sync,
        cpu_offload=cfg.sharding.cpu_offload,
        foreach=device_type == "cuda" and not cfg.sharding.cpu_offload,
        prefetch_forward=cfg.sharding.prefetch_forward,
        prefetch_backward=cfg.sharding.prefetch_backward,
        loss_chunks=cfg.loss.chunks,
        callbacks=declared_state({**cfg.callbacks, f"objective={cfg.objective.name}": cfg.objective}),
        nccl=device_type == "cuda",
        tp=steps.tp,
        cp=steps.cp,
        pp=steps.pp,
        in_flight=shape.in_flight[stage] if shape else 1.0,
        losses=shape.losses if shape else 1,
        bubble=shape.bubble if shape else 0.0,
        pp_receives=_receives(*stages_of(stage, p)) if steps.pp > 1 else 0,
        loss_positions=sequence[1],
        loss_held=sequence[2],
        generation=objective.planned_generation(**declared),
    )


def _receives(held: list[int], stages: int) -> int:
    """A rank's stages' inputs and incoming gradients that come from another rank."""
    return sum((s > 0 and s - 1 not in held) + (s < stages - 1 and s + 1 not in held) for s in held)
