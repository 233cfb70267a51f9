"""Config schemas. Each group's YAML in conf/<group>/ is merged onto these dataclasses, so a typo'd key,
a wrong type or an unknown enum value fails at composition, before any process group or model exists.
A leaf: imports nothing of ours but its parts, data_schema and plugin_schema (the Hydra wiring that registers these
is fsdp_research.jobs.compose)."""

import functools
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

# The data group's schema lives in data_schema; its names stay importable from here, where they were.
from fsdp_research.config.data_schema import DataConfig, DataKind, LossOn, SourceConfig, Truncation  # noqa: F401

# The plug-in groups' schemas (optim, schedule, loss, objective) live in plugin_schema; importable from here too.
from fsdp_research.config.plugin_schema import (  # noqa: F401
    DecayShape,
    LossConfig,
    ObjectiveConfig,
    OptimConfig,
    ScheduleConfig,
    ScheduleName,
)


@dataclass
class LoraSettings:
    """model.lora: PEFT's LoRA on the pretrained weights (the base frozen), on once r is set."""

    # The adapters' rank; null: no LoRA, every weight trains.
    r: int | None = None
    alpha: float = 16.0
    dropout: float = 0.0
    # Module names (a list), a regex (a string), or "all-linear" (every Linear but the output layer).
    target_modules: Any = "all-linear"
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class MoeConfig:
    # Aux-loss-free balancing (DeepSeek-V3): after each step every router's expert bias (e_score_correction_bias)
    # moves by this rate x sign(mean load - the expert's load), over the whole data-parallel batch; 0 turns it off.
    bias_update_rate: float = 0.001


@dataclass
class ModelConfig:
    name: str = "llama_tiny"
    # Any model: a factory (class or function) returning an nn.Module whose forward(input_ids=...) returns something
    # with .logits; its other keys here are the factory's keyword arguments, model.block_class names its block.
    _target_: str | None = None
    # A hub id or local directory: its config.json (and, for `pretrained`, its weights) are used.
    name_or_path: str | None = None
    # Used when name_or_path is unset: AutoConfig.for_model(model_type, **config).
    model_type: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    load_weights: bool = False
    # The repeating block class(es, comma-separated); default: the decoder's layers (architecture.block_class_name).
    block_class: str | None = None
    moe: MoeConfig = field(default_factory=MoeConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)


class Strategy(str, Enum):
    blockwise = "blockwise"
    reshard_all = "reshard_all"
    no_reshard = "no_reshard"
    root_only = "root_only"
    per_linear = "per_linear"
    ddp = "ddp"
    ddp_classic = "ddp_classic"
    hsdp = "hsdp"


@dataclass
class ShardingConfig:
    strategy: Strategy = Strategy.blockwise
    # hsdp: number of replica groups; each shards over world_size / replicate ranks.
    replicate: int = 1
    cpu_offload: bool = False
    # null: the strategy's. true, false, or an int k (FSDP2 reshards to groups of k ranks after forward: the blocks'
    # parameters stay sharded over k ranks, e.g. a node, until backward regathers them from there) for every block
    # the strategy reshards (blockwise: all but the last).
    reshard_after_forward: Any = None
    # Block index -> reshard_after_forward (true, false or k), overriding the above for those blocks.
    reshard_override: dict[int, Any] = field(default_factory=dict)
    # Blocks all-gathered ahead: 0, FSDP2's implicit prefetch (the next block in backward); k, the next k blocks
    # (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch): more overlap, k blocks more memory.
    prefetch_forward: int = 0
    prefetch_backward: int = 0


