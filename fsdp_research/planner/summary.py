"""What the planner knows of a config: each FSDP unit's parameter shapes (from the sharding plan of the meta-device
model, built as the trainer builds it), the block's dimensions, and the run's settings (world size, dtypes,
batch). Everything in fsdp_research.planner.memory is a pure function of these two."""

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from fsdp_research.config.schema import CheckpointMode, Strategy
from fsdp_research.config.targets import kwargs_of, resolve
from fsdp_research.distributed.expert_parallel import fused_experts, split_experts
from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.pipeline import stages_of, zero_bubble
from fsdp_research.distributed.precision import dtypes, kept_in_fp32, parse_dtype
from fsdp_research.distributed.sharding import ShardingPlan, build_plan, owner
from fsdp_research.distributed.tensor_parallel import sequence_parallel, tp_plan
from fsdp_research.metrics.meters import active_parameters, flops_per_token, matmul_parameters
from fsdp_research.model.architecture import build_hf_config, input_embedding, output_layer
from fsdp_research.model.assembly import planned_model
from fsdp_research.model.dimensions import dims
from fsdp_research.optim.factory import block_matrices
from fsdp_research.optim.muon_params import describe, muon_split
from fsdp_research.optim.state_size import state_copies


@functools.cache
def _shard_numel(shapes: tuple[tuple[int, int], ...], n: int) -> int:
    """Elements per rank, FSDP2 padding each dim 0 to a multiple of n (cached: plan --fit asks thousands of times)."""
    return sum(-(-rows // n) * row for rows, row in shapes)


@dataclass(frozen=True)
class UnitSize:
    """One FSDP unit: the parameters it owns, as (dim 0, elements per dim-0 row), in forward order."""

    path: str
    shapes: tuple[tuple[int, int], ...]
    # An int k: resharded to groups of k ranks after forward.
    reshard_after_forward: bool | int
    # The block it lies in; None for the root.
    block: int | None
    # Of `shapes`, those of its frozen parameters (LoRA's base): no gradient, no optimizer state.
    frozen: tuple[tuple[int, int], ...] = ()
    # Routed experts split over parallel.ep ranks: `shapes` are one ep rank's experts, sharded over the shard
    # group's 1/ep (dp_mod_ep).
    ep: int = 1

    @functools.cached_property
    def numel(self) -> int:
        return sum(rows * row for rows, row in self.shapes)

    @functools.cached_property
    def largest(self) -> int:
        return max((rows * row for rows, row in self.shapes), default=0)

    def shard_numel(self, n: int) -> int:
        return _shard_numel(self.shapes, self.group(n))

    def group(self, n: int) -> int:
        """The ranks a shard group of n shards this unit over (expert parallel: n / ep)."""
        return max(1, n // self.ep)

    def trained(self) -> "UnitSize":
        """The unit as its gradients and optimizer state see it: its trainable parameters alone."""
        if not self.frozen:
            return self
        left = list(self.shapes)
        for shape in self.frozen:
            left.remove(shape)
        return UnitSize(self.path, tuple(left), self.reshard_after_forward, self.block, ep=self.ep)

    def kept_after_forward(self) -> int | None:
        """The group size its parameters stay sharded over from forward to backward: 1 (kept whole), k (resharded
        to k ranks), None (resharded over the shard group)."""
        flag = self.reshard_after_forward
        return 1 if flag is False else None if flag is True else flag


@dataclass(frozen=True)
class ModelSummary:
    """What the memory model needs of a model and its plan: parameter shapes per unit, block shapes."""

    name: str
    model_type: str
    n_params: int
    # The parameters a token passes through (a mixture of experts: top-k of its experts'); n_params if dense.
    active_params: int
    experts: int
    experts_per_token: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int
    vocab: int
    n_blocks: int
    sdpa: bool
    strategy: Strategy
    checkpointed: tuple[bool, ...]
    # The units below the root, in forward order (none for root_only and ddp).
    units: tuple[UnitSize, ...]
    # What the root unit owns (ddp: the whole model).
    root: UnitSize
    # Root-owned elements inside each block (norms under per_linear, whole blocks under root_only).
    root_in_block: tuple[int, ...]
    # The input embedding when untied: its gradient only appears at the very end of backward.
    input_embedding: int
    # Norm scales frozen (LoRA): their backward needs no normalized input saved.
    frozen_norms: bool = False
    # The optimizer: fp32 copies of a parameter in its state, averaged over the parameters (AdamW 2, Muon's
    # matrices 1 beside AdamW for the rest), its name, whether the copies are known (else assumed 2).
    optimizer_copies: float = 2.0
    optimizer: str = "AdamW"
    optimizer_known: bool = True
    # With optim.others: what each optimizer takes, in one line (muon_params.describe).
    optimizer_split: str = ""
    # The matrices a whole-matrix optimizer (Muon: optim.others set) exchanges and orthogonalizes, [rows, cols] in
    # model order; its Newton-Schulz iterations and their dtype's bytes (0 iterations: one the planner does not know).
    whole_shapes: tuple[tuple[int, int], ...] = ()
    ns_steps: int = 0
    ns_bytes: int = 2
    # Checkpointed blocks: 0, full (only the input kept); n, selective (the 1st, (1+n)-th, ... matmul outputs kept).
    selective_every: int = 0
    # Selective: attention's output kept (an SDPA kernel among save_ops); matmul outputs kept (aten.mm among them).
    selective_attention: bool = True
    selective_matmuls: bool = True
    # Training FLOPs per token (forward + backward, the MFU count), and the output layer's forward FLOPs per token.
    flops_per_token: float = 0.0
    head_flops_per_token: float = 0.0
    # Tensor parallel (parallel.tp): the units' shapes, heads, kv_dim, q_dim and intermediate are one tp rank's;
    # hidden, the embeddings and the head are whole. Sequence parallel: the blocks' norms and residual stream split.
    tp: int = 1
    sequence_parallel: bool = False
    # Width of the attention's queries and output (heads x head_dim; 0: hidden).
    q_dim: int = 0
    # Expert parallel (parallel.ep): the blocks (indices) holding routed experts, whose tokens it moves.
    ep: int = 1
    moe_blocks: tuple[int, ...] = ()
    # The final norm, the logits and the loss are this rank's (pipeline parallel: the last stage's alone); the
    # token embedding (pipeline parallel: the first stage's; the others receive hidden states).
    loss_here: bool = True
    embeds_here: bool = True

    @property
    def q_width(self) -> int:
        return self.q_dim or self.hidden

    @functools.cached_property
    def whole_matrices(self) -> int:
        return sum(rows * cols for rows, cols in self.whole_shapes)


def summarize(cfg: DictConfig, model: nn.Module, plan: ShardingPlan, hf_config, stage: int = 0) -> ModelSummary:
    """The plan's units with the parameter shapes each one owns (a unit owns what no deeper unit owns); stage: the
    pipeline rank whose stages `model` holds (parallel.pp > 1)."""
    paths = [u.path for u in plan.units] or [""]
    tp, ep = cfg.parallel.tp, cfg.parallel.ep
    experts = {u.path for u in plan.units if u.experts}
    owned, frozen = _owned(cfg, model, paths, experts)

    def block_of(name: str) -> int | None:
        return next((i for i, b in enumerate(plan.blocks) if name == b or name.startswith(b + ".")), None)

    # The zero-bubble schedules keep every unit gathered over the step (pipeline.deferred_reduction).
    gathered = zero_bubble(cfg.parallel)
    flags = {u.path: False if gathered else u.reshard_after_forward for u in plan.units}
    units = tuple(
        UnitSize(
            p,
            tuple(s for _, s in owned[p]),
            flags.get(p, False),
            block_of(p) if p else None,
            tuple(frozen[p]),
            ep if p in experts else 1,
        )
        for p in paths
    )
    d = dims(model, plan.blocks)
    return ModelSummary(
        name=cfg.model.name,
        model_type=hf_config.model_type if hf_config is not None else cfg.model._target_,
        n_params=sum(p.numel() for p in model.parameters()),
        active_params=active_parameters(model, d),
        experts=d.experts,
        experts_per_token=d.experts_per_token,
        hidden=d.hidden,
        intermediate=d.intermediate // tp,
        heads=d.heads // tp,
        kv_dim=d.kv_heads * d.head_dim // tp,
        q_dim=d.heads * d.head_dim // tp,
        vocab=d.vocab,
        n_blocks=len(plan.blocks),
        sdpa=getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") != "eager",
        strategy=plan.strategy,
        checkpointed=tuple(isinstance(model.get_submodule(b), CheckpointWrapper) for b in plan.blocks),
        units=units[:-1] if plan.units else (),
        root=units[-1],
        root_in_block=_root_in_block(owned[""], block_of, len(plan.blocks)),
        **_ends(cfg.parallel, model, d, stage),
        frozen_norms=_frozen_vectors(model),
        **_optimizer(cfg.optim, model, plan),
        **_checkpointing(cfg.activation_checkpointing),
        flops_per_token=flops_per_token(
            d, matmul_parameters(model, d), cfg.data.seq_len, matmul_parameters(model, d, frozen=True)
        ),
        tp=tp,
        sequence_parallel=sequence_parallel(cfg.parallel),
        ep=ep,
        moe_blocks=tuple(sorted({block_of(p) for p in fused_experts(model)} - {None})),
    )


def _ends(parallel, model: nn.Module, d, stage: int) -> dict:
    """What the pipeline's ends hold, by the rank's stages (not by the modules left: with tied embeddings the first
    stage keeps the head's weight for its passthrough, the last the embedding): the token embedding on the first,
    the head, logits and loss on the last (both at pp = 1)."""
    first, last = True, True
    if parallel.pp > 1:  # the schedule's name and stages a rank are read (and checked) only with stages
        held, stages = stages_of(stage, parallel)
        first, last = 0 in held, stages - 1 in held
    embedding = input_embedding(model)
    output = output_layer(model) if last else None
    tied = output is not None and embedding is not None and any(p is embedding.weight for p in output.parameters())
    return {
        "input_embedding": embedding.weight.numel() if first and not tied else 0,
        "head_flops_per_token": 2.0 * d.hidden * d.vocab if output is not None else 0.0,
        "loss_here": last,
        "embeds_here": first,
    }


def _root_in_block(root_owned: list, block_of: Callable[[str], int | None], n_blocks: int) -> tuple[int, ...]:
    """The root unit's elements inside each block (norms under per_linear, whole blocks under root_only)."""
    inside = [0] * n_blocks
    for name, (rows, row) in root_owned:
        if block_of(name) is not None:
            inside[block_of(name)] += rows * row
    return tuple(inside)


def _owned(cfg: DictConfig, model: nn.Module, paths: list[str], experts: set[str]) -> tuple[dict, dict]:
    """({unit path: [(parameter name, one rank's [rows, elements per row])]}, {unit path: its frozen shapes}): a tp
    rank's part of each split Linear, an ep rank's experts."""
    owned: dict[str, list[tuple[str, tuple[int, int]]]] = {p: [] for p in paths}
    frozen: dict[str, list[tuple[int, int]]] = {p: [] for p in paths}
    tp, ep = cfg.parallel.tp, cfg.parallel.ep
    split = tp_plan(model, cfg.parallel) if tp > 1 else {}
    units = set(paths)
    for name, param in model.named_parameters():
        shape = _tp_shape(param, split.get(clean_name(name).rpartition(".")[0]), name, tp)
        if name.rpartition(".")[0] in experts:  # one ep rank's experts
            shape = (shape[0] // ep, shape[1])
        unit = owner(name, units)
        owned[unit].append((name, shape))
        if not param.requires_grad:
            frozen[unit].append(shape)
    return owned, frozen


def _tp_shape(param: nn.Parameter, style: str | None, name: str, tp: int) -> tuple[int, int]:
    """[rows, elements per row] of one tp rank's part: a colwise Linear's rows split, a rowwise one's columns (its
    bias whole)."""
    rows, row = (param.shape[0], param[0].numel()) if param.dim() else (1, 1)
    if style is None:
        return rows, row
    if style.startswith("colwise"):
        return rows // tp, row
    return (rows, row // tp) if name.endswith("weight") else (rows, row)


def _frozen_vectors(model: nn.Module) -> bool:
    vectors = [p for p in model.parameters() if p.dim() == 1]
    return bool(vectors) and not any(p.requires_grad for p in vectors)


def _checkpointing(cfg: DictConfig) -> dict:
    if cfg.mode is not CheckpointMode.selective:
        return {}
    kernels = [name for name in cfg.save_ops if "scaled_dot_product" in name]
    return dict(
        selective_every=cfg.mm_save_every,
        selective_attention=bool(kernels),
        selective_matmuls="aten.mm" in cfg.save_ops,
    )


def _whole_matrices(model: nn.Module, plan: ShardingPlan) -> list[nn.Parameter]:
    """What the whole-matrix optimizer (optim._target_ beside optim.others) takes: the optimizer builder's own
    selection, called here alone."""
    matrices = block_matrices(model, plan.blocks)
    return [p for p in model.parameters() if id(p) in matrices]


def _matrix_shapes(params: list[nn.Parameter]) -> tuple[tuple[int, int], ...]:
    """[rows, cols] of each matrix orthogonalized (a stack of them, as experts' 3-D weights: each on its own)."""
    return tuple((p.shape[-2], p.shape[-1]) for p in params for _ in range(math.prod(p.shape[:-2])))


def _newton_schulz(o: DictConfig) -> dict:
    """ns_steps and ns_dtype's bytes: the config's, else its optimizer's defaults."""
    params = inspect.signature(resolve(o._target_, "optim._target_")).parameters
    values = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    values.update(kwargs_of(o))
    return dict(
        ns_steps=int(values.get("ns_steps", 0)),
        ns_bytes=parse_dtype(values.get("ns_dtype", "bfloat16"), "optim.ns_dtype").itemsize,
    )


def _optimizer(o: DictConfig, model: nn.Module, plan: ShardingPlan) -> dict:
    """The optimizer's state per trained parameter: optim._target_'s, with optim.others for all but the whole
    matrices."""
    main = state_copies(o._target_, kwargs_of(o))
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if o.others is None:
        return dict(optimizer_copies=main[0], optimizer=o._target_.rsplit(".", 1)[-1], optimizer_known=main[1])
    whole = _whole_matrices(model, plan)
    inside = sum(p.numel() for p in whole)
    rest = state_copies(o.others._target_, kwargs_of(o.others))
    names = f"{o._target_.rsplit('.', 1)[-1]} + {o.others._target_.rsplit('.', 1)[-1]}"
    return dict(
        optimizer_copies=(main[0] * inside + rest[0] * (total - inside)) / total,
        optimizer=names,
        optimizer_known=main[1] and rest[1],
        optimizer_split=describe(muon_split(model, plan.blocks), o._target_, o.others._target_),
        whole_shapes=_matrix_shapes(whole),
        **_newton_schulz(o),
    )


def summary_for(cfg: DictConfig, stage: int = 0) -> ModelSummary:
    """stage: the pipeline rank whose stages are summarized (parallel.pp > 1)."""
    hf_config = build_hf_config(cfg.model)
    model, plan = planned_model(cfg, hf_config, values=False, stage=stage)
    return summarize(cfg, model, plan, hf_config, stage)


def summaries_by_sharding(
    configs: list[DictConfig], planned: tuple[nn.Module, ShardingPlan] | None = None, stage: int = 0
) -> list[ModelSummary]:
    """The summaries of configs that differ in their sharding only, from one model build (a large model's takes
    most of the planner's time), or from `planned`: a model already planned for one of them, before sharding;
    stage: the pipeline rank whose stages are summarized (the same parallel.pp in every config)."""
    hf_config = build_hf_config(configs[0].model)
    model, first = planned or planned_model(configs[0], hf_config, values=False, stage=stage)
    blocks = [model.get_submodule(path) for path in first.blocks]
    fp32 = kept_in_fp32(model, dtypes(configs[0].precision)[0])
    return [
        summarize(
            cfg,
            model,
            build_plan(model, blocks, cfg.sharding, fp32, split_experts(model, cfg.parallel.ep)),
            hf_config,
            stage,
        )
        for cfg in configs
    ]
