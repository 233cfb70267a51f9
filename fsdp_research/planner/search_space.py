"""What plan --fit searches: each knob's values worth planning for a config (pipeline, tensor, expert and context
parallel sizes, the shardings, activation checkpointing, micro-batches, prefetch depth, cpu_offload, loss chunks),
each refused combination left out as the trainer would refuse it, and their combinations for each pipeline rank."""

import itertools
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from omegaconf import DictConfig

from fsdp_research.config.targets import resolve
from fsdp_research.data.pipeline import packed
from fsdp_research.distributed.context_parallel import SPLITTABLE, unsplittable
from fsdp_research.distributed.pipeline import split_tested
from fsdp_research.distributed.tensor_parallel import STYLES
from fsdp_research.model.lora import enabled as lora_enabled
from fsdp_research.planner.pipeline import PipelineShape, pipeline_shape
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary

# activation_checkpointing options: the group's option name, the summary's checkpointed blocks and selective mode.
CHECKPOINTING = {"none": (0, 0), "every_block": (1, 0), "every_2nd": (2, 0), "selective": (1, 2)}
PREFETCH = (0, 1, 2)
CHUNKS = (1, 8)
# Config attributes of families that change their logits after the output layer: no chunks for them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


# Tensor-parallel sizes searched (within a node; sequence parallel on with it).
TP = (1, 2, 4, 8)
# Expert-parallel sizes searched (an MoE; dividing the shard dimension and the experts).
EP = (1, 2, 4, 8, 16, 32, 64)
# Pipeline sizes searched: one stage a rank (1F1B, or GPipe where the base names it), the schedules whose stages'
# memory the tracker holds (tests/planner/test_plan.py); with tp and the shardings pipeline parallel takes.
PP = (1, 2, 4, 8)
# Context-parallel sizes searched (tp x cp within a node), for sequences of LONG tokens or more: shorter ones'
# activations are small beside the rest, and the search would take 4 times as long.
CP = (1, 2, 4, 8)
LONG = 8192
# Config attributes naming an MoE layer's routed experts.
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shardings(world: int, per_node: int, pp: int) -> Iterator[dict[str, Any]]:
    """The sharding keys of every sharding worth searching over `world` data-parallel ranks (pipeline parallel takes
    blockwise and hsdp)."""
    for strategy in ("blockwise", "reshard_all", "no_reshard") if pp == 1 else ("blockwise",):
        yield {"strategy": strategy}
    for replicas in divisors(world)[1:-1]:
        yield {"strategy": "hsdp", "replicate": replicas}
    for k in divisors(world)[1:-1] if pp == 1 else []:
        if k <= per_node:
            yield {"strategy": "blockwise", "reshard_after_forward": k}


def pp_sizes(cfg: DictConfig, hf_config, world: int) -> list[int]:
    """The pp sizes worth searching: dividing the world, for a family split-tested for stages, on a config pipeline
    parallel takes (train.parallel_checks refuses LoRA, CPU offload, callbacks, loss scaling, anomaly checks,
    samples and the chunked loss with it, and compile with the zero-bubble schedules, which --fit does not search;
    a test holds every pick to those checks). A split the model's layers refuse (check_split) is left out when its
    stages are built."""
    refused = (
        lora_enabled(cfg.model.lora),
        cfg.sharding.cpu_offload,
        bool(cfg.callbacks),
        cfg.precision.loss_scaling,
        cfg.trainer.detect_anomaly,
        bool(cfg.trainer.sample_prompts),
        not _objective_takes(cfg, "pipelines"),  # its loss from the last stage's logits
    )
    if hf_config is None or not split_tested(hf_config) or any(refused):
        return [1]
    return [p for p in PP if not world % p]


