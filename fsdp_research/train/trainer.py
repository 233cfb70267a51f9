"""The training recipe, as one rank runs it: join the process group -> check the config -> plan the model on the
meta device -> shard and materialize it -> optimizer -> resume -> loop {data -> forward -> backward -> clip ->
step -> metrics -> maybe checkpoint} -> export. Starting the processes that run it is fsdp_research.jobs.launch."""

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.callbacks.hooks import Callbacks, RunHandle
from fsdp_research.checkpoint.dcp import Checkpointer, config_files
from fsdp_research.checkpoint.hf_export import export_run
from fsdp_research.checkpoint.resume import load_objective_state
from fsdp_research.config.schema import Strategy, typed
from fsdp_research.data.pipeline import Data, Prefetcher, packed
from fsdp_research.distributed.context_parallel import split_of
from fsdp_research.distributed.pipeline import Pipeline
from fsdp_research.distributed.precision import LossScaler, autocast
from fsdp_research.distributed.processes import broadcast_object, device_for, init_distributed, launch_env, on_rank0
from fsdp_research.distributed.sharding import ShardingPlan
from fsdp_research.distributed.step_layout import Layout, layout
from fsdp_research.metrics.meters import MEAN_LOSSES, PeakMemory, Throughput, mean_over_ranks, packed_tokens
from fsdp_research.metrics.profiling import StepProfiler, region
from fsdp_research.metrics.sinks import Sinks, setup_logging
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import shard_stages
from fsdp_research.model.dimensions import dims
from fsdp_research.model.lora import base_identity
from fsdp_research.objectives import Objective, StepContext, build_objective
from fsdp_research.optim import build_optimizer, clip_, clip_grad_norm, grad_norm
from fsdp_research.train import overfit, rundir
from fsdp_research.train.anomaly import AnomalyChecks, apply_anomaly_checks
from fsdp_research.train.losses import Router, router_of, step_weight
from fsdp_research.train.preemption import NONE, STOP, Boundary, Signals, agree
from fsdp_research.train.randomness import seed_step
from fsdp_research.train.refusals import check_built, checked_plan, doubts
from fsdp_research.train.samples import take_samples
from fsdp_research.train.schedule import MicroBatches, Pipelined, StepLoss
from fsdp_research.train.startup import (
    close_on_exit,
    moe_balancer,
    note_dropout,
    observe,
    open_data,
    planned_fit,
    read_ahead,
    resume,
    throughput_of,
    whole_model,
)
from fsdp_research.train.state import TrainResult, TrainState

log = logging.getLogger("fsdp_research")


@dataclass
class Run:
    """Everything the loop works with, built once at the start."""

    cfg: DictConfig
    run_dir: str
    device: torch.device
    rank: int
    layout: Layout
    hf_config: Any
    model: nn.Module
    # This rank's stage of the pipeline (parallel.pp > 1; `model` is the stage's part of the whole); None without.
    pipeline: Pipeline | None
    plan: ShardingPlan
    optimizer: torch.optim.Optimizer
    state: TrainState
    data: Data
    batches: Prefetcher
    amp: Any
    objective: Objective
    router: Router | None
    callbacks: Callbacks
    handle: RunHandle
    checkpointer: Checkpointer
    sinks: Sinks
    profiler: StepProfiler
    throughput: Throughput
    peak: PeakMemory
    signals: Signals
    anomaly: AnomalyChecks
    save_times: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)


def train(cfg: Any, run_dir: str) -> TrainResult:
    """Train on this process's rank; every rank of the job calls it (rank 0's run_dir is the run's). Joins an
    existing process group or makes one. Sinks, profiler and checkpointer are closed however it ends; a failed
    run's W&B run is marked failed."""
    cfg = typed(cfg)
    # First: until the handler is in place a signal would end the process, and set-up can take minutes.
    signals = Signals(list(cfg.trainer.preemption_signal or []))
    with contextlib.ExitStack() as resources:
        resources.callback(signals.restore)
        run = _start(cfg, run_dir, signals, resources)
        result = TrainResult(run.model)
        started = time.perf_counter()
        _loop(run, result)
        _finish(run, result, time.perf_counter() - started)
        result.signal = signals.received
        return result


