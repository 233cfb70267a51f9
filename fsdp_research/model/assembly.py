"""The model as training runs it, in the order the recipe needs: on the meta device -> this rank's pipeline stage
(parallel.pp) -> activation checkpointing
-> compile -> tensor parallel (parallel.tp, on the wrapped modules' own paths) -> context parallel (parallel.cp)
-> expert parallel (parallel.ep) -> the sharding plan applied with
fully_shard (innermost first) -> this rank's shards materialized, initialised or read from a checkpoint -> torch's
DDP for the classic baseline."""

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.config.schema import Strategy
from fsdp_research.distributed.activation_checkpointing import apply_activation_checkpointing
from fsdp_research.distributed.compile import apply_compile
from fsdp_research.distributed.context_parallel import apply_cp
from fsdp_research.distributed.expert_parallel import apply_ep, split_experts
from fsdp_research.distributed.mesh import Mesh, degrees, pipeline_rank
from fsdp_research.distributed.pipeline import Pipeline, build_pipeline, split_stages
from fsdp_research.distributed.precision import build_mp_policy, dtypes, kept_in_fp32
from fsdp_research.distributed.sharding import ShardingPlan, apply_ddp, apply_fsdp, build_plan
from fsdp_research.distributed.step_layout import layout
from fsdp_research.distributed.tensor_parallel import apply_tp
from fsdp_research.model.architecture import block_class_name, build_model, build_own_model, find_blocks, pretrained_dir
from fsdp_research.model.initialization import init_weights, materialize
from fsdp_research.model.lora import apply_lora, base_view, init_adapters, store_frozen
from fsdp_research.model.lora import enabled as lora_enabled
from fsdp_research.model.pretrained import load_pretrained


def planned_model(
    cfg: DictConfig, hf_config, values: bool = True, stage: int | None = 0
) -> tuple[nn.Module, ShardingPlan]:
    """The model on the meta device (hf_config None: a model of one's own, built by its factory), prepared in the
    trainer's order (the stages of pipeline rank `stage`, None: the whole; activation checkpointing, compile), and
    its sharding plan: nothing allocated, no process group needed. Raises ConfigError for a block class the model
    does not have (the checks that need the planned model: train.refusals.checked_plan). values=False: shapes only,
    for the planner and the checks (see architecture.build_model)."""
    if hf_config is None:
        model = build_own_model(cfg.model, cfg.trainer.seed)
    else:
        model = build_model(hf_config, cfg.trainer.seed, values)
    block_class = block_class_name(model, cfg.model.block_class)  # of the whole model's list of layers
    if cfg.parallel.pp > 1 and stage is not None:
        split_stages(model, cfg.parallel, stage)
    if lora_enabled(cfg.model.lora):
        apply_lora(model, cfg.model.lora)
    fp32_modules = kept_in_fp32(model, dtypes(cfg.precision)[0])
    if lora_enabled(cfg.model.lora):
        store_frozen(model, dtypes(cfg.precision)[0], fp32_modules)
    blocks = find_blocks(model, block_class)
    # Before sharding, so that FSDP shards the wrapped block; compile too, so FSDP's hooks stay outside it.
    blocks = apply_activation_checkpointing(model, blocks, cfg.activation_checkpointing)
    apply_compile(blocks, cfg.trainer.compile)
    return model, build_plan(model, blocks, cfg.sharding, fp32_modules, split_experts(model, cfg.parallel.ep))


def apply_parallelism(model: nn.Module, plan: ShardingPlan, cfg: DictConfig, mesh: Mesh) -> None:
    """Tensor parallel on the mesh's tp dimension, attention split over cp ranks, the experts over ep ranks, then
    fully_shard over the data-parallel dimensions (the model may still be on the meta device)."""
    if cfg.parallel.tp > 1:  # before FSDP shards the same parameters over the data-parallel ranks
        apply_tp(model, list(plan.blocks), mesh.tp, cfg.parallel)
    if cfg.parallel.cp > 1:
        apply_cp(model, mesh.context)
    experts = None
    if cfg.parallel.ep > 1:
        ep, experts = mesh.experts
        apply_ep(model, [u.path for u in plan.units if u.experts], ep)
    apply_fsdp(model, plan, mesh.fsdp, build_mp_policy(cfg.precision), cfg.sharding, experts)


def shard_model(model: nn.Module, plan: ShardingPlan, cfg: DictConfig, device: torch.device, mesh: Mesh) -> nn.Module:
    """A planned model sharded, materialized and filled on this rank (a collective: every rank calls it)."""
    apply_parallelism(model, plan, cfg, mesh)
    materialize(model, torch.device("cpu") if cfg.sharding.cpu_offload else device, device)
    if cfg.model.load_weights:
        with base_view(model):  # the checkpoint's names: the adapted layers' base layers in their places
            load_pretrained(model, pretrained_dir(cfg.model.name_or_path), mesh.stage_group)
        init_adapters(model, cfg.trainer.seed)
        # transformers puts loaded buffers (a router's expert bias) beside the parameters: the CPU under offload.
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None and buf.device != device:
                    module._buffers[name] = buf.to(device)
    else:
        init_weights(model, plan.blocks, cfg.trainer.seed)
    return apply_ddp(model, device) if plan.strategy is Strategy.ddp_classic else model


def shard_stages(
    model: nn.Module, plan: ShardingPlan, cfg: DictConfig, device: torch.device, whole: nn.Module
) -> tuple[nn.Module, Pipeline | None]:
    """shard_model over the config's mesh, and the Pipeline of this rank's stages (parallel.pp > 1; None without);
    `whole`: the whole model as planned, whose tied embeddings every rank sees (a collective: every rank calls it)."""
    world = dist.get_world_size()
    mesh = Mesh(degrees(cfg, world), device.type)
    model = shard_model(model, plan, cfg, device, mesh)
    return model, build_pipeline(model, whole, cfg.parallel, layout(cfg, world), mesh, device)


def build_sharded_model(
    cfg: DictConfig, hf_config, device: torch.device, world_size: int
) -> tuple[nn.Module, ShardingPlan]:
    model, plan = planned_model(cfg, hf_config, stage=pipeline_rank(cfg.parallel.pp))
    return shard_model(model, plan, cfg, device, Mesh(degrees(cfg, world_size), device.type)), plan
