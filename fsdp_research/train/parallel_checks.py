"""The checks of the parallel axes (parallel.tp, .ep, .cp) against the rest of the config and the planned model:
what combines is what the tests train against the single-process reference; the rest is refused in one line."""

import torch
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.config.schema import Strategy
from fsdp_research.data.pipeline import packed
from fsdp_research.distributed.context_parallel import check_cp
from fsdp_research.distributed.expert_parallel import check_ep
from fsdp_research.distributed.pipeline import SCHEDULES, zero_bubble
from fsdp_research.distributed.precision import dtypes
from fsdp_research.distributed.step_layout import layout
from fsdp_research.distributed.tensor_parallel import check_divisible, sequence_parallel, tp_plan
from fsdp_research.errors import ConfigError
from fsdp_research.model.lora import enabled as lora_enabled

# With tp > 1, what is tested so far (tests/distributed/test_tensor_parallel.py); the rest is refused.
_TP_STRATEGIES = (
    Strategy.blockwise,
    Strategy.reshard_all,
    Strategy.no_reshard,
    Strategy.root_only,
    Strategy.per_linear,
    Strategy.hsdp,
    Strategy.ddp,
)


_PP_STRATEGIES = (Strategy.blockwise, Strategy.hsdp)


def _refuse(refused: list[tuple[str, bool, str]], fix: str) -> None:
    for key, bad, reason in refused:
        if bad:
            raise ConfigError(key, reason, fix)


def check_parallel(cfg: DictConfig, world_size: int) -> None:
    p = cfg.parallel
    if p.tp < 1 or world_size % p.tp:
        raise ConfigError("parallel.tp", f"{p.tp} does not divide the world size {world_size}", "use a divisor")
    if p.pp != 1:
        check_pipeline_parallel(cfg, world_size)
    elif p.pp_split_points:
        raise ConfigError("parallel.pp_split_points", "split points without pipeline stages", "drop them, or set pp")
    if p.cp != 1:
        check_context_parallel(cfg, world_size)
    if p.ep != 1:
        check_expert_parallel(cfg, world_size)
    if p.tp == 1:
        return
    strategy = Strategy(cfg.sharding.strategy)
    refused = [
        ("sharding", strategy not in _TP_STRATEGIES, f"{strategy.value} with tensor parallel is not supported yet"),
        ("sharding.cpu_offload", cfg.sharding.cpu_offload, "CPU offload with tensor parallel is not supported yet"),
        ("model.lora", lora_enabled(cfg.model.lora), "LoRA with tensor parallel is not supported yet"),
    ]
    _refuse(refused, "use parallel.tp=1")
    # Each cp rank's part of the sequence is split over the tp ranks.
    if sequence_parallel(p) and cfg.data.seq_len % (p.tp * p.cp):
        raise ConfigError(
            "parallel.sequence_parallel",
            f"data.seq_len={cfg.data.seq_len} does not split into {p.tp * p.cp} sequence shards",
            f"use a data.seq_len divisible by {p.tp * p.cp}, or parallel.sequence_parallel=false",
        )


def _check_divides_shard(cfg: DictConfig, world_size: int, key: str, n: int) -> None:
    shard = layout(cfg, world_size).shard_group
    if n < 1 or shard % n:
        raise ConfigError(
            key,
            f"{n} does not divide the {shard} ranks of the shard dimension (world {world_size} / tp / replicas)",
            "use a divisor of it",
        )


def check_expert_parallel(cfg: DictConfig, world_size: int) -> None:
    p, classic = cfg.parallel, Strategy(cfg.sharding.strategy) is Strategy.ddp_classic
    refused = [
        ("parallel.tp", p.tp > 1, "expert parallel with tensor parallel is not supported yet"),
        ("sharding", classic, "ddp_classic with expert parallel is not supported"),
        ("sharding.cpu_offload", cfg.sharding.cpu_offload, "CPU offload with expert parallel is not supported yet"),
        ("model.lora", lora_enabled(cfg.model.lora), "LoRA with expert parallel is not supported yet"),
        # Its dispatch reads the token counts on the host: a graph break and new shapes every step.
        ("trainer.compile", cfg.trainer.compile, "torch.compile with expert parallel is not supported yet"),
    ]
    _refuse(refused, "use parallel.ep=1")
    _check_divides_shard(cfg, world_size, "parallel.ep", p.ep)
    # torch 2.13 divides a lone rank's gradients by the factor as well as by its pre/post factors of fp16.
    reduce = dtypes(cfg.precision)[1]
    if layout(cfg, world_size).shard_group == p.ep and reduce not in (torch.float32, torch.bfloat16):
        raise ConfigError(
            "precision.reduce_dtype",
            f"{reduce} with parallel.ep={p.ep} leaves each expert one data-parallel rank, where torch divides its "
            "gradients twice",
            "use precision.reduce_dtype=float32 (or bfloat16), or more data-parallel ranks than ep",
        )