def tp_sizes(cfg: DictConfig, hf_config, world: int, per_node: int) -> list[int]:
    """The tp sizes worth searching: within a node, dividing the world, the heads, the KV heads, the MLP width and
    the sequence (sequence parallel), for a family with a plan (a model of one's own: none)."""
    plan = getattr(hf_config, "base_model_tp_plan", None) or cfg.parallel.tp_plan
    sizes = [getattr(hf_config, k, 0) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")]
    if not plan or not set(plan.values()) <= set(STYLES) or cfg.sharding.cpu_offload or cfg.model.lora.r is not None:
        return [1]
    return [
        t for t in TP if t <= per_node and not world % t and not cfg.data.seq_len % t and not any(s % t for s in sizes)
    ]


def ep_sizes(cfg: DictConfig, hf_config, world: int, tp: int, keys: dict[str, Any]) -> list[int]:
    """The ep sizes worth searching for a sharding: an MoE's, without tp, CPU offload or LoRA, dividing its shard
    dimension and its experts."""
    experts = next((n for k in _EXPERTS if isinstance(n := getattr(hf_config, k, None), int)), 0)
    if not experts or tp > 1 or cfg.sharding.cpu_offload or cfg.model.lora.r is not None:
        return [1]
    shard = world // tp // keys.get("replicate", 1) if keys["strategy"] != "ddp" else 1
    return [e for e in EP if not shard % e and not experts % e]


def cp_sizes(cfg: DictConfig, hf_config, world: int, tp: int, keys: dict[str, Any], per_node: int) -> list[int]:
    """The cp sizes worth searching for a sharding: long sequences of a family whose attention splits, on windows of
    tokens, without CPU offload or LoRA; tp x cp within a node, cp dividing the shard dimension, the heads per tp
    rank, the sequence in 2 x cp chunks (and tp x cp shards) and the global batch over the data-parallel ranks
    left."""
    seq, heads = cfg.data.seq_len, getattr(hf_config, "num_attention_heads", 0)
    if seq < LONG or not heads or packed(cfg.data) or unsplittable(hf_config, seq):
        return [1]
    if not _objective_takes(cfg, "splits_sequences"):
        return [1]
    attention = getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if attention not in SPLITTABLE or cfg.trainer.compile or cfg.sharding.cpu_offload or cfg.model.lora.r is not None:
        return [1]
    shard, batch = world // tp // keys.get("replicate", 1), cfg.trainer.global_batch_size
    return [
        c
        for c in CP
        if tp * c <= per_node
        and not (shard % c or (heads // tp) % c or seq % (2 * c * tp) or batch % max(1, world // tp // c))
    ]


def _checkpointed(n_blocks: int, stride: int) -> tuple[bool, ...]:
    return tuple(stride > 0 and i % stride == 0 for i in range(n_blocks))


def _objective_takes(cfg: DictConfig, flag: str) -> bool:
    """Whether the run's objective takes what a knob changes (objectives.Objective's flags: cp's chunks of each
    sequence, the loss group's chunks): --fit searches only what the run would not refuse."""
    return bool(getattr(resolve(cfg.objective._target_, "objective._target_"), flag, False))


def chunkable(cfg: DictConfig, hf_config) -> tuple[int, ...]:
    transforms = any(getattr(hf_config, key, None) for key in _LOGIT_TRANSFORMS)
    lm = _objective_takes(cfg, "uses_loss_group")
    return (1,) if cfg.loss.get("_target_") or transforms or not lm else CHUNKS


def _pipelined(run: Run, shape: PipelineShape | None, stage: int) -> dict[str, Any]:
    """A pipeline rank's share of the schedule's shape (none without stages)."""
    return dict(in_flight=shape.in_flight[stage], losses=shape.losses, bubble=shape.bubble) if shape else {}


def variants(
    stages: list[tuple[ModelSummary, Run]],
    per_rank: int,
    chunks: tuple[int, ...],
    offloads: tuple[bool, ...],
    schedule: str,
) -> Iterator[tuple[list[tuple[ModelSummary, Run]], dict[str, Any]]]:
    """Each knob's combination, as (each pipeline rank's summary and run: one without stages, the settings)."""
    pp, blocks = stages[0][1].pp, min(m.n_blocks for m, _ in stages)
    for option, (stride, selective) in CHECKPOINTING.items():
        ckpts = [
            replace(m, checkpointed=_checkpointed(m.n_blocks, stride), selective_every=selective) for m, _ in stages
        ]
        for micro, depth, offload, chunk in itertools.product(
            divisors(per_rank), [d for d in PREFETCH if d < blocks], offloads, chunks
        ):
            if per_rank // micro < pp:  # fewer micro-batches than stages: refused
                continue
            shape = pipeline_shape(schedule, pp, per_rank // micro, 1) if pp > 1 else None
            planned = [
                replace(
                    run,
                    micro_batch=micro,
                    micro_steps=per_rank // micro,
                    prefetch_forward=depth,
                    prefetch_backward=depth,
                    cpu_offload=offload,
                    foreach=run.foreach and not offload,
                    loss_chunks=chunk,
                    **_pipelined(run, shape, stage),
                )
                for stage, (_, run) in enumerate(stages)
            ]
            settings = {
                "activation_checkpointing": option,
                "trainer.micro_batch_size": micro,
                "sharding.prefetch_forward": depth,
                "sharding.prefetch_backward": depth,
                "sharding.cpu_offload": offload,
                "loss.chunks": chunk,
            }
            yield list(zip(ckpts, planned)), settings
