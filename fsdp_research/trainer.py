"""The training recipe: init distributed -> build the model on meta -> activation checkpointing -> shard ->
materialize -> optimizer -> loop {data -> forward -> backward -> clip -> step -> metrics}."""
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.multiprocessing import ProcessExitedException

from .checkpoint import CheckpointError, Checkpointer, check_fresh_start, config_files, find_resume, run_dir_of
from .config import ConfigError, DataKind, Strategy, typed
from .data import Data, build_data, check_vocab, resolve_paths
from .distributed import (broadcast_object, device_for, init_distributed, launch_env, planned_nodes,
                          planned_world_size, spawn)
from .doctor import diagnose, report
from .logging import build_sinks, new_run_id, setup_logging
from .metrics import Throughput, flops_per_token, peak_memory, peak_tflops
from .models import (block_class_name, build_hf_config, build_model, find_blocks, init_weights, load_pretrained,
                     materialize, pretrained_dir)
from .optim import build_optimizer, clip_grad_norm
from .export import export_model, parse_size
from .preemption import Preemption, requeue
from .precision import LossScaler, autocast, build_mp_policy, check_device_supports, dtype
from .profiling import StepProfiler, region
from .sharding import apply_ddp, apply_fsdp, build_mesh, grad_sync, planned_model

log = logging.getLogger("fsdp_research")


def check_config(cfg: DictConfig, world_size: int, hf_config, device: torch.device) -> None:
    """Every check that needs no compute: raises ConfigError naming the key and the fix."""
    t = cfg.trainer
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_interval"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}", f"{t[key]} is below 1", f"set trainer.{key} to 1 or more")
    if t.profile_steps < 0:
        raise ConfigError("trainer.profile_steps", f"{t.profile_steps} is negative", "use 0 (off) or a few steps")
    if t.global_batch_size % (t.micro_batch_size * world_size):
        unit = t.micro_batch_size * world_size
        raise ConfigError("trainer.global_batch_size",
                          f"{t.global_batch_size} is not divisible by micro_batch_size x data-parallel size "
                          f"({t.micro_batch_size} x {world_size} = {unit})",
                          f"use a multiple of {unit}, or change trainer.micro_batch_size")
    max_positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if max_positions and cfg.data.seq_len > max_positions:
        raise ConfigError("data.seq_len", f"{cfg.data.seq_len} exceeds the model's {max_positions} positions",
                          f"set data.seq_len to at most {max_positions}")
    if cfg.sharding.strategy is Strategy.hsdp and (cfg.sharding.replicate < 1
                                                   or world_size % cfg.sharding.replicate):
        raise ConfigError("sharding.replicate", f"{cfg.sharding.replicate} replica groups do not divide "
                          f"the world size {world_size}", "use a divisor of the world size")
    check_device_supports(cfg.precision, device)
    build_mp_policy(cfg.precision)
    if cfg.data.kind is DataKind.local_text:
        resolve_paths(cfg.data)
    if t.eval_interval and cfg.data.eval_fraction <= 0:
        raise ConfigError("trainer.eval_interval", "eval needs held-out data but data.eval_fraction is 0",
                          "set data.eval_fraction above 0, or trainer.eval_interval=0")
    check_vocab(cfg.data, hf_config.vocab_size)
    model = build_model(hf_config)
    find_blocks(model, block_class_name(model, cfg.model.block_class))


@dataclass
class TrainResult:
    model: nn.Module
    losses: List[float] = field(default_factory=list)
    # Stopped early by the preemption signal, after saving a resume checkpoint.
    preempted: bool = False
    summary: Dict[str, Any] = field(default_factory=dict)


def _loss(model: nn.Module, batch: torch.Tensor, amp) -> torch.Tensor:
    with amp:
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model: nn.Module, data: Data, cfg: DictConfig, amp, device: torch.device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = cfg.trainer.micro_batch_size
    total = torch.zeros((), device=device)
    model.eval()
    for i in range(cfg.trainer.eval_batches):
        start = (i * world + rank) * per_rank
        index = torch.arange(start, start + per_rank) % len(data.eval)
        total += _loss(model, data.eval[index].to(device), amp)
    model.train()
    return _mean_over_ranks(total) / cfg.trainer.eval_batches


def build_sharded_model(cfg: DictConfig, hf_config, device: torch.device, world: int):
    """Model on meta -> activation checkpointing -> compile -> FSDP plan applied -> this rank's shards
    materialized (initialised, or read from model.name_or_path) -> DDP for the baseline."""
    model, plan = planned_model(cfg, hf_config)
    apply_fsdp(model, plan, build_mesh(cfg.sharding, device.type, world), build_mp_policy(cfg.precision),
               cfg.sharding)
    materialize(model, torch.device("cpu") if cfg.sharding.cpu_offload else device)
    if cfg.model.load_weights:
        load_pretrained(model, pretrained_dir(cfg.model.name_or_path), device)
    else:
        init_weights(model, cfg.trainer.seed)
    if plan.strategy is Strategy.ddp:
        model = apply_ddp(model, device)
    return model, plan


