"""What a run sets up once beside the model: the data (token stores built where missing), the global RNG seeded
per rank, the throughput/MFU meter with the start-up log line that describes the run, and what observes it (the
sinks, status.json, the doctor's findings, the profiler), closed however the run ends; a resumed run's state."""

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from fsdp_research.callbacks.hooks import Callbacks
from fsdp_research.checkpoint.resume import load_checkpoint
from fsdp_research.config.data_schema import DataKind
from fsdp_research.data.pipeline import Build, Data, Prefetcher, build_data
from fsdp_research.data.tokenizer import describe as describe_tokenizer
from fsdp_research.distributed.mesh import data_parallel
from fsdp_research.distributed.precision import dtypes
from fsdp_research.distributed.processes import cores_per_rank, members, on_rank0, planned_nodes
from fsdp_research.distributed.sharding import ShardingPlan
from fsdp_research.distributed.step_layout import layout
from fsdp_research.metrics.meters import Throughput, active_parameters
from fsdp_research.metrics.profiling import StepProfiler
from fsdp_research.metrics.sinks import Sinks, build_sinks
from fsdp_research.model.architecture import dropout_in
from fsdp_research.model.assembly import planned_model
from fsdp_research.model.dimensions import ModelDims
from fsdp_research.model.moe_balancing import BiasBalancer
from fsdp_research.objectives import Objective
from fsdp_research.optim import configured_keys
from fsdp_research.optim.resume import continue_schedule
from fsdp_research.planner.doctor import diagnose, report
from fsdp_research.planner.fit import doctor_fit
from fsdp_research.train import rundir
from fsdp_research.train.state import TrainState

log = logging.getLogger("fsdp_research")


def open_data(cfg: DictConfig, vocab_size: int) -> Data:
    """The run's data. Where a token store is missing every rank builds its share with its share of the node's
    cores (rank 0 logs the progress); opening existing stores takes milliseconds."""
    rank, started = dist.get_rank(), time.perf_counter()

    def progress(done: int, total: int, seconds: float) -> None:
        log.info(f"tokenizing: {done}/{total} parts of the token store done after {seconds:.0f} s")

    build = Build(
        rank=rank,
        world=dist.get_world_size(),
        workers=cfg.data.build_workers or cores_per_rank(),
        name=on_rank0(lambda: secrets.token_hex(8)),
        report=progress if rank == 0 else None,
        timeout_s=cfg.distributed.timeout_s,
    )
    if cfg.data.kind is not DataKind.synthetic:
        log.info(describe_tokenizer(cfg.data.tokenizer, cfg.model))
    data = build_data(cfg.data, vocab_size, cfg.trainer.seed, build)
    log.info(f"data: {data.describe()}; ready in {time.perf_counter() - started:.2f} s")
    return data


def read_ahead(
    data: Data,
    t: DictConfig,
    objective: Objective,
    start: tuple[int, int],
    device: torch.device,
    resources: contextlib.ExitStack,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
) -> Prefetcher:
    """This rank's batches of the objective's samples a step from `start` on ((step, samples consumed before it);
    trainer section `t`), read ahead on a thread (closed when the run ends): its data-parallel rank's (the ranks of a
    tp x cp group, and a pipeline's stages, read the same). The samples go on from those consumed, so a resume at
    another global batch size trains on the next. With the objective's `iterations` > 1 a step reads new samples at
    its multiples, the steps between get the batch the last of them read (counted in `consumed` already)."""
    rank, world = data_parallel(tp, cp, pp)
    step0, consumed = start
    samples, iterations = objective.samples_per_step(t.global_batch_size), objective.iterations

    def position(step: int) -> int:
        reads = step // iterations - (step0 - 1) // iterations  # the multiples of `iterations` in [step0, step]
        return consumed + samples * (reads - 1)

    batches = Prefetcher(
        lambda step: data.rank_batch(position(step), samples, rank, world),
        step0,
        t.max_steps,
        pin=device.type == "cuda",
    )
    close_on_exit(resources, batches.close)
    return batches


def mesh_line(cfg: DictConfig, world: int) -> str | None:
    """The start-up line of a mesh of more than one dimension (hsdp's and ddp's replicate x shard, tp, ep, cp, pp);
    None for FSDP's one shard dimension, which the model's line says."""
    lay = layout(cfg, world)
    return lay.describe_mesh() if lay.replicas > 1 or max(lay.tp, lay.ep, lay.cp, lay.pp) > 1 else None


def whole_model(cfg: DictConfig, hf_config, model: nn.Module, plan: ShardingPlan) -> tuple[nn.Module, ShardingPlan]:
    """The whole model as planned (shapes only, on the meta device) where this rank's is a pipeline stage: what a
    token is multiplied with in every stage, for the model's line and MFU; else the rank's own."""
    return (model, plan) if cfg.parallel.pp == 1 else planned_model(cfg, hf_config, values=False, stage=None)


