"""One rank of an N-rank job, run alone on torch's fake process-group backend (collectives return at once, their
outputs unset): the real sharding plan, shard sizes, initialisation of this rank's shard, optimizer state, DCP
save plan and export part, each phase timed and measured beside the planner's prediction. What it cannot show:
communication time, and memory a collective's output would touch (the fake backend leaves it untouched)."""

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from fsdp_research.checkpoint.hf_export import export_dtype, write_parts
from fsdp_research.config.sizes import export_shard_size
from fsdp_research.distributed.context_parallel import split_of
from fsdp_research.distributed.mesh import Mesh, degrees, pipeline_rank
from fsdp_research.distributed.sharding import local_shard
from fsdp_research.distributed.tensor_parallel import sequence_parallel
from fsdp_research.errors import ConfigError
from fsdp_research.metrics.meters import reset_rss_peak, rss, rss_peak
from fsdp_research.model.assembly import apply_parallelism, planned_model
from fsdp_research.model.initialization import init_weights, materialize
from fsdp_research.optim.factory import build_optimizer
from fsdp_research.planner.format import GIB
from fsdp_research.planner.memory import memory
from fsdp_research.planner.run import run_settings
from fsdp_research.planner.summary import summarize
from fsdp_research.train.refusals import check_built, check_planned

# A forward and backward is run where its FLOPs (6 per parameter per token, embedding and head included) stay
# under this: some ten seconds on a CPU core.
FLOPS_BUDGET = 2e11


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's, all its threads
    rss_gib: float = 0.0  # resident at the phase's end
    peak_rss_gib: float = 0.0  # the phase's peak
    device_peak_gib: float | None = None  # allocated by torch on the device (CUDA)
    tensors: dict[str, int] = field(default_factory=dict)  # bytes this rank holds, by kind
    predicted: dict[str, int] = field(default_factory=dict)  # the planner's bytes for the same kinds
    note: str = ""


@contextlib.contextmanager
def measured(phases: list[Phase], name: str, device: torch.device) -> Iterator[Phase]:
    phase = Phase(name)
    reset_rss_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu = time.perf_counter(), time.process_time()
    yield phase
    phase.seconds = round(time.perf_counter() - start, 3)
    phase.cpu_seconds = round(time.process_time() - cpu, 3)
    phase.rss_gib, phase.peak_rss_gib = round(rss() / 2**30, 3), round(rss_peak() / 2**30, 3)
    if device.type == "cuda":
        phase.device_peak_gib = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    phases.append(phase)