def train(cfg: Any, run_dir: Optional[str] = None) -> TrainResult:
    """Train on this process's rank; every rank of the job calls it. Joins an existing process group."""
    cfg = typed(cfg)
    preemption = Preemption(cfg.trainer.preemption_signal)
    env = launch_env()
    device = device_for(cfg.trainer.device, env.local_rank if env else 0)
    init_distributed(cfg.distributed, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = broadcast_object(run_dir_of(cfg.checkpoint.resume) or run_dir)
    hf_config = build_hf_config(cfg.model)
    # Before the run dir is touched: a bad config must leave an existing run dir as it was.
    check_config(cfg, world, hf_config, device)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
    setup_logging(run_dir, rank)
    resume_dir = broadcast_object(find_resume(cfg.checkpoint.resume, run_dir) if rank == 0 else None)
    if cfg.checkpoint.resume == "never":
        check_fresh_start(run_dir)
    t = cfg.trainer
    data = build_data(cfg.data, hf_config.vocab_size, t.seed)

    model, plan = build_sharded_model(cfg, hf_config, device, world)
    n_params = sum(p.numel() for p in model.parameters())
    amp = autocast(cfg.precision, device, enabled=plan.strategy is Strategy.ddp)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps)
    scaler = LossScaler(cfg.precision)
    checkpointer = Checkpointer(cfg.checkpoint, run_dir, config_files(cfg, hf_config))
    state = {"step": 0, "wandb_run_id": new_run_id()}
    if resume_dir:
        state = checkpointer.load(resume_dir, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
    log.info(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, {len(plan.blocks)} blocks, "
             f"{plan.strategy.value} on {world} rank(s), {len(plan.units)} FSDP units, device {device}, "
             f"starting at step {state['step']}")

    sinks = build_sinks(cfg.logger, run_dir, rank, t.max_steps, OmegaConf.to_container(cfg, resolve=True),
                        state["wandb_run_id"], state["step"])
    if rank == 0:
        write_status(run_dir, "running")
        report(diagnose(cfg, plan, world, planned_nodes()), sinks, state["step"])
    profiler = StepProfiler(t.profile_steps, run_dir, rank, device, sinks)
    save_times: List[float] = []
    micro_steps = t.global_batch_size // (t.micro_batch_size * world)
    throughput = Throughput(t.global_batch_size * cfg.data.seq_len, t.global_batch_size, world,
                            flops_per_token(hf_config, n_params, cfg.data.seq_len), peak_tflops(device, t.peak_tflops),
                            device)
    result = TrainResult(model)
    rates: List[float] = []
    start_time = time.perf_counter()
    throughput.start()
    last_logged = state["step"]
    for step in range(state["step"], t.max_steps):
        with region("data"):
            batch = data.train.rank_batch(step, t.global_batch_size, rank, world).to(device)
        loss_sum = torch.zeros((), device=device)
        for i, micro in enumerate(batch.split(t.micro_batch_size)):
            with grad_sync(model, i == micro_steps - 1 or not t.defer_grad_sync):
                with region("forward"):
                    loss = _loss(model, micro, amp) / micro_steps
                with region("backward"):
                    scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        with region("optimizer"):
            finite = scaler.unscale_and_check(model.parameters())
            grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
            if finite:
                optimizer.step()
            scaler.update(finite)
            optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        done = step + 1
        if done % t.log_interval == 0 or done == t.max_steps:
            metrics = {"step": done, "loss": _mean_over_ranks(loss_sum), "lr": lr, "grad_norm": grad_norm.item(),
                       **throughput.stop(done - last_logged), **peak_memory(device)}
            if scaler.enabled:
                metrics.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped_steps)
            if t.eval_interval and (done % t.eval_interval == 0 or done == t.max_steps):
                metrics["eval_loss"] = evaluate(model, data, cfg, amp, device)
            result.losses.append(metrics["loss"])
            rates.append(metrics["tokens_per_s"])
            sinks.log(metrics)
            last_logged = done
        # Before the checkpoint, so that the run's final save stays out of the profiled window (the summary
        # times saves on their own).
        profiler.step(done)
        result.preempted = preemption.requested()
        if checkpointer.due(done, t.max_steps) or result.preempted:
            save_start = time.perf_counter()
            checkpointer.save(done, model, optimizer, {
                "step": done, "tokens_seen": done * t.global_batch_size * cfg.data.seq_len,
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "wandb_run_id": state["wandb_run_id"], "world_size": world})
            save_times.append(time.perf_counter() - save_start)
        if result.preempted:
            log.info(f"preemption signal: stopped after step {done} with a resume checkpoint")
            break
        if last_logged == done:
            throughput.start()
    profiler.close()
    preemption.close()
    checkpointer.wait()
    if cfg.checkpoint.export and not result.preempted:
        export_dtype = cfg.checkpoint.export_dtype or cfg.precision.param_dtype
        export_model(model, hf_config, os.path.join(run_dir, "export"), dtype(export_dtype, "checkpoint.export_dtype"),
                     parse_size(cfg.checkpoint.export_shard_size), cfg.data.tokenizer)
    result.summary = {"final_loss": result.losses[-1] if result.losses else None,
                      "steps": done if result.preempted else t.max_steps,
                      "wall_time_s": round(time.perf_counter() - start_time, 2),
                      "median_tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None,
                      **peak_memory(device)}
    if save_times:  # what a save blocks training for (with checkpoint.async, only the staging)
        result.summary["checkpoint_save_s"] = sum(save_times) / len(save_times)
    log.info("summary: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in result.summary.items()))
    sinks.finish()
    return result


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def write_status(run_dir: str, status: str, error: Optional[str] = None) -> None:
    """<run dir>/status.json: running, completed, preempted or failed (with the one-line reason), for sweeps
    and the report. A command refused before it trained leaves an earlier run's record as it was."""
    path = os.path.join(run_dir, "status.json")
    if status == "failed" and os.path.exists(path):
        with open(path) as f:
            if json.load(f)["status"] != "running":
                return
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"status": status, "error": error}, f)