def _prepare(cfg: DictConfig, run_dir: str) -> tuple[torch.device, str, Any, nn.Module, ShardingPlan, str | None]:
    """Join the group, check everything, plan the model; only then touch the run dir (a bad config leaves an
    existing run as it was) and find the checkpoint to resume from."""
    env = launch_env()
    device = device_for(cfg.trainer.device, env.local_rank if env else 0)
    init_distributed(cfg.distributed, device)
    # Under torchrun and srun every rank has a run dir of its own making: rank 0's is the run's.
    run_dir = broadcast_object(run_dir)
    hf_config = build_hf_config(cfg.model)
    model, plan = checked_plan(cfg, dist.get_world_size(), hf_config, device)
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
    setup_logging(run_dir, dist.get_rank())
    for doubt in doubts(cfg, device):
        log.warning(doubt)
    resume_dir = on_rank0(lambda: rundir.resume_point(cfg.checkpoint.resume, run_dir))
    return device, run_dir, hf_config, model, plan, resume_dir


def _start(cfg: DictConfig, run_dir: str, signals: Signals, resources: contextlib.ExitStack) -> Run:
    device, run_dir, hf_config, model, plan, resume_dir = _prepare(cfg, run_dir)
    rank, world, t = dist.get_rank(), dist.get_world_size(), cfg.trainer
    # Read before sharding, which renames the classes it wraps.
    whole = whole_model(cfg, hf_config, model, plan)
    d, fit = dims(whole[0], whole[1].blocks), planned_fit(cfg, model, plan, device)
    model, pipeline = shard_stages(model, plan, cfg, device, whole[0])
    lay = layout(cfg, world)
    check_built(cfg, model, device)
    note_dropout(model)
    optimizer, scheduler = build_optimizer(model, cfg, plan.blocks)
    callbacks = Callbacks(cfg.callbacks)
    handle = RunHandle(model, optimizer, cfg, rank, world, run_dir, device, plan.blocks)
    callbacks.call("setup", handle)
    callbacks.add_builtin("moe_balancer", moe_balancer(model, cfg.model.moe, resources))
    state = TrainState(scheduler, LossScaler(cfg.precision), base_weights=base_identity(cfg.model))
    checks = resources.enter_context(apply_anomaly_checks(model, state, t.detect_anomaly))
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, config_files(cfg, hf_config))
    close_on_exit(resources, checkpointer.close)
    if resume_dir:  # first: a checkpoint that does not fit is refused before any data is tokenized
        resume(resume_dir, cfg, model, optimizer, state, callbacks)
    data = open_data(cfg, hf_config.vocab_size if hf_config is not None else d.vocab)
    objective = build_objective(cfg, model, device, data)
    if resume_dir:  # its state once it is built (it reads the data)
        objective.load_state_dict(load_objective_state(resume_dir, objective.state_dict()), state.step)
    throughput = throughput_of(cfg, d, *whole, device, state.step, objective.reference_forwards)
    sinks, profiler = observe(cfg, run_dir, device, plan, state, resources, fit)
    callbacks.add_builtin("profiler", profiler)
    batches = read_ahead(data, t, objective, (state.step, state.samples), device, resources, lay.tp, lay.cp, lay.pp)
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        device=device,
        rank=rank,
        layout=lay,
        hf_config=hf_config,
        model=model,
        pipeline=pipeline,
        plan=plan,
        optimizer=optimizer,
        state=state,
        data=data,
        batches=batches,
        amp=autocast(cfg.precision, device, enabled=plan.strategy is Strategy.ddp_classic),
        objective=objective,
        router=router_of(hf_config, d.experts, d.experts_per_token),
        callbacks=callbacks,
        handle=handle,
        checkpointer=checkpointer,
        sinks=sinks,
        profiler=profiler,
        throughput=throughput,
        peak=PeakMemory(device),
        signals=signals,
        anomaly=checks,
    )
    handle.step = state.step
    handle.bind(sinks.log, functools.partial(evaluate, run), functools.partial(export_run, model, cfg, hf_config))
    return run


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's, over its micro-batches
    grad_norm: torch.Tensor  # global
    lr: float  # the one the step used
    stats: dict[str, torch.Tensor]  # the loss's parts to log apart; a mixture of experts' tokens per expert
    # For the callbacks: the loss's mean over ranks; whether the optimizer step was skipped (a callback, an overflow).
    mean_loss: float | None = None
    skipped: bool = False