def local_bytes(tensors) -> int:
    """The bytes of this rank's shards of the tensors (non-tensors skipped: an optimizer's step counts)."""
    return sum(local_shard(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def shard_checksum(model: torch.nn.Module) -> float:
    """The sum of this rank's shard values (float64): what ties a simulated rank to the same rank of a real run."""
    return sum(float(local_shard(p).detach().double().sum()) for p in model.parameters())


def _fits(cfg: DictConfig, model: torch.nn.Module, blocks: list[str]) -> tuple[bool, str]:
    """Whether one block's forward and backward, with the embedding and head, fits the budget; not where the
    blocks lie in several lists (the others' blocks would run too)."""
    if not blocks:
        return False, "skipped: no blocks"
    if len({path.rpartition(".")[0] for path in blocks}) > 1:
        return False, "skipped: the blocks are not one list"
    if sequence_parallel(cfg.parallel):  # its hooks split at the first block and gather after the last
        return False, "skipped: sequence parallel needs every block"
    tokens = cfg.trainer.micro_batch_size * cfg.data.seq_len // cfg.parallel.cp
    inside = {id(p) for path in blocks for p in model.get_submodule(path).parameters()}
    first = sum(p.numel() for p in model.get_submodule(blocks[0]).parameters())
    rest = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    flops = 6 * tokens * (first + rest)
    if flops > FLOPS_BUDGET:
        return False, f"skipped: {flops / 1e12:.1f} TFLOP over the budget ({FLOPS_BUDGET:.0e})"
    return True, f"{flops / 1e12:.1f} TFLOP, embedding and head included"


@contextlib.contextmanager
def _first_block_only(model: torch.nn.Module, blocks: list[str]) -> Iterator[None]:
    """The model with its first block alone in its block list (the families loop over the list they hold)."""
    parent_path = blocks[0].rpartition(".")[0]
    parent = model.get_submodule(parent_path)
    kept = list(parent)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    try:
        del parent[1:]
        if layers is not None:
            config.num_hidden_layers = 1
        yield
    finally:
        parent.extend(kept[1:])
        if layers is not None:
            config.num_hidden_layers = layers


def _forward_backward(cfg: DictConfig, model: torch.nn.Module, blocks: list[str], device: torch.device) -> None:
    tokens = torch.randint(0, 2, (cfg.trainer.micro_batch_size, cfg.data.seq_len), device=device)
    split, kwargs = split_of(model), {}
    if split:  # a cp rank's chunks of the sequence
        tokens, _, kwargs["position_ids"] = split.local(tokens, tokens)
    with _first_block_only(model, blocks), split.splitting() if split else contextlib.nullcontext():
        logits = model(input_ids=tokens, **kwargs).logits
        logits.float().logsumexp(-1).mean().backward()
    for p in model.parameters():
        p.grad = None


def _save_plan_bytes(model: torch.nn.Module, optimizer) -> tuple[int, int]:
    """(items, bytes) of this rank's DCP save plan of the model and optimizer state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    planner = DefaultSavePlanner()
    planner.set_up_planner({"model": model_state, "optim": optim_state}, None, dist.get_rank() == 0)
    plan = planner.create_local_plan()
    tensors = [item.tensor_data for item in plan.items if item.tensor_data is not None]
    return len(plan.items), sum(math.prod(t.chunk.sizes) * t.properties.dtype.itemsize for t in tensors)


def set_up_shard(cfg: DictConfig, hf_config, device: torch.device, phases: list[Phase]):
    """Plan, shard and initialise this rank's shard as the trainer does (model.assembly.shard_model's steps, from the
    config: no pretrained weights, no torch DDP; a collective), each phase measured into phases; returns the
    model, its plan and the planner's memory for it."""
    world, stage = dist.get_world_size(), pipeline_rank(cfg.parallel.pp)
    with measured(phases, "plan", device) as phase:
        model, plan = planned_model(cfg, hf_config, stage=stage)
        check_planned(cfg, model, plan, hf_config)
        phase.note = f"{len(plan.units)} units, {sum(p.numel() for p in model.parameters()):,} parameters"
    mem = memory(summarize(cfg, model, plan, hf_config, stage), run_settings(cfg, world, device.type, stage))  # untimed
    if device.type == "cpu":
        _check_host_holds(mem.sharded_params + mem.sharded_grads + mem.optimizer)
    with measured(phases, "shard", device):
        apply_parallelism(model, plan, cfg, Mesh(degrees(cfg, world), device.type))
    with measured(phases, "init", device) as phase:
        materialize(model, torch.device("cpu") if cfg.sharding.cpu_offload else device, device)
        init_weights(model, plan.blocks, cfg.trainer.seed)
        phase.tensors = {"params": local_bytes(model.parameters())}
        phase.predicted = {"params": mem.sharded_params}
    check_built(cfg, model, device)  # the trainer's check at start
    return model, plan, mem


def _schedule(cfg: DictConfig, world: int) -> Phase:
    """Pipeline parallel: this rank's stages in the schedule (its action list, as the planner reads it)."""
    run = run_settings(cfg, world, "cpu", pipeline_rank(cfg.parallel.pp))
    p = cfg.parallel
    note = (
        f"{p.pp_schedule}, {run.micro_steps} micro-batches over {p.pp} pipeline ranks: this one holds "
        f"{run.in_flight:g} micro-batches' activations at most; bubble {run.bubble:.1%} of the step"
    )
    return Phase("pipeline schedule", note=note)


def _check_host_holds(needed: int) -> None:
    """ConfigError where this rank's state (the planner's bytes) would not fit the host's available memory: the
    kernel's OOM killer would end the run without a word."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if needed > available:
        raise ConfigError(
            "world_size",
            f"this rank's parameter shards, gradients and optimizer state need {needed / GIB:.1f} GiB (planned), "
            f"the host has {available / GIB:.1f} GiB available",
            "simulate more ranks (a rank of a larger world_size holds less), or on a larger host",
        )


def simulate(cfg: DictConfig, hf_config, device: torch.device, scratch: str) -> tuple[list[Phase], float]:
    """The phases of this rank's set-up (the process group is the fake one, of the job's world size), and its
    shard's checksum after initialisation."""
    phases: list[Phase] = []
    model, plan, mem = set_up_shard(cfg, hf_config, device, phases)
    checksum = shard_checksum(model)
    with measured(phases, "optimizer", device) as phase:
        optimizer, _ = build_optimizer(model, cfg, plan.blocks)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        phase.tensors["grads"] = local_bytes(p.grad for p in model.parameters())
        optimizer.step()  # its state, as the first step makes it
        optimizer.zero_grad(set_to_none=True)
        phase.tensors["optimizer"] = local_bytes(v for s in optimizer.state.values() for v in s.values())
        phase.predicted = {"grads": mem.sharded_grads, "optimizer": mem.optimizer}
    if cfg.parallel.pp > 1:
        fits, phase_note = False, "not run: a pipeline stage's forward takes the stage before's output"
        phases.append(_schedule(cfg, dist.get_world_size()))
    else:
        fits, phase_note = _fits(cfg, model, plan.blocks)
    with measured(phases, "forward/backward (first block)", device) as phase:
        if fits:
            _forward_backward(cfg, model, plan.blocks, device)
        phase.note = phase_note
        phase.predicted = {"step peak, all blocks": mem.peak}  # not this phase's: the step the plan is for
    with measured(phases, "save plan", device) as phase:
        items, total = _save_plan_bytes(model, optimizer)
        phase.tensors = {"saved": total}
        phase.predicted = {"saved": mem.sharded_params + mem.optimizer}
        phase.note = f"{items} items"
    with measured(phases, "export", device) as phase:
        size, parts = export_shard_size(cfg.checkpoint.export_shard_size), os.path.join(scratch, "parts")
        write_parts(model, hf_config, parts, export_dtype(cfg), size)
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(parts) for f in files)
        phase.tensors = {"written": written}
        phase.note = "this rank's part" if written else "no group falls to this rank"
    return phases, checksum


def as_dict(phases: list[Phase]) -> list[dict]:
    return [asdict(p) for p in phases]
