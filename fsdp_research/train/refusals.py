"""Every check of a composed config that needs no compute, one function per config group: each raises
ConfigError naming the key and the fix. The trainer, the launcher (before it starts workers), the doctor
and the planner run the same checks."""

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from fsdp_research.callbacks.hooks import check_callbacks
from fsdp_research.config.data_schema import DataConfig, DataKind
from fsdp_research.config.schema import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    CheckpointMode,
    DistributedConfig,
    DoctorConfig,
    ModelConfig,
    PrecisionConfig,
    ShardingConfig,
    Strategy,
    TrainerConfig,
)
from fsdp_research.config.sizes import export_shard_size
from fsdp_research.config.targets import resolve
from fsdp_research.data.chat import check_chat
from fsdp_research.data.parts import first_file, probe
from fsdp_research.data.pipeline import check_tokenizer, eval_set_paths, packed, sources
from fsdp_research.data.tokenizer import check_model_tokenizer
from fsdp_research.distributed.activation_checkpointing import resolve_op
from fsdp_research.distributed.mesh import pipeline_rank
from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.precision import dtypes, parse_dtype
from fsdp_research.distributed.processes import backend_for
from fsdp_research.distributed.sharding import ShardingPlan
from fsdp_research.distributed.step_layout import layout
from fsdp_research.errors import ConfigError
from fsdp_research.metrics.hardware import GPUS
from fsdp_research.model.architecture import pretrained_dir
from fsdp_research.model.assembly import planned_model
from fsdp_research.model.dimensions import dims, max_positions
from fsdp_research.model.document_masking import check_document_masking, check_staged_document_masking
from fsdp_research.model.lora import check_lora
from fsdp_research.model.pretrained import check_weights
from fsdp_research.objectives import check_objective
from fsdp_research.optim import check_optim
from fsdp_research.optim.groups import check_patterns
from fsdp_research.planner.budget import parse_headroom
from fsdp_research.train.losses import check_chunked, check_loss
from fsdp_research.train.parallel_checks import check_parallel, check_parallel_planned
from fsdp_research.train.samples import check_samples


def check_trainer(t: TrainerConfig, world_size: int) -> None:
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_interval", "agree_every"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}", f"{t[key]} is below 1", f"set trainer.{key} to 1 or more")
    if t.preemption_grace_s < 0:
        raise ConfigError(
            "trainer.preemption_grace_s", f"{t.preemption_grace_s} is negative", "give the seconds until SIGKILL: 25"
        )
    if t.profile_steps < 0:
        raise ConfigError("trainer.profile_steps", f"{t.profile_steps} is negative", "use 0 (off) or a few steps")
    if t.detect_anomaly and t.compile:
        # Its hooks on every module would be traced into the compiled blocks' single graphs.
        raise ConfigError(
            "trainer.detect_anomaly", "cannot check the modules inside compiled blocks", "set trainer.compile=false"
        )
    unit = t.micro_batch_size * world_size
    if t.global_batch_size % unit:
        raise ConfigError(
            "trainer.global_batch_size",
            f"{t.global_batch_size} is not divisible by micro_batch_size x data-parallel size "
            f"({t.micro_batch_size} x {world_size} = {unit})",
            f"use a multiple of {unit}, or change trainer.micro_batch_size",
        )


def check_sources(cfg: DataConfig) -> None:
    """The data's sources and how their stores are built: what `fsdp-research tokenize` needs of a config."""
    if cfg.kind is DataKind.local_text:
        if cfg.sources and cfg.paths:
            raise ConfigError("data.sources", "a mixture is given and data.paths too", "give one of them")
        weights = [s.weight for s in sources(cfg)]
        if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
            raise ConfigError(
                "data.sources",
                f"weights {weights}: each must be 0 or more, one at least above 0",
                "set each source's weight to its share of the samples",
            )
        for source in sources(cfg):
            probe(first_file(source.paths, source.key), source.text_field)
    if cfg.kind.templated:
        check_chat(cfg)
    if cfg.build_workers < 0:
        raise ConfigError("data.build_workers", f"{cfg.build_workers} is negative", "use 0 (all cores) or N")


def _check_seq_len(cfg: DataConfig, limit: int | None) -> None:
    if cfg.seq_len < 1 or (limit and cfg.seq_len > limit):
        raise ConfigError(
            "data.seq_len",
            f"{cfg.seq_len} is not within the model's 1..{limit or 'any'} positions",
            f"set data.seq_len to {f'at most {limit}' if limit else '1 or more'}",
        )