@dataclass
class ParallelConfig:
    # Tensor parallel: ranks each block's Linears are split over (innermost in the mesh: one node's devices);
    # the data-parallel ranks are world / tp.
    tp: int = 1
    # With tp > 1: each block's norms and residual stream on sequence shards; null: on when tp > 1.
    sequence_parallel: bool | None = None
    # Module pattern (as transformers' base_model_tp_plan: relative to the base model, `*` a layer's index) ->
    # colwise, rowwise, colwise_gather_output, rowwise_split_input, or none; over the family's own plan.
    tp_plan: dict[str, str] = field(default_factory=dict)
    # Expert parallel: ranks each MoE layer's routed experts are split over (tokens sent to them by all-to-all);
    # a divisor of the data-parallel shard dimension, whose ranks they are.
    ep: int = 1
    # Context parallel: ranks each sequence is split over (2 x cp chunks, attention gathered by all-to-all over
    # heads); the inner part of the shard dimension (dp_shard x cp), the data-parallel ranks world / tp / cp.
    cp: int = 1
    # Pipeline parallel: stages the model's layers are split over (the outermost axis: across nodes), each stage
    # fully_shard-ed over its own data-parallel ranks (world / pp / tp / cp); a step's micro-batches flow through
    # them by pp_schedule (torch.distributed.pipelining's: GPipe, 1F1B, ...).
    pp: int = 1
    pp_schedule: str = "1F1B"
    # Stages on each rank: 1 for GPipe and 1F1B (the looped and V schedules hold more).
    pp_stages_per_rank: int = 1
    # Where the stages after the first begin (torchtitan's pipeline_parallel_split_points): layer names, layers.4,
    # ..., one fewer than the stages; empty: the units (embedding, layers, head) split as evenly as they divide.
    pp_split_points: list[str] = field(default_factory=list)


@dataclass
class PrecisionConfig:
    name: str = "bf16"
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    # Dynamic loss scaling (fp16 only needs it: bf16 has fp32's exponent range).
    loss_scaling: bool = False
    init_scale: float = 65536.0
    growth_interval: int = 200


class CheckpointMode(str, Enum):
    full = "full"
    selective = "selective"


@dataclass
class ActivationCheckpointingConfig:
    # 0: off; 1: every block; k: every k-th block (blocks 0, k, 2k, ...).
    stride: int = 0
    # full: a checkpointed block keeps its input only and recomputes its forward in backward; selective: it also
    # keeps the outputs of save_ops (op level, torch.utils.checkpoint's selective checkpointing) and recomputes the
    # rest: more memory than full, less recompute.
    mode: CheckpointMode = CheckpointMode.full
    # selective: torch operators (namespace.name, as in torch.ops) whose outputs are kept: matmuls, attention (SDPA's
    # kernels), collectives, as torchtitan keeps them.
    save_ops: list[str] = field(
        default_factory=lambda: [
            "aten.mm",
            "aten._scaled_dot_product_efficient_attention",
            "aten._scaled_dot_product_flash_attention",
            "aten._scaled_dot_product_cudnn_attention",
            "aten._scaled_dot_product_flash_attention_for_cpu",
            "_c10d_functional.reduce_scatter_tensor",
        ]
    )
    # selective: of the aten.mm outputs, keep the 1st, (1+n)-th, ... and recompute the others (torchtitan: 2).
    mm_save_every: int = 2


@dataclass
class LoggerConfig:
    kind: str = "wandb"
    project: str = "fsdp_research"
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    # offline unless set: runs with no account; `wandb sync` uploads later.
    mode: str = "offline"


# Whether a sweep minimizes or maximizes the metrics the framework logs (an eval set's eval_loss/<name> as
# eval_loss); for any other trainer.sweep_metric, hydra.sweeper.direction says.
DIRECTIONS = {"eval_loss": "minimize", "loss": "minimize", "tokens_per_s": "maximize"}


def sweep_direction(metric: str) -> str | None:
    return DIRECTIONS.get("eval_loss" if metric.startswith("eval_loss/") else metric)


def swept(metric: str, old: str | None) -> tuple[str, str]:
    """(the metric a sweep reads, the key it comes from): trainer.sweep_metric, or its deprecated name's value
    (trainer.objective) where sweep_metric is left at its default."""
    if old is not None and metric == TrainerConfig.sweep_metric:
        return old, "trainer.objective"
    return metric, "trainer.sweep_metric"