def check_pipeline_parallel(cfg: DictConfig, world_size: int) -> None:
    p = cfg.parallel
    if p.pp < 1 or world_size % (p.pp * p.tp):  # first: the layout below divides by it
        raise ConfigError(
            "parallel.pp", f"{p.pp} does not divide the world size {world_size} (with tp {p.tp})", "use a divisor"
        )
    if p.pp_schedule not in SCHEDULES:
        raise ConfigError("parallel.pp_schedule", f"{p.pp_schedule!r} is unknown", f"use one of {', '.join(SCHEDULES)}")
    _check_pipeline_schedule(cfg)
    strategy = Strategy(cfg.sharding.strategy)
    refused = [
        # Sequence parallel splits the residual stream at the rank's first block and gathers it at its last: with
        # several stages a rank, a stage's first block may be neither.
        (
            "parallel.sequence_parallel",
            SCHEDULES[p.pp_schedule] != 1 and p.tp > 1 and sequence_parallel(p),
            f"with {p.pp_schedule}'s several stages a rank is not supported yet",
        ),
        ("parallel.cp", p.cp > 1, "context parallel with pipeline parallel is not supported yet"),
        ("parallel.ep", p.ep > 1, "expert parallel with pipeline parallel is not supported yet"),
        # What is tested with pp (tests/distributed/test_pipeline.py).
        ("sharding", strategy not in _PP_STRATEGIES, f"{strategy.value} with pipeline parallel is not supported yet"),
        ("sharding.cpu_offload", cfg.sharding.cpu_offload, "CPU offload with pipeline parallel is not supported yet"),
        ("model.lora", lora_enabled(cfg.model.lora), "LoRA with pipeline parallel is not supported yet"),
        ("loss.chunks", cfg.loss.chunks > 1, "the chunked loss with pipeline parallel is not supported yet"),
        # Theirs see a stage's part of the model on each rank (per-layer norms, averages, spike checks).
        ("callbacks", bool(cfg.callbacks), "callbacks with pipeline parallel are not supported yet"),
        ("precision", cfg.precision.loss_scaling, "fp16's loss scaling with pipeline parallel is not supported yet"),
        # Its checks run collectives within a stage's forward, which the other stages never join.
        (
            "trainer.detect_anomaly",
            cfg.trainer.detect_anomaly,
            "anomaly checks with pipeline parallel are not supported yet",
        ),
    ]
    _refuse(refused, "use parallel.pp=1")
    # Samples generate token by token through the whole model.
    if cfg.trainer.sample_prompts:
        raise ConfigError(
            "trainer.sample_prompts", "samples through the pipeline are not supported yet", "leave it unset"
        )
    _check_pipeline_micro_batches(p, layout(cfg, world_size).micro_steps)