def _run_worker(cfg: Any, run_dir: str) -> str:
    """Train on this process's rank; rank 0 records the outcome in status.json. Returns the status."""
    env = launch_env()
    run_dir = run_dir_of(typed(cfg).checkpoint.resume) or run_dir
    status, error = "failed", None
    try:
        status = "preempted" if train(cfg, run_dir).preempted else "completed"
        return status
    except BaseException as err:
        error = _one_line(err)
        raise
    finally:
        if env is None or env.rank == 0:
            write_status(run_dir, status, error)
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_worker(cfg: Any, run_dir: str) -> None:
    try:
        _run_worker(cfg, run_dir)
    except (ConfigError, CheckpointError) as err:
        # Every rank raises these alike (checks run everywhere, checkpoint failures are made collective):
        # rank 0 says it once.
        if launch_env().rank == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # Everything is written and closed: leave without the interpreter's teardown, where gloo's threads can
    # abort the process ("terminate called without an active exception") and fail a finished run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _name_sweep_job(cfg: DictConfig) -> None:
    """In a sweep, W&B groups the jobs by sweep and names each by its overrides, unless set."""
    hydra = HydraConfig.get()
    cfg.logger.group = cfg.logger.group or os.path.relpath(hydra.sweep.dir, "outputs/multirun").replace("/", "_")
    cfg.logger.name = cfg.logger.name or hydra.job.override_dirname or f"job{hydra.job.num}"


def launch(cfg: DictConfig, run_dir: str) -> None:
    """Entry from train.py: check the config once, then train here or in nproc_per_node workers.
    In a sweep a failed job is recorded (status.json) and the sweep goes on; train.py's callback fails the
    sweep at its end."""
    cfg = typed(cfg)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun:
        _name_sweep_job(cfg)
    container = OmegaConf.to_container(cfg, resolve=True)
    try:
        if launch_env() is None and cfg.distributed.nproc_per_node > 1:
            # Checked here so that a bad value fails once, before any worker starts.
            try:
                check_config(cfg, planned_world_size(cfg.distributed), build_hf_config(cfg.model),
                             device_for(cfg.trainer.device, 0))
            except ConfigError as err:
                write_status(run_dir, "failed", _one_line(err))
                raise
            spawn(_spawned_worker, cfg.distributed.nproc_per_node, container, run_dir)
            status = json.load(open(os.path.join(run_dir_of(cfg.checkpoint.resume) or run_dir, "status.json")))
            preempted = status["status"] == "preempted"
        else:
            preempted = _run_worker(container, run_dir) == "preempted"
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        return
    except ProcessExitedException as err:  # the worker has said why
        if not multirun:
            sys.exit(err.exit_code or 1)
        return
    except Exception:
        if not multirun:
            raise
        log.exception("job failed")
        return
    env = launch_env()
    if preempted and (requeue() if env is None or env.rank == 0 else "SLURM_JOB_ID" in os.environ):
        # Requeued: end without returning a result, so a launcher waiting on this job (submitit) keeps
        # waiting for the requeued run instead of taking this one as its result.
        sys.exit(0)