def check_data_fits(cfg: DataConfig, vocab_size: int, limit: int | None) -> None:
    """The data against a model's vocabulary and positions (a model of one's own: once it is built)."""
    _check_seq_len(cfg, limit)
    check_tokenizer(cfg, vocab_size)


def check_data(cfg: DataConfig, t: TrainerConfig, hf_config) -> None:
    """hf_config None (a model of one's own): the fit to the model is checked when it is built."""
    _check_seq_len(cfg, max_positions(hf_config) if hf_config is not None else None)
    check_sources(cfg)
    if not 0 <= cfg.eval_fraction < 1:
        raise ConfigError("data.eval_fraction", f"{cfg.eval_fraction} is not in [0, 1)", "use e.g. 0.05")
    if cfg.max_windows < 0:
        raise ConfigError("data.max_windows", f"{cfg.max_windows} is negative", "use 0 (all) or a number of windows")
    if cfg.overfit_batches < 0:
        raise ConfigError(
            "data.overfit_batches", f"{cfg.overfit_batches} is negative", "use 0 (off) or the batches to repeat: 1"
        )
    if cfg.document_masking and cfg.kind is DataKind.synthetic:
        raise ConfigError("data.document_masking", "synthetic tokens have no documents", "leave it unset")
    if cfg.kind is DataKind.preference and cfg.document_masking is False:
        raise ConfigError(
            "data.document_masking", "false: a pair's two sequences would attend to each other", "leave it unset"
        )
    if not cfg.kind.templated:
        for key, paths in eval_set_paths(cfg).values():
            probe(first_file(paths, key), cfg.text_field)
    if cfg.eval_paths and cfg.eval_sources:
        raise ConfigError("data.eval_sources", "is given and data.eval_paths too", "give one of them")
    if t.eval_interval and cfg.eval_fraction <= 0 and not eval_set_paths(cfg):
        raise ConfigError(
            "trainer.eval_interval",
            "eval needs held-out data but data.eval_fraction is 0",
            "set data.eval_fraction above 0, or trainer.eval_interval=0",
        )
    if hf_config is not None:
        check_tokenizer(cfg, hf_config.vocab_size)


def check_offload_backend(cfg: ShardingConfig, backend: str) -> None:
    if cfg.cpu_offload and backend != "auto" and "gloo" not in backend:
        raise ConfigError(
            "distributed.backend",
            f"{backend} cannot reduce the CPU-resident gradients of sharding.cpu_offload",
            "use distributed.backend=auto (cuda:nccl,cpu:gloo on CUDA)",
        )


# Strategies whose blocks never reshard after forward (root_only: one unit, the root, kept for backward).
_NO_RESHARD = (Strategy.no_reshard, Strategy.ddp, Strategy.ddp_classic, Strategy.root_only)
# Strategies whose units are the blocks: what explicit prefetch names.
_BLOCK_UNITS = (Strategy.blockwise, Strategy.reshard_all, Strategy.no_reshard, Strategy.hsdp, Strategy.ddp)


def _check_reshard_value(key: str, value, shard_group: int) -> None:
    """true, false, or k: a divisor of the shard group strictly between 1 and it (FSDP2's reshard to k ranks)."""
    if isinstance(value, bool):
        return
    divisors = [k for k in range(2, shard_group) if shard_group % k == 0]
    if not isinstance(value, int) or value not in divisors:
        ints = f", or {' / '.join(map(str, divisors))} (divisors of it)" if divisors else ""
        raise ConfigError(
            key,
            f"{value!r} is not true, false or a group size dividing the shard group of {shard_group} rank(s)",
            f"use true, false{ints}",
        )