@dataclass
class TrainerConfig:
    max_steps: int = 300
    global_batch_size: int = 16
    micro_batch_size: int = 8
    seed: int = 0
    log_interval: int = 10
    # 0 turns eval off.
    eval_interval: int = 100
    eval_batches: int = 4
    # At each eval, each prompt (a list, or a text file of one per line; rendered with the chat template for
    # data=chat) continued greedily for sample_tokens tokens: logged to the console, metrics.jsonl and W&B.
    sample_prompts: Any = None
    sample_tokens: int = 32
    compile: bool = False
    # Gradient accumulation: skip the reduce-scatter on all but the last micro-batch, holding every unit's unsharded
    # gradient between them (2-4 more bytes per parameter on every rank). Across replicas (hsdp, ddp) the all-reduce
    # waits for the last micro-batch either way.
    defer_grad_sync: bool = False
    # Peak dense bf16 TFLOP/s of one device for MFU; null -> looked up from the GPU's name.
    peak_tflops: float | None = None
    # auto: cuda if available, else cpu.
    device: str = "auto"
    # Signals that mean: finish the step, save a resume checkpoint, exit. SIGTERM: what schedulers send before they
    # kill; others (SLURM's warning before a time limit, sbatch --signal=USR2@<s>): the same, requeued under SLURM.
    preemption_signal: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR2"])
    # Seconds from SIGTERM to the scheduler's SIGKILL (torchrun's shutdown and SLURM's KillWait: 30): when the
    # last save's time says the stop's save would end later, it is skipped and said (status.json, the log) ...
    preemption_grace_s: float = 25.0
    # ... unless this is set: then it is tried anyway.
    save_past_grace: bool = False
    # The ranks agree on signals and finished async saves every that many steps (one CPU all-reduce of four
    # numbers, whose latency grows with the ranks): a signal stops the run at the first such step after it.
    agree_every: int = 1
    # >0: profile that many steps after a warm-up step (trace and time breakdown in <run dir>/profile/).
    profile_steps: int = 0
    # What this run returns to a sweeper (hydra/sweeper=optuna): the last value of a metrics.jsonl key (eval_loss,
    # loss, eval_loss/<set>, any an objective logs; tokens_per_s: the run's median). The direction follows
    # (sweep_direction), or hydra.sweeper.direction says for any other.
    sweep_metric: str = "eval_loss"
    # Deprecated name of sweep_metric (still read, with a warning).
    objective: str | None = None
    # torch.autograd's anomaly mode, and every module's forward output, the loss and the gradients checked for
    # inf/nan each step (a sync each): the first non-finite one fails the run, named. Off: no hook is installed.
    detect_anomaly: bool = False


@dataclass
class DistributedConfig:
    # auto: cuda:nccl,cpu:gloo on CUDA (CPU tensors, as with cpu_offload, go to gloo), gloo on CPU.
    backend: str = "auto"
    # >1: this app starts that many worker processes itself (no torchrun needed).
    nproc_per_node: int = 1
    timeout_s: int = 600


@dataclass
class CheckpointConfig:
    # Save every `interval` steps (0: only at the end).
    interval: int = 100
    # false: no resume checkpoint at all, periodic, final or at a stop (a smoke test, a profile); resuming from an
    # existing one still works.
    save: bool = True
    # Complete checkpoints kept; older ones are pruned once a newer one is complete (0 keeps all).
    keep_last: int = 3
    # auto: newest complete checkpoint in the run dir; never: start fresh; or a run dir / step dir.
    resume: str = "auto"
    # (checkpoint.async, a Python keyword, is added to the schema in schema(): dcp.async_save when true.)
    # At the end, gather the full weights once and write a Hugging Face directory <run dir>/export/.
    export: bool = True
    # With model.lora: the adapters merged into the base as the export (besides <export>/adapter, PEFT's format).
    export_merged: bool = True
    # Split model.safetensors into shards above this size (bytes, or "500MB", "5GB").
    export_shard_size: str = "5GB"
    # null: the training param dtype.
    export_dtype: str | None = None