def _check_pipeline_schedule(cfg: DictConfig) -> None:
    """The schedule's stages a rank, and what it does not take (eval through a V; compile and selective
    checkpointing with the zero-bubble ones)."""
    p = cfg.parallel
    per_rank = SCHEDULES[p.pp_schedule]
    if (p.pp_stages_per_rank < 2) if per_rank == "looped" else (p.pp_stages_per_rank != per_rank):
        runs, fix = {
            1: ("one stage", "use 1, or parallel.pp_schedule=Interleaved1F1B"),
            2: ("exactly 2 stages (a V)", "use 2"),
            "looped": ("several stages", "use 2 or more"),
        }[per_rank]
        raise ConfigError(
            "parallel.pp_stages_per_rank", f"{p.pp_stages_per_rank} with {p.pp_schedule}, which runs {runs} a rank", fix
        )
    # torch 2.13's V schedules cannot run forwards alone (their eval asks a stage without a backward for one).
    if per_rank == 2 and cfg.trainer.eval_interval:
        raise ConfigError(
            "trainer.eval_interval",
            f"eval through {p.pp_schedule} is not supported yet (torch's V schedules have no forward-only pass)",
            "use trainer.eval_interval=0, or parallel.pp_schedule=InterleavedZeroBubble",
        )
    # torch refuses them with compiled stage modules; the blocks' compiled forwards here slip past its check.
    if zero_bubble(p) and cfg.trainer.compile:
        raise ConfigError(
            "trainer.compile",
            f"torch.compile with {p.pp_schedule} is not supported (torch's zero-bubble schedules refuse compiled "
            "stages)",
            "use trainer.compile=false, or parallel.pp_schedule=1F1B",
        )
    # Their weight pass is a second backward through a block, which recomputes it: selective checkpointing refuses.
    if zero_bubble(p) and cfg.activation_checkpointing.mode == "selective":
        raise ConfigError(
            "activation_checkpointing",
            f"selective checkpointing with {p.pp_schedule} is not supported (its weight pass backs through a block "
            "a second time)",
            "use activation_checkpointing=every_block, or parallel.pp_schedule=Interleaved1F1B",
        )


def _check_pipeline_micro_batches(p: DictConfig, micro: int) -> None:
    """A step's micro-batches per data-parallel rank (`micro`) against the pipeline's ranks and schedule."""
    if 0 < micro < p.pp:  # none: the batch check says why
        raise ConfigError(
            "trainer.micro_batch_size",
            f"{micro} micro-batches a step are fewer than the pipeline's {p.pp} ranks",
            "use a smaller micro_batch_size or a larger global_batch_size",
        )
    rounds = max(1, micro // p.pp)  # torch's interleaved schedules run the micro-batches in rounds of equal size
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and micro % rounds:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"{micro} micro-batches a step do not divide into {p.pp_schedule}'s {rounds} rounds",
            f"use a multiple of {p.pp} micro-batches a step",
        )
    if p.pp_schedule == "DualPipeV" and 0 < micro < 2 * p.pp:
        raise ConfigError(
            "trainer.micro_batch_size",
            f"{micro} micro-batches a step are fewer than DualPipeV's {2 * p.pp} stages",
            "use a smaller micro_batch_size or a larger global_batch_size",
        )


def check_context_parallel(cfg: DictConfig, world_size: int) -> None:
    p, strategy = cfg.parallel, Strategy(cfg.sharding.strategy)
    if p.cp < 1 or (world_size // p.tp) % p.cp:  # first: the layout below divides by it
        raise ConfigError(
            "parallel.cp",
            f"{p.cp} does not divide the {world_size // p.tp} ranks of world {world_size} / tp",
            "use a divisor",
        )
    refused = [
        ("sharding", strategy in (Strategy.ddp, Strategy.ddp_classic), f"{strategy.value} with cp is not supported"),
        ("sharding.cpu_offload", cfg.sharding.cpu_offload, "CPU offload with context parallel is not supported yet"),
        ("model.lora", lora_enabled(cfg.model.lora), "LoRA with context parallel is not supported yet"),
        ("trainer.compile", cfg.trainer.compile, "torch.compile with context parallel is not supported yet"),
        # The split attention is causal over the whole window: documents packed into it would see each other.
        ("data", packed(cfg.data), "packed documents (chat data, document masking) are not split by cp yet"),
    ]
    _refuse(refused, "use parallel.cp=1")
    _check_divides_shard(cfg, world_size, "parallel.cp", p.cp)
    if cfg.data.seq_len % (2 * p.cp):
        raise ConfigError(
            "parallel.cp",
            f"data.seq_len={cfg.data.seq_len} does not split into 2 x cp = {2 * p.cp} chunks",
            f"use a data.seq_len divisible by {2 * p.cp}",
        )


def check_parallel_planned(cfg: DictConfig, model: nn.Module) -> None:
    """The planned model against the axes: tp's splits, ep's experts, cp's attention."""
    p = cfg.parallel
    if p.tp > 1:
        check_divisible(model, tp_plan(model, p), p.tp)
    if p.ep > 1:
        check_ep(model, p.ep)
    if p.cp > 1:
        check_cp(model, p.cp, p.tp, cfg.data.seq_len)