def train_step(run: Run, step: int) -> StepResult:
    """One optimizer step on the global batch of `step`: this rank's micro-batches forward and backward as the
    step's schedule runs them (train.schedule, with the gradient reduction), clip, step."""
    t, scaler, micro_steps = run.cfg.trainer, run.state.scaler, run.layout.micro_steps
    seed_step(t.seed, step, run.layout.tp, run.layout.pp)
    with region("data"):
        batch = run.batches.get(step).to(run.device, non_blocking=True)
    batch = run.objective.step_batch(run.model, batch, step)
    totals: dict[str, torch.Tensor] = {}
    weight, targets = step_weight(run.objective.targets(batch), micro_steps, run.layout)
    if targets is not None:
        totals["targets"] = targets
    tokens = run.objective.trained_tokens(batch)
    if tokens is None and packed(run.cfg.data):
        tokens = packed_tokens(batch, run.data.pad_id)
    if tokens is not None:
        run.throughput.add(tokens)
    split = split_of(run.model)
    losses = StepLoss(run.objective, StepContext(run.amp, split, run.router, weight), run.anomaly.check_loss)
    schedule = MicroBatches(t.micro_batch_size, micro_steps, t.defer_grad_sync)
    if run.pipeline:
        schedule = Pipelined(run.pipeline, micro_steps)
    with split.splitting() if split else contextlib.nullcontext():
        loss_sum, each = schedule.run(run.model, batch, losses, lambda loss: scaler.scale_loss(loss).backward())
    for stats in each:
        for k, v in stats.items():
            totals[k] = totals.get(k, 0) + (v / micro_steps if k in MEAN_LOSSES else v)
    with region("optimizer"):
        finite = scaler.unscale_and_check(run.model.parameters())
        run.anomaly.check_grads(skipped=not finite)
        norm, mean_loss, skipped = _clip(run, step, loss_sum)
        if finite and not skipped:
            run.optimizer.step()
        scaler.update(finite)
        run.optimizer.zero_grad(set_to_none=True)
    lr = run.state.scheduler.get_last_lr()[0]
    run.state.scheduler.step()
    run.state.step = step + 1
    if step % run.objective.iterations == 0:  # a step that read new samples
        run.state.samples += run.objective.samples_per_step(t.global_batch_size)
    run.state.tokens_seen += t.global_batch_size * run.cfg.data.seq_len
    # Skipped for the callbacks (the EMA's average stays): by one of them, or by the loss scaler's overflow.
    return StepResult(loss_sum, norm, lr, totals, mean_loss, skipped or not finite)


def _clip(run: Run, step: int, loss_sum: torch.Tensor) -> tuple[torch.Tensor, float | None, bool]:
    """The global gradient norm, the gradients clipped to optim.grad_clip. With callbacks, they see the step's
    mean loss and the unclipped norm (and the gradients) first, and any rank may ask to skip the update: every
    rank then skips it. Returns (norm, mean loss or None, skipped)."""
    if not run.callbacks:
        return clip_grad_norm(run.model, run.cfg.optim.grad_clip), None, False
    norm, grads = grad_norm(run.model)
    mean_loss, skip = mean_over_ranks(loss_sum), False
    if run.callbacks.has("on_before_optimizer_step"):
        run.handle.step = step + 1
        metrics = {"loss": mean_loss, "grad_norm": norm.item()}
        run.callbacks.call("on_before_optimizer_step", run.handle, step + 1, metrics)
        skip = run.callbacks.agree(run.handle)[0]
    clip_(grads, norm, run.cfg.optim.grad_clip)
    return norm, mean_loss, skip


def _loop(run: Run, result: TrainResult) -> None:
    """Steps until max_steps, a preemption signal or a callback's stop. Throughput windows run from one log to the
    next, without the time of eval and checkpoint saves."""
    t, callbacks, handle = run.cfg.trainer, run.callbacks, run.handle
    callbacks.call("on_train_start", handle)
    run.throughput.start()
    run.peak.reset()
    last_logged = run.state.step
    for step in range(run.state.step, t.max_steps):
        out = train_step(run, step)
        done = handle.step = step + 1
        logged = {}
        if done % t.log_interval == 0 or done == t.max_steps:
            logged = _log_step(run, result, done - last_logged, out)
            last_logged = done
            run.throughput.start()
            run.peak.reset()
        metrics = {**logged, "lr": out.lr, "skipped": out.skipped}
        if callbacks:
            metrics.update(loss=out.mean_loss, grad_norm=out.grad_norm.item())
        # The MoE bias balancer, the profiler (the step's boundary: before its eval and save), the config's.
        callbacks.call("on_step_end", handle, done, metrics)
        if t.eval_interval and (done % t.eval_interval == 0 or done == t.max_steps):
            with run.throughput.paused():
                metrics = {"step": done, **evaluate(run)}
                run.sinks.log(metrics)
                run.sinks.samples(done, take_samples(run.model, run.cfg, run.device, run.amp))
                callbacks.call("on_eval", handle, done, metrics)
        # Any rank's stop request is every rank's.
        stopped_by_callback = bool(callbacks) and callbacks.agree(handle)[1]
        boundary = _at_boundary(run, done)
        result.stop = boundary.stop
        # The grace is SIGTERM's: a warning signal (SLURM's --signal=USR2@<s>) comes well before the kill.
        if result.stop == STOP and not boundary.save_fits(t.preemption_grace_s):
            result.past_grace = (
                f"a save takes {boundary.save_s:.1f} s and the signal came {boundary.waited_s:.1f} s ago: it would "
                f"end past trainer.preemption_grace_s={t.preemption_grace_s:g}"
            )
        if run.checkpointer.due(done, t.max_steps, stop=bool(result.stop) or stopped_by_callback):
            if result.past_grace and not t.save_past_grace:
                log.warning(f"no resume checkpoint at step {done}: {result.past_grace} (trainer.save_past_grace)")
            else:
                with run.throughput.paused():
                    _save(run)
        if result.stop:
            saved = "with a resume checkpoint" if run.checkpointer.saved(done) else "without a checkpoint"
            by = run.signals.received or "on another rank"
            log.info(f"preemption signal ({by}): stopped after step {done} {saved}")
            return
        if stopped_by_callback:
            saved = "with a checkpoint" if run.checkpointer.saved(done) else "without a checkpoint"
            log.info(f"a callback asked to stop: stopped after step {done} {saved}")
            return