@dataclass
class DoctorConfig:
    # Measured shares above which the doctor reports a finding (fsdp_research/planner/doctor.py).
    # Communication that no compute hides, as a share of the step time.
    exposed_comm_share: float = 0.3
    # A blocking checkpoint save, as a share of the training time between two saves.
    checkpoint_share: float = 0.1
    # The fit check: whether the running config is what `fsdp-research plan --fit` picks for the device's memory
    # (a search of a few seconds on rank 0 at start-up). fit_gpu: the GPU (h100, a100, ... of metrics.hardware)
    # whose memory it fills; null: the CUDA device training runs on (off on CPU). Predicted
    # tokens/s above this config's by more than fit_margin: a finding.
    fit: bool = True
    fit_gpu: str | None = None
    fit_margin: float = 0.05
    # The share of the device's memory the fit check keeps free (as plan --fit's --headroom), beside the CUDA
    # context: fragmentation, NCCL's buffers, what the planner does not count.
    fit_headroom: float = 0.1


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # name -> {_target_, kwargs}: objects with any of on_train_start, on_before_optimizer_step, on_step_end,
    # on_eval, on_save, on_train_end (fsdp_research.callbacks).
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)


def schema() -> DictConfig:
    """TrainConfig as a structured config, plus `checkpoint.async`, a key no dataclass field can be named."""
    node = OmegaConf.structured(TrainConfig)
    with open_dict(node.checkpoint):
        node.checkpoint["async"] = False
    # Free-form maps: `sharding.reshard_override={0:false}`, `parallel.tp_plan={layers.*.mlp.up_proj:colwise}`,
    # `data.eval_sources={web:[...]}` and new `model.config.<key>=` need no `+`; the plug-in groups take their
    # target's keyword arguments (checked against its signature before any compute).
    free_form = (
        node.sharding.reshard_override,
        node.parallel.tp_plan,
        node.data.eval_sources,
        node.model.config,
        node.model,
        node.optim,
        node.schedule,
        node.loss,
        node.objective,
    )
    for free in (*free_form, node.callbacks):
        OmegaConf.set_struct(free, False)
    return node


@functools.cache
def _schema_once() -> DictConfig:
    """The schema made once per process (OmegaConf.structured takes ~70 ms a call): merge copies it, never changes
    it."""
    return schema()


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A plain container's leaves by dotted key (`optim.param_groups[0].lr_scale`)."""
    if isinstance(node, dict):
        dot = f"{prefix}." if prefix else ""
        return {k: v for key, value in node.items() for k, v in flat(value, f"{dot}{key}").items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in flat(value, f"{prefix}[{i}]").items()}
    return {prefix: node}


def typed(cfg: Any) -> DictConfig:
    """A config (DictConfig or plain dict) merged onto the schema, so values have their declared types. The
    deprecated optim.warmup_steps / optim.min_lr_ratio move to the schedule group, trainer.objective to
    trainer.sweep_metric (with a warning)."""
    cfg = OmegaConf.merge(_schema_once(), cfg)
    old = cfg.trainer.objective
    if old is not None:
        # Every config written before the rename holds its default, eval_loss (sweep_metric's): moved unsaid.
        if old != "eval_loss":
            warnings.warn("trainer.objective is deprecated: use trainer.sweep_metric", FutureWarning, stacklevel=2)
        cfg.trainer.sweep_metric, cfg.trainer.objective = swept(cfg.trainer.sweep_metric, old)[0], None
    for key in ("warmup_steps", "min_lr_ratio"):
        if cfg.optim[key] is not None:
            warnings.warn(f"optim.{key} is deprecated: use schedule.{key}", FutureWarning, stacklevel=2)
            cfg.schedule[key], cfg.optim[key] = cfg.optim[key], None
    return cfg