def throughput_of(
    cfg: DictConfig,
    d: ModelDims,
    model: nn.Module,
    plan: ShardingPlan,
    device: torch.device,
    start: int,
    reference_forwards: float = 0,
) -> Throughput:
    """Throughput and MFU (from the parameters a token is multiplied with: a mixture of experts' active ones, no
    embedding lookups; and the objective's reference forwards; against the device's peak in the compute dtype)."""
    t, world = cfg.trainer, dist.get_world_size()
    n_params, active = sum(p.numel() for p in model.parameters()), active_parameters(model, d)
    moe = f" ({active / 1e6:.2f}M active per token)" if active != n_params else ""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable != n_params:  # LoRA
        moe += f", {trainable / 1e6:.3f}M of them trainable ({trainable / n_params:.2%})"
    log.info(
        f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters{moe}, {len(plan.blocks)} blocks, "
        f"{plan.strategy.value} on {world} rank(s), {len(plan.units)} FSDP units, device {device}, "
        f"starting at step {start}"
    )
    mesh = mesh_line(cfg, world)
    if mesh:
        log.info(mesh)
    if d.unknown:
        log.info(f"MFU: no attention found in {', '.join(d.unknown)}: their parameters counted, not their mixing")
    dtype, group = dtypes(cfg.precision)[0], cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp
    return Throughput.of(
        model, d, t.global_batch_size, cfg.data.seq_len, world, dtype, device, t.peak_tflops, group, reference_forwards
    )


def moe_balancer(model: nn.Module, moe: DictConfig, resources: contextlib.ExitStack) -> BiasBalancer:
    """Aux-loss-free balancing of the routers that carry an expert bias (model.moe.bias_update_rate), its hooks
    removed when the run ends."""
    balancer = BiasBalancer(model, moe.bias_update_rate)
    close_on_exit(resources, lambda failed: balancer.close())
    return balancer


def note_dropout(model: nn.Module) -> None:
    """Where the model draws dropout masks, a line saying when its losses repeat (fsdp_research.train.randomness)."""
    dropout = dropout_in(getattr(model, "module", model))  # under torch DDP, the model it wraps
    if dropout and dist.get_rank() == 0:
        log.info(
            f"dropout is on ({', '.join(dropout[:4])}): each data-parallel rank draws its own masks, seeded at every "
            "step from trainer.seed (a tp group's ranks alike, a resume as the run went on), so the losses repeat at "
            "this data-parallel size, not at another"
        )


def close_on_exit(resources: contextlib.ExitStack, close: Callable[[bool], Any]) -> None:
    """close(failed) when the run ends, whether it returns or raises."""

    def on_exit(exc_type, exc, tb) -> bool:
        close(exc_type is not None)
        return False

    resources.push(on_exit)


def planned_fit(cfg: DictConfig, model: nn.Module, plan: ShardingPlan, device: torch.device) -> dict | None:
    """Rank 0's input to the doctor's fit check (planner.fit.doctor_fit), read from the model as the trainer
    planned it: before sharding renames its classes, and without building it again. None on the other ranks, and
    for pipeline stages, which the doctor does not plan yet."""
    if dist.get_rank() or cfg.parallel.pp > 1:
        return None
    return doctor_fit(cfg, dist.get_world_size(), device, (model, plan))


def observe(
    cfg: DictConfig,
    run_dir: str,
    device: torch.device,
    plan: ShardingPlan,
    state: TrainState,
    resources,
    fit: dict | None,
) -> tuple[Sinks, StepProfiler]:
    """The sinks (rank 0's console, metrics.jsonl, W&B), status.json, the doctor's start-up findings (`fit`: see
    planned_fit), and the profiler; closed when the run ends."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sinks = build_sinks(
        cfg.logger,
        run_dir,
        rank,
        cfg.trainer.max_steps,
        OmegaConf.to_container(cfg, resolve=True),
        state.wandb_run_id,
        state.step,
    )
    close_on_exit(resources, sinks.finish)
    # Saved with the next checkpoint by rank 0, the only rank with sinks.
    state.wandb_run_id = sinks.wandb_run_id or state.wandb_run_id
    if rank == 0:
        rundir.write_status(run_dir, "running", ranks=members())
        findings = diagnose(cfg, plan, world, planned_nodes(), fit=fit)
        report(findings, sinks, state.step)
    profiler = StepProfiler(cfg.trainer.profile_steps, run_dir, rank, device, sinks)
    close_on_exit(resources, lambda failed: profiler.close())
    return sinks, profiler


def resume(resume_dir: str, cfg: DictConfig, model, optimizer, state: TrainState, callbacks: Callbacks) -> None:
    """The checkpoint's model, optimizer, trainer and callback state into the run's; its schedule continued."""
    base_lrs = list(state.scheduler.base_lrs)  # the config's: the checkpoint's replace them
    trainer_state, callback_state = load_checkpoint(
        resume_dir, model, optimizer, callbacks.state_dict(), configured_keys(cfg.optim)
    )
    state.load_state_dict(trainer_state, cfg.data.seq_len)
    state.scheduler = continue_schedule(state.scheduler, cfg, base_lrs, resume_dir)
    callbacks.load_state_dict(callback_state)