def _at_boundary(run: Run, done: int) -> Boundary:
    """What the ranks agree on at this step boundary (every trainer.agree_every steps): publish the async save
    every rank has finished; the stop code (a signal any rank received) and the times the grace check needs."""
    if done % run.cfg.trainer.agree_every:
        return Boundary(NONE, 0, 0.0, 0.0)
    boundary = agree(run.signals, run.checkpointer.finished_step(), run.checkpointer.last_save_s)
    run.checkpointer.publish_finished(boundary.finished_step)
    return boundary


def _log_step(run: Run, result: TrainResult, steps: int, out: StepResult) -> dict[str, Any]:
    """The metrics of the `steps` steps since the last log, to every sink; returns them."""
    done, scaler = run.state.step, run.state.scaler
    metrics = {
        "step": done,
        # Already reduced for the callbacks, where there are some.
        "loss": out.mean_loss if out.mean_loss is not None else mean_over_ranks(out.loss),
        "lr": out.lr,
        "grad_norm": out.grad_norm.item(),
        "samples": run.state.samples,
        **run.objective.metrics(out.stats),
        **run.throughput.stop(steps),
        **run.peak.window(),
    }
    if scaler.enabled:
        metrics.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped_steps)
    result.losses.append(metrics["loss"])
    run.rates.append(metrics["tokens_per_s"])
    run.sinks.log(metrics)
    run.sinks.samples(done, run.objective.shown())
    return metrics


def evaluate(run: Run) -> dict[str, float]:
    return run.objective.evaluate(run.model, run.data, run.cfg, run.device, run.amp)


def _save(run: Run) -> None:
    started, step = time.perf_counter(), run.state.step
    trainer_state = run.state.state_dict(run.layout.world_size)
    callbacks, objective = run.callbacks.state_dict(), run.objective.state_dict()
    run.checkpointer.save(step, run.model, run.optimizer, trainer_state, callbacks, objective)
    # What a save blocks training for (with checkpoint.async, only the staging).
    run.save_times.append(time.perf_counter() - started)
    run.callbacks.call("on_save", run.handle, step, os.path.join(run.checkpointer.root, f"step_{step}"))


def _finish(run: Run, result: TrainResult, wall_time_s: float) -> None:
    """After the loop: close the profile, publish the last save, export the weights (a
    collective: every rank gathers), and the summary: a log line and a {"step", "summary"} record."""
    cfg = run.cfg
    run.profiler.close()
    run.checkpointer.wait()
    if cfg.checkpoint.export and not result.preempted:
        export_run(run.model, cfg, run.hf_config, os.path.join(run.run_dir, "export"))
    run.callbacks.call("on_train_end", run.handle, result)
    rates = sorted(run.rates)
    result.summary = {
        "final_loss": result.losses[-1] if result.losses else None,
        "steps": run.state.step,
        "wall_time_s": round(wall_time_s, 2),
        "median_tokens_per_s": rates[len(rates) // 2] if rates else None,
        # The largest window's, already agreed: no collective here, where rank 0 may still be writing the export.
        **run.peak.run,
    }
    result.summary.update(overfit.verdict(cfg.data.overfit_batches, result.losses))
    if run.save_times:
        result.summary["checkpoint_save_s"] = sum(run.save_times) / len(run.save_times)
    log.info(
        "summary: "
        + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.summary.items())
    )
    run.sinks.note(run.state.step, "summary", result.summary)