def check_sharding(cfg: ShardingConfig, world_size: int) -> None:
    strategy = Strategy(cfg.strategy)
    if strategy is Strategy.hsdp and (cfg.replicate < 1 or world_size % cfg.replicate):
        raise ConfigError(
            "sharding.replicate",
            f"{cfg.replicate} replica groups do not divide the world size {world_size}",
            "use a divisor of the world size",
        )
    shard_group = {Strategy.hsdp: world_size // cfg.replicate, Strategy.ddp: 1}.get(strategy, world_size)
    if cfg.reshard_after_forward is not None:
        if strategy in _NO_RESHARD:
            raise ConfigError(
                "sharding.reshard_after_forward",
                f"{strategy.value} reshards no block after forward, so it would be ignored",
                "use it with sharding=blockwise or reshard_all (or sharding.reshard_override per block)",
            )
        _check_reshard_value("sharding.reshard_after_forward", cfg.reshard_after_forward, shard_group)
    for index, value in cfg.reshard_override.items():
        _check_reshard_value(f"sharding.reshard_override.{index}", value, shard_group)
    for key in ("prefetch_forward", "prefetch_backward"):
        if cfg[key] < 0:
            raise ConfigError(f"sharding.{key}", f"{cfg[key]} is negative", "use 0 (FSDP2's implicit) or k blocks")
        if cfg[key] and strategy not in _BLOCK_UNITS:
            raise ConfigError(
                f"sharding.{key}",
                f"{strategy.value} has no block units to prefetch",
                f"use sharding.{key}=0, or sharding=blockwise",
            )


def check_precision(cfg: PrecisionConfig, device: torch.device) -> None:
    param, _ = dtypes(cfg)
    # Compute capability 8.0 (Ampere) and up computes bf16 natively; torch.cuda.is_bf16_supported() also says yes
    # where it is emulated (V100, T4), many times slower.
    if device.type == "cuda" and param is torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
        raise ConfigError(
            "precision",
            f"{torch.cuda.get_device_name(device)} cannot compute in bfloat16",
            "use precision=fp16 (or fp32)",
        )


def check_activation_checkpointing(cfg: ActivationCheckpointingConfig, strategy: Strategy) -> None:
    if cfg.stride < 0:
        raise ConfigError(
            "activation_checkpointing.stride",
            f"{cfg.stride} is negative",
            "use 0 (off), 1 (every block) or k (every k-th block)",
        )
    if cfg.mode is CheckpointMode.selective and cfg.stride and strategy is Strategy.per_linear:
        # Its replay of the block's ops meets per_linear's FSDP hooks inside the block, which it cannot replay.
        raise ConfigError(
            "activation_checkpointing",
            "selective checkpointing cannot recompute inside per_linear's FSDP units",
            "use activation_checkpointing=every_block with sharding=per_linear, or another sharding",
        )
    if cfg.mode is CheckpointMode.selective:
        for name in cfg.save_ops:
            resolve_op(name)
        if cfg.mm_save_every < 1:
            raise ConfigError(
                "activation_checkpointing.mm_save_every",
                f"{cfg.mm_save_every} is below 1",
                "use 1 (keep every matmul) or n (every n-th)",
            )


def check_optimizer_sharding(cfg: DictConfig, world_size: int) -> None:
    """torch's Adafactor reduces each matrix over its rows in place, which DTensor refuses for FSDP's row shards."""
    parts = [("optim", cfg.optim)] + ([("optim.others", cfg.optim.others)] if cfg.optim.others else [])
    adafactor = [key for key, node in parts if resolve(node._target_, f"{key}._target_") is torch.optim.Adafactor]
    if layout(cfg, world_size).shard_group > 1 and adafactor:
        raise ConfigError(
            adafactor[0],
            "torch.optim.Adafactor cannot step FSDP2's row shards (its in-place column reductions need whole rows)",
            "use sharding=ddp (replicated, exact), one rank, or another optimizer",
        )


def check_checkpoint(cfg: CheckpointConfig) -> None:
    export_shard_size(cfg.export_shard_size)
    if cfg.export_dtype is not None:
        parse_dtype(cfg.export_dtype, "checkpoint.export_dtype")


def check_doctor(cfg: DoctorConfig) -> None:
    if cfg.fit_gpu is not None and cfg.fit_gpu.lower() not in GPUS:
        raise ConfigError("doctor.fit_gpu", f"no GPU {cfg.fit_gpu!r} in the table", f"use one of {', '.join(GPUS)}")
    parse_headroom(cfg.fit_headroom, "doctor.fit_headroom")


def check_model(cfg: ModelConfig, hf_config) -> None:
    """A checkpoint to load must fit the model the config builds: every tensor there, of the same shape."""
    if cfg.moe.bias_update_rate < 0:
        raise ConfigError(
            "model.moe.bias_update_rate", f"{cfg.moe.bias_update_rate} is negative", "use 0 (off) or e.g. 0.001"
        )
    if cfg.load_weights:
        check_weights(hf_config, pretrained_dir(cfg.name_or_path))
    check_lora(cfg.lora, cfg.load_weights)


def check_distributed(cfg: DistributedConfig) -> None:
    if cfg.nproc_per_node < 1:
        raise ConfigError(
            "distributed.nproc_per_node", f"{cfg.nproc_per_node} is below 1", "use 1 or more processes on this machine"
        )
    if cfg.timeout_s <= 0:
        raise ConfigError("distributed.timeout_s", f"{cfg.timeout_s} is not a time to wait", "use e.g. 600")


def check_config(cfg: DictConfig, world_size: int, hf_config, device: torch.device) -> None:
    """The whole config, for a launch of world_size ranks on `device` (what needs the model: check_planned)."""
    check_distributed(cfg.distributed)
    check_parallel(cfg, world_size)
    p = cfg.parallel
    check_trainer(cfg.trainer, world_size // (p.tp * p.cp * p.pp))
    check_model(cfg.model, hf_config)
    check_data(cfg.data, cfg.trainer, hf_config)
    if cfg.data.kind is not DataKind.synthetic:
        check_model_tokenizer(cfg.data.tokenizer, cfg.model)
    check_sharding(cfg.sharding, world_size // (p.tp * p.pp))
    check_offload_backend(cfg.sharding, cfg.distributed.backend)
    backend_for(cfg.distributed.backend, device)
    check_precision(cfg.precision, device)
    check_activation_checkpointing(cfg.activation_checkpointing, Strategy(cfg.sharding.strategy))
    check_optim(cfg.optim, cfg.schedule)
    check_optimizer_sharding(cfg, world_size)
    check_loss(cfg.loss, packed(cfg.data))
    check_objective(cfg)
    check_callbacks(cfg.callbacks)
    check_checkpoint(cfg.checkpoint)
    check_samples(cfg)
    check_doctor(cfg.doctor)


def check_planned(cfg: DictConfig, model: nn.Module, plan: ShardingPlan, hf_config) -> None:
    """What needs the model planned on the meta device (fsdp_research.model.assembly.planned_model): a model of
    one's own against the data, and optim.param_groups' patterns against the parameters' names."""
    if hf_config is None:
        check_data_fits(cfg.data, dims(model, plan.blocks).vocab, None)
    check_parallel_planned(cfg, model)
    names = [clean_name(n) for n, p in model.named_parameters() if p.requires_grad]  # what the optimizer gets
    check_patterns(OmegaConf.to_container(cfg.optim.param_groups, resolve=True), names)


def check_built(cfg: DictConfig, model: nn.Module, device: torch.device) -> None:
    """What needs the sharded model's forward (a collective: every rank calls it): the chunked loss's output layer,
    packed documents kept apart."""
    check_chunked(model, cfg.loss, device)
    # Text windows always hold several documents; chat ones only when packed.
    several = cfg.data.kind is not DataKind.chat or cfg.data.packing
    if packed(cfg.data) and several and cfg.data.document_masking is not False:
        if cfg.parallel.pp > 1:
            check_staged_document_masking(model, cfg.trainer.micro_batch_size)
        else:
            check_document_masking(model, device, cfg.trainer.micro_batch_size)


def checked_plan(
    cfg: DictConfig, world_size: int, hf_config, device: torch.device, values: bool = True
) -> tuple[nn.Module, ShardingPlan]:
    """The config checked, then the model planned and checked against it: all a run refuses, before any
    allocation."""
    check_config(cfg, world_size, hf_config, device)
    stage = pipeline_rank(cfg.parallel.pp) if dist.is_initialized() else 0
    model, plan = planned_model(cfg, hf_config, values, stage)
    # Every stage's rank checks the whole model: a check no stage may fail alone (the others would wait for it).
    whole = (model, plan) if cfg.parallel.pp == 1 else planned_model(cfg, hf_config, False, None)
    check_planned(cfg, *whole, hf_config)
    return model, plan


def doubts(cfg: DictConfig, device: torch.device) -> list[str]:
    """What a config runs but most likely not as meant: warned at start, not refused."""
    found = []
    if not cfg.schedule.get("_target_") and cfg.schedule.warmup_steps >= cfg.trainer.max_steps:
        found.append(
            f"schedule.warmup_steps={cfg.schedule.warmup_steps} is at or past trainer.max_steps="
            f"{cfg.trainer.max_steps}: the whole run warms up and the lr never reaches optim.lr"
        )
    if device.type == "cpu" and dtypes(cfg.precision)[0] is torch.float16:
        found.append(
            "precision: fp16 on the CPU runs 6-10x slower than bf16 (no fast fp16 kernels): use precision=bf16"
        )
    return found
