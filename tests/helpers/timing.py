"""Step times of configs measured on real processes (gloo, CPU), beside this machine's rates measured in the same
processes: what the planner's step-time model is ranked against."""

import contextlib
import gc
import time
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from fsdp_research.config.schema import typed
from fsdp_research.distributed.context_parallel import split_of
from fsdp_research.distributed.mesh import pipeline_rank
from fsdp_research.distributed.pipeline import pipeline_of
from fsdp_research.distributed.processes import init_distributed
from fsdp_research.distributed.step_layout import layout
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import planned_model, shard_stages
from fsdp_research.objectives import StepContext
from fsdp_research.objectives.lm import NextToken
from fsdp_research.optim import build_optimizer, clip_grad_norm
from fsdp_research.planner.calibrate import measure_rates
from fsdp_research.train.schedule import MicroBatches, Pipelined, StepLoss
from fsdp_research.train.startup import whole_model
from tests.helpers.dist import run_distributed


def train_step(model, optimizer, batches: list[torch.Tensor], cfg, objective=None, weight=None) -> None:
    """One step as the trainer takes it: its micro-batches by the trainer's schedule (this rank's chunks of them
    under context parallel, the gradient sync on the last; through the stages by the pipeline's), clip, update.
    The objective's loss (set up; NextToken's by default), each micro-batch's times `weight`."""
    split, pipeline = split_of(model), pipeline_of(model)
    if objective is None:
        objective = NextToken()
        objective.setup(cfg)
    schedule = MicroBatches(cfg.trainer.micro_batch_size, len(batches), cfg.trainer.defer_grad_sync)
    if pipeline:
        schedule = Pipelined(pipeline, len(batches))
    losses = StepLoss(objective, StepContext(contextlib.nullcontext(), split, None, weight), lambda loss: None)
    with split.splitting() if split else contextlib.nullcontext():
        schedule.run(model, torch.cat(batches), losses, lambda loss: loss.backward())
    clip_grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def prepared(container: dict) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """(config, sharded model, optimizer, a step's random micro-batches) on this process group's rank (CPU); as
    the trainer builds it: the model of this rank's pipeline stages with its Pipeline where parallel.pp > 1."""
    cfg, device = typed(container), torch.device("cpu")
    init_distributed(cfg.distributed, device)
    hf_config, world = build_hf_config(cfg.model), dist.get_world_size()
    model, plan = planned_model(cfg, hf_config, stage=pipeline_rank(cfg.parallel.pp))
    model, _ = shard_stages(model, plan, cfg, device, whole_model(cfg, hf_config, model, plan)[0])
    lay = layout(cfg, world)
    optimizer, _ = build_optimizer(model, cfg, plan.blocks)
    # A tp x cp group reads the same batch (the stages of a pipeline, theirs).
    gen = torch.Generator().manual_seed(dist.get_rank() % (world // lay.pp) // (lay.tp * lay.cp))
    shape = (cfg.trainer.micro_batch_size, cfg.data.seq_len + 1)
    return (
        cfg,
        model,
        optimizer,
        [torch.randint(0, hf_config.vocab_size, shape, generator=gen) for _ in range(lay.micro_steps)],
    )


def _time_each(configs: dict[str, Any], steps: int, shape: tuple[int, int, int]) -> dict[str, Any]:
    """Every config built first, then timed in turns (a step of each, `steps` times over): a stretch of load from
    another process slows a step of every config, not all steps of one."""
    runs = {name: prepared(container) for name, container in configs.items()}
    for cfg, model, optimizer, batches in runs.values():
        train_step(model, optimizer, batches, cfg)  # warm-up: the optimizer's state is made
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, (cfg, model, optimizer, batches) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            train_step(model, optimizer, batches, cfg)
            seconds[name].append(time.perf_counter() - start)
    # The fastest: a step another process slowed says nothing of the config.
    times = {name: min(taken) for name, taken in seconds.items()}
    del runs
    gc.collect()
    return {"times": times, "rates": measure_rates(*shape, torch.float32)}


def measure_step_times(configs: dict[str, Any], world_size: int, steps: int, shape: tuple[int, int, int]) -> dict:
    """{"times": {name: the fastest step's seconds}, "rates": this machine's rates (planner.calibrate), measured with
    a matmul of `shape` (rows, inner, cols)}, all on the same world_size processes."""
    containers = {name: OmegaConf.to_container(cfg, resolve=True) for name, cfg in configs.items()}
    return run_distributed(_time_each, world_size, containers, steps, shape)
